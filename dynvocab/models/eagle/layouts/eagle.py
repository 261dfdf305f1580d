"""``eagle``: the EAGLE repo's EAGLE-1/2 layout (SafeAILab/EAGLE ``eagle/model/cnets1.py``; SGLang reads it too,
``models/llama_eagle.py`` and ``qwen2_eagle.py``).

A flat ``config.json`` (the decoder layer's fields, ``bias`` for ``fc``); weights ``fc.*`` and ``layers.0.*`` as
the model names them. A Qwen2 layer keeps its q/k/v biases.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynvocab.models.eagle.config import EAGLE1, EagleConfig
from dynvocab.models.eagle.layouts.registry import Layout, Names


@dataclass(frozen=True)
class EagleLayout(Layout):
    """EAGLE-1/2 heads as the EAGLE repo writes them."""

    def recognize(self, config: dict, names: Names) -> bool:
        found = names()
        return "fc.weight" in found and any(n.startswith("layers.0.") for n in found)

    def arch(self, layer: dict) -> str:
        """``qwen2`` for a Qwen2 config, or for the EAGLE repo's llama config with ``qkv_bias`` (cnets1.py
        ``LlamaAttention``: q/k/v biases, none on o_proj — a Qwen2 layer); else ``llama``."""
        qwen2 = layer.get("model_type", "llama") == "qwen2" or "Qwen2" in "".join(layer.get("architectures") or [])
        return "qwen2" if qwen2 or layer.get("qkv_bias") else "llama"

    def config_json(self, cfg: EagleConfig, layer: dict, target_name: str | None) -> dict:
        return {**layer, "bias": cfg.has_fc_bias}


LAYOUT = EagleLayout(
    "eagle", EAGLE1, family="eagle", priority=10,
    help="the EAGLE repo's EAGLE-1/2 layout (SGLang loads it)",
)
