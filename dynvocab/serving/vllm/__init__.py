"""dynvocab's vLLM plugin: draft architectures whose head runs a dynvocab selector.

vLLM loads it through the entry point ``dynvocab = dynvocab.serving.vllm:register`` in the group
``vllm.general_plugins`` (``vllm/plugins/__init__.py:load_general_plugins``, in the engine and in every worker).
:func:`register` names the classes to vLLM's ``ModelRegistry`` as ``module:class`` strings, so nothing is imported
until a worker builds a draft whose folder names one of them (``dynvocab export --format vllm``). This package
imports vLLM only in :mod:`dynvocab.serving.vllm.models`.
"""

from __future__ import annotations

from dynvocab.serving.vllm.names import ARCHITECTURES


def register() -> None:
    """Register the plugin's draft architectures with vLLM's ``ModelRegistry`` (called by vLLM)."""
    from vllm import ModelRegistry

    for name, _ in ARCHITECTURES.values():
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"dynvocab.serving.vllm.models:{name}")
