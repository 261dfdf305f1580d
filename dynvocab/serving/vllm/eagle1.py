"""vLLM's EAGLE-1 head (``llama_eagle.py``) widened to the heads dynvocab trains and ships (imported by vLLM's
workers only, as the base of the plugin's EAGLE-1 classes, :mod:`.models`).

vLLM's ``EagleLlamaForCausalLM`` builds one Llama layer with a SiLU MLP, an ``fc`` without bias, and embeds the fed
token with the target's bare embedding table. dynvocab's EAGLE-1 heads (:class:`dynvocab.models.eagle.Eagle1Model`,
``demo:gemma-eagle1`` among them) may differ in three ways, each taken here as dynvocab's own loop runs it:

- **the MLP's activation**: the head's ``hidden_act`` (Gemma's ``gelu_pytorch_tanh``) through vLLM's own
  ``GeluAndMul`` / ``SiluAndMul``, ``act(gate) * up`` as transformers' ``LlamaMLP`` computes it;
- **a bias on fc** (the EAGLE repo's ``bias: true``, its default): ``fc`` is built with one, left at zero where the
  checkpoint has none (adding zero changes nothing);
- **the target's embedding scale**: a Gemma target multiplies its embedding rows by sqrt(hidden) in the model's dtype
  (``gemma3.py``'s ``normalizer``; transformers' ``Gemma3TextScaledWordEmbedding``), which the shared table vLLM
  hands the draft does not. ``fc(cat(s·e, h)) = (s·W_e) e + W_h h + b``, so the scale is folded once into ``fc``'s
  embedding columns after loading, and the forward pass stays vLLM's.

Everything else (attention, caches, the proposer's sharing of the target's embedding and head) is vLLM's.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM

from dynvocab.errors import DynvocabError
from dynvocab.serving.vllm.names import EAGLE1_ACTIVATIONS, SCALED_EMBEDDING_TYPES

# the head's hidden_act -> vLLM's act-and-mul (names.EAGLE1_ACTIVATIONS lists the same names, for the export's check)
_ACT_AND_MUL = {"silu": SiluAndMul, "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"), "gelu": lambda: GeluAndMul()}


def target_embedding_scale(vllm_config) -> float:
    """The factor the target multiplies its embedding rows by, in the model's dtype as vLLM's Gemma keeps it
    (sqrt(hidden) for the :data:`~.names.SCALED_EMBEDDING_TYPES`), 1.0 for any other target."""
    config = vllm_config.model_config.hf_config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) not in SCALED_EMBEDDING_TYPES:
        return 1.0
    return float(torch.tensor(int(text.hidden_size) ** 0.5, dtype=vllm_config.model_config.dtype))


class EagleHeadForCausalLM(EagleLlamaForCausalLM):
    """vLLM's EAGLE-1 head with the head's activation, an fc bias and the target's embedding scale."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        config = vllm_config.speculative_config.draft_model_config.hf_config
        act = getattr(config, "hidden_act", "silu")
        if act not in _ACT_AND_MUL:
            raise DynvocabError(f"this EAGLE-1 head's activation {act} has no vLLM kernel here; "
                                f"supported: {', '.join(EAGLE1_ACTIVATIONS)}")
        config.hidden_act = "silu"  # vLLM's LlamaMLP builds SiLU only; the act is replaced below
        try:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        finally:
            config.hidden_act = act
        for layer in self.model.layers:
            layer.mlp.act_fn = _ACT_AND_MUL[act]()
        fc = self.model.fc
        self.model.fc = ReplicatedLinear(input_size=fc.input_size, output_size=fc.output_size, bias=True,
                                         params_dtype=fc.weight.dtype, quant_config=fc.quant_config,
                                         prefix=fc.prefix, return_bias=False)
        with torch.no_grad():
            self.model.fc.bias.zero_()
        self.embed_scale = target_embedding_scale(vllm_config)

    def load_weights(self, weights):
        """vLLM's loading, then the target's embedding scale folded into ``fc``'s embedding columns."""
        out = super().load_weights(weights)
        if self.embed_scale != 1.0:
            with torch.no_grad():
                d = int(self.config.hidden_size)
                w = self.model.fc.weight
                w[:, :d] = (w[:, :d].float() * self.embed_scale).to(w.dtype)
        return out
