"""``speculators``: vllm-project/speculators' EAGLE-3 layout (speculators ``models/eagle3/{config,core,
model_definitions}.py``; vLLM ``transformers_utils/configs/speculators/{base,algos}.py``).

``config.json`` with ``speculators_model_type: "eagle3"`` and the decoder layer nested in
``transformer_layer_config`` (a llama or qwen3 layer); weights ``layers.0.*`` instead of ``midlayer.*``;
``norm_before_residual`` true when absent (vLLM's default; speculators always writes it); the options
``norm_before_fc`` / ``fc_norm`` / ``norm_output`` and a sliding window; a full-vocabulary head has no
``d2t``/``t2d`` and always carries ``embed_tokens`` (speculators 0.9.0 marks missing embeddings with NaN and loads
the verifier's only if it still sees NaN, which transformers 5's ``empty_like`` does not keep).

Its explicit ``eagle_aux_hidden_state_layer_ids``: id i = ``hidden_states[i]``, the INPUT of layer i (i = L: the
last layer's output). vLLM ``model_executor/models/llama.py`` appends ``hidden_states + residual`` before running
layer ``idx`` when ``idx in aux_hidden_state_layers``; speculators ``convert/dflash/converter.py`` (117-119) and
``models/utils.py:resolve_target_layer_ids`` (ids within ``[0, L]``; its ``from_pretrained`` and
``from_training_args`` write the defaults ``[2, L // 2, L - 3]`` out once the verifier is known). llama.cpp reads
them the same way (see :mod:`.eagle3`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dynvocab.errors import DynvocabError
from dynvocab.models.eagle.config import EAGLE3, EagleConfig
from dynvocab.models.eagle.layouts.registry import Layout, Names, eagle3_fields


@dataclass(frozen=True)
class SpeculatorsLayout(Layout):
    """EAGLE-3 heads as vllm-project/speculators writes them."""

    def recognize(self, config: dict, names: Names) -> bool:
        model_type = config.get("speculators_model_type")
        if model_type and model_type != "eagle3":
            raise DynvocabError(f"speculators model type '{model_type}' is not supported; use eagle3")
        return bool(model_type)

    def layer_of(self, config: dict) -> dict:
        return config.get("transformer_layer_config", config)

    def arch(self, layer: dict) -> str:
        """``transformer_layer_config.model_type`` (its ``model_definitions.py``: llama, qwen3)."""
        model_type = layer.get("model_type", "llama")
        if model_type not in ("llama", "qwen3"):
            raise DynvocabError(
                f"speculators transformer_layer_config.model_type '{model_type}' is not supported; use llama or qwen3"
            )
        return model_type

    def config_json(self, cfg: EagleConfig, layer: dict, target_name: str | None) -> dict:
        _check_writable(cfg, target_name)
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            **eagle3_fields(cfg, self),
            "norm_before_fc": cfg.norm_before_fc,
            "fc_norm": cfg.fc_norm,
            "norm_output": cfg.norm_output,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target_name, "architectures": _verifier_architectures(target_name)},
            },
        }


def _check_writable(cfg: EagleConfig, target_name: str | None) -> None:
    """Refuse, in one line naming the field, what speculators 0.9.0 would drop or fail on: its
    ``models/eagle3/core.py`` builds ``fc`` without a bias over ``num_aux * hidden_size`` and calls
    ``AutoConfig.from_pretrained(verifier.name_or_path)`` when it loads a head."""
    if cfg.has_fc_bias:
        raise DynvocabError("speculators' fc has no bias (it would drop fc.bias); this head cannot be written as speculators")
    if cfg.target_hidden != cfg.hidden_size:
        raise DynvocabError(
            f"speculators needs target_hidden_size == hidden_size (this head: {cfg.target_hidden} vs "
            f"{cfg.hidden_size}); it cannot be written as speculators"
        )
    if not target_name:
        raise DynvocabError(
            "the speculators layout records its verifier, which speculators loads; pass the target (a local folder or hub id)"
        )


def _verifier_architectures(target_name: str | None) -> list[str]:
    """The verifier's ``architectures`` when its config is on this machine (as speculators' VerifierConfig has)."""
    try:
        return list(json.loads((Path(target_name or "") / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return []


LAYOUT = SpeculatorsLayout(
    "speculators", EAGLE3, family="speculators", priority=30, norm_before_residual=True,
    renames_in=(("layers.0.", "midlayer."),), renames_out=(("midlayer.", "layers.0."),), always_embeddings=True,
    full_vocab_without_map=True, scaled_embeddings=False,
    help="vllm-project/speculators' EAGLE-3 layout (vLLM loads it)",
)
