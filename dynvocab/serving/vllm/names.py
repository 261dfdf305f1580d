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

# The EAGLE-1 heads' base: vLLM's ``llama_eagle:EagleLlamaForCausalLM`` with what dynvocab's heads add
EAGLE1_BASE = "dynvocab.serving.vllm.eagle1:EagleHeadForCausalLM"
# The MLP activations an EAGLE-1 head may have in vLLM (eagle1.py maps each to vLLM's act-and-mul)
EAGLE1_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
# Targets whose embedding rows are scaled by sqrt(hidden) before the first layer (vLLM's gemma*.py ``normalizer``),
# which a head sharing the target's bare table must scale too (by text config ``model_type``)
SCALED_EMBEDDING_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")

# (draft kind, the draft's own architecture) -> (registered name, "module:class" of its base: vLLM's draft class,
# or for EAGLE-1 the plugin's widening of it)
ARCHITECTURES: dict[tuple[str, str], tuple[str, str]] = {
    ("draft-model", "Qwen2ForCausalLM"): ("DynvocabQwen2ForCausalLM", "vllm.model_executor.models.qwen2:Qwen2ForCausalLM"),
    ("draft-model", "Qwen3ForCausalLM"): ("DynvocabQwen3ForCausalLM", "vllm.model_executor.models.qwen3:Qwen3ForCausalLM"),
    ("draft-model", "LlamaForCausalLM"): ("DynvocabLlamaForCausalLM", "vllm.model_executor.models.llama:LlamaForCausalLM"),
    # vLLM's EAGLE-1 head widened to dynvocab's (eagle1.py: the head's activation, fc bias, a Gemma target's scale)
    ("eagle1", "LlamaForCausalLM"): ("EagleDynvocabLlamaForCausalLM", EAGLE1_BASE),
    # vLLM registers no EagleQwen2ForCausalLM: a Qwen2 layer is a llama layer with q/k/v biases, which vLLM's llama
    # layer builds from ``qkv_bias`` (folder.py writes it, and model_type llama, into the folder's config)
    ("eagle1", "Qwen2ForCausalLM"): ("EagleDynvocabQwen2ForCausalLM", EAGLE1_BASE),
    ("eagle3", "LlamaForCausalLM"): ("Eagle3DynvocabLlamaForCausalLM",
                                     "vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM"),
    ("eagle3", "Qwen3ForCausalLM"): ("Eagle3DynvocabQwen3ForCausalLM",
                                     "vllm.model_executor.models.qwen3_eagle3:Eagle3Qwen3ForCausalLM"),
}


def registered_name(kind: str, architecture: str) -> str | None:
    """The plugin's architecture for a draft of ``kind`` whose own architecture is ``architecture`` (None: none)."""
    hit = ARCHITECTURES.get((kind, architecture))
    return hit[0] if hit else None
