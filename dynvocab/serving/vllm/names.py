"""The draft architectures the vLLM plugin registers, and the draft folder's names (no vLLM import).

A draft folder names one of these in its ``config.json`` ``architectures``; vLLM's worker builds that class, a
subclass of vLLM's own (``vllm/model_executor/models/registry.py``), whose head runs a dynvocab selector. EAGLE
names keep vLLM's prefixes: ``EAGLEConfig`` (``vllm/transformers_utils/configs/eagle.py``) prefixes ``Eagle`` /
``Eagle3`` to an architecture that lacks it, and leaves one that has it as it is.
"""

from __future__ import annotations

CONFIG_KEY = "dynvocab"  # the config.json section: strategy, budget, policy file, fingerprints
# The policy's tensors: a dynvocab bundle of the stages the strategy reads. In a subfolder, because vLLM loads every
# ``*.safetensors`` at the folder's top as model weights (``model_executor/model_loader/default_loader.py``).
POLICY_FILE = "dynvocab/policy.safetensors"
FOLDER_FORMAT = 1

# (draft kind, the draft's own architecture) -> (registered name, "module:class" of vLLM's base class)
ARCHITECTURES: dict[tuple[str, str], tuple[str, str]] = {
    ("draft-model", "Qwen2ForCausalLM"): ("DynvocabQwen2ForCausalLM", "vllm.model_executor.models.qwen2:Qwen2ForCausalLM"),
    ("draft-model", "Qwen3ForCausalLM"): ("DynvocabQwen3ForCausalLM", "vllm.model_executor.models.qwen3:Qwen3ForCausalLM"),
    ("draft-model", "LlamaForCausalLM"): ("DynvocabLlamaForCausalLM", "vllm.model_executor.models.llama:LlamaForCausalLM"),
    ("eagle1", "LlamaForCausalLM"): ("EagleDynvocabLlamaForCausalLM",
                                     "vllm.model_executor.models.llama_eagle:EagleLlamaForCausalLM"),
    # vLLM registers no EagleQwen2ForCausalLM: a Qwen2 layer is a llama layer with q/k/v biases, which vLLM's llama
    # layer builds from ``qkv_bias`` (folder.py writes it, and model_type llama, into the folder's config)
    ("eagle1", "Qwen2ForCausalLM"): ("EagleDynvocabQwen2ForCausalLM",
                                     "vllm.model_executor.models.llama_eagle:EagleLlamaForCausalLM"),
    ("eagle3", "LlamaForCausalLM"): ("Eagle3DynvocabLlamaForCausalLM",
                                     "vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM"),
    ("eagle3", "Qwen3ForCausalLM"): ("Eagle3DynvocabQwen3ForCausalLM",
                                     "vllm.model_executor.models.qwen3_eagle3:Eagle3Qwen3ForCausalLM"),
}


def registered_name(kind: str, architecture: str) -> str | None:
    """The plugin's architecture for a draft of ``kind`` whose own architecture is ``architecture`` (None: none)."""
    hit = ARCHITECTURES.get((kind, architecture))
    return hit[0] if hit else None
