"""dynvocab's vLLM plugin: draft architectures whose head runs a dynvocab selector.

vLLM loads it through the entry point ``dynvocab = dynvocab.serving.vllm:register`` in the group
``vllm.general_plugins`` (``vllm/plugins/__init__.py:load_general_plugins``, in the engine and in every worker).
:func:`register` first checks the installed vLLM against the plugin's contract (:mod:`.contract`), then names the
classes to vLLM's ``ModelRegistry`` as ``module:class`` strings, so nothing of the plugin's heads is imported until a
worker builds a draft whose folder names one of them (``dynvocab export --format vllm``). This package imports vLLM
only here (in :func:`register`), in :mod:`.models`, :mod:`.eagle1` and :mod:`.head`, and, for the check, in
:mod:`.contract`.
"""

from __future__ import annotations

import logging
import os

from dynvocab.errors import DynvocabError
from dynvocab.serving.vllm.names import ARCHITECTURES

# Set in the first process that checks vLLM (the one the user started); the engine's and workers' processes inherit
# it, so the check runs and each warning prints once per server or LLM, not once per process.
CHECKED_ENV = "DYNVOCAB_VLLM_CHECKED"

# A child of vLLM's own logger: the plugin's lines print as vLLM's do (vllm/logger.py configures "vllm").
logger = logging.getLogger("vllm.dynvocab")
NO_HOOK = ("dynvocab: this vLLM has no {} where a proposal begins, so a draft cannot know its batch rows' requests: "
           "the context strategies (those reading a window, a lookup or a request's state) are refused; "
           "the context-free ones serve")
# Where vLLM has the hook but the engine runs Model Runner V2, which never calls it (contract.RUNNER_SWITCH).
ON_RUNNER_V2 = ("dynvocab: this engine runs vLLM's Model Runner V2 (VllmConfig.use_v2_model_runner), which drafts "
                "without the V1 runner's propose_draft_token_ids where the plugin learns a proposal's batch, so a "
                "draft cannot know its batch rows' requests: the context strategies (those reading a window, a "
                "lookup or a request's state) are refused ({} is one; VLLM_USE_V2_MODEL_RUNNER=0 runs the V1 "
                "runner); the context-free ones serve")


def register() -> None:
    """Check the installed vLLM and register the plugin's draft architectures with its ``ModelRegistry`` (called by
    vLLM, unguarded, in every process). It never raises: on a vLLM that lacks a piece the plugin uses it logs one
    line naming it and registers nothing, so vLLM still starts for every model but the plugin's draft folders (whose
    architecture vLLM then refuses at load, in its own one line); a version the plugin was not tested with runs with
    one warning; where vLLM is known to sample wrongly under speculation, one warning says so. Where vLLM has the
    runner method where a proposal begins, it is wrapped (:mod:`.proposal`), else the context strategies are refused
    (one line here, and again where a draft folder asks for one). Which runner an engine runs is known from its
    config only: where it is Model Runner V2 (vLLM 0.33's default on GPUs), which never calls the wrapped method, a
    draft folder asking for a context strategy is refused at load in one line (:func:`.head.load_policy`,
    :func:`.contract.runs_model_runner_v2`); here nothing changes. The exporter of the rows that drafted without
    their request's context is installed in the first process (:mod:`.without_context`)."""
    from vllm import ModelRegistry

    try:
        check_vllm()
    except DynvocabError:
        return  # logged by check_vllm; nothing registered
    from dynvocab.serving.vllm import contract, proposal, without_context

    without_context.install_exporter()
    if not contract.missing("context"):
        proposal.install()
    for name, _ in ARCHITECTURES.values():
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"dynvocab.serving.vllm.models:{name}")


def check_vllm() -> list[str]:
    """Check the installed vLLM once per process tree; returns the warnings it logged. Raises
    :class:`~dynvocab.errors.DynvocabError` (one line, also logged) where a seam is missing (:func:`register`
    catches it)."""
    from dynvocab.serving.vllm import contract

    version = contract.vllm_version()
    if os.environ.get(CHECKED_ENV) == version:
        return []
    lost = contract.missing()
    hook = contract.missing("context")
    if hook:
        logger.error(NO_HOOK.format(", ".join(hook)))
    if lost:
        message = (f"dynvocab's vLLM plugin cannot run on vLLM {version}: it lacks {', '.join(lost)} "
                   f"(tested: vLLM {', '.join(contract.TESTED_VERSIONS)}; source read: "
                   f"{', '.join(contract.READ_VERSIONS)}); "
                   "install a supported vLLM, or leave the plugin out with VLLM_PLUGINS (docs/vllm.md)")
        logger.error(message)
        raise DynvocabError(message)
    said = []
    if not contract.is_tested(version):
        read = " (its source was read, not run)" if contract.release(version) in contract.READ_VERSIONS else ""
        said.append(f"dynvocab's vLLM plugin was not tested with vLLM {version}{read}; every piece of vLLM it uses "
                    f"is present, so it runs (tested: {', '.join(contract.TESTED_VERSIONS)})")
    bug = contract.sampling_bug(version, _platform())
    if bug:
        said.append(f"dynvocab: this vLLM ({version} on {_platform()}) samples wrongly with speculative decoding: requests "
                    f"with temperature > 0 to a speculating engine return wrong text, and seeded repeats differ "
                    f"({bug}); greedy requests (temperature 0) are exact, and plain decoding is unaffected")
    for line in said:
        logger.warning(line)
    os.environ[CHECKED_ENV] = version
    return said


def _platform() -> str:
    """vLLM's platform here: "cpu", "cuda", …"""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
