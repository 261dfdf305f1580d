"""``eagle3``: the EAGLE repo's / SGLang's / SpecForge's EAGLE-3 layout (SafeAILab/EAGLE ``eagle/model/cnets.py``;
SGLang ``models/llama_eagle3.py``): a flat ``config.json`` with ``architectures: ["LlamaForCausalLMEagle3"]``;
weights ``fc.*``, ``midlayer.*`` (``layers.0.*``, vLLM's name, is read too), ``norm``, ``lm_head``, ``d2t`` offsets
and ``t2d``.

Its explicit ``eagle_aux_hidden_state_layer_ids``: id i = the OUTPUT of layer i = ``hidden_states[i + 1]``. SGLang
``python/sglang/srt/models/llama.py`` ``set_eagle3_layers_to_capture``: "for the ith layer, it takes the output of
the (i-1)th layer", so it captures before layer ``id + 1``. A head reading ``hidden_states[0]`` cannot be written
here. The layout holds llama layers and no speculators options (SGLang would drop them).

llama.cpp (the tree vendored by llama-cpp-python 0.3.36) converts it as written here (``convert_hf_to_gguf.py
--target-model-dir``: ``conversion/llama.py:49-105`` config, ``:211-230`` ``midlayer.*``, ``:338-351`` ``d2t``
offsets made absolute) but reads explicit ids the speculators way (``conversion/llama.py:77-80``,
``common/speculative.cpp:541-543``): a head with explicit ids goes to llama.cpp as ``speculators``; one without
gets the same defaults ``[2, L // 2, L - 3]`` on both sides (``scripts/llamacpp_eagle3.py`` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from dynvocab.errors import DynvocabError
from dynvocab.models.eagle.config import EAGLE3, EagleConfig
from dynvocab.models.eagle.layouts.registry import Layout, Names, eagle3_fields


@dataclass(frozen=True)
class Eagle3Layout(Layout):
    """EAGLE-3 heads as the EAGLE repo and SGLang write them."""

    def recognize(self, config: dict, names: Names) -> bool:
        found = names()
        return "fc.weight" in found and (any(n.startswith("midlayer.") for n in found) or "d2t" in found)

    def config_json(self, cfg: EagleConfig, layer: dict, target_name: str | None) -> dict:
        options = [n for n in ("norm_before_fc", "fc_norm", "norm_output", "sliding_window") if getattr(cfg, n)]
        if cfg.arch != "llama":
            options.insert(0, f"a {cfg.arch} layer")
        if options:
            raise DynvocabError(f"the eagle3 layout cannot hold {options[0]} (SGLang would drop it); write it as speculators")
        return {**layer, "architectures": ["LlamaForCausalLMEagle3"], "bias": cfg.has_fc_bias, **eagle3_fields(cfg, self)}


LAYOUT = Eagle3Layout(
    "eagle3", EAGLE3, family="eagle", priority=20, aux_offset=1, aux_means="the output of layer i",
    renames_in=(("layers.0.", "midlayer."),),
    help="the EAGLE repo's and SGLang's EAGLE-3 layout (SpecForge and llama.cpp read it)",
)
