"""The shape of an EAGLE head, the target layers it reads, and the check that it fits a target.

Which layers EAGLE-3 reads, and how each layout writes them: see :mod:`dynvocab.models.eagle`. Here they are kept
in one convention only, the layout-free one: the index of the target hidden state, ``hidden_states[i]`` = the
input of layer i (each layout converts its ids on reading and writing, :mod:`.layouts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from dynvocab.errors import DynvocabError

EAGLE1 = "eagle"  # EAGLE-1 and EAGLE-2 share one head (EAGLE-2 changes only the tree)
EAGLE3 = "eagle3"
KINDS = (EAGLE1, EAGLE3)
ARCHS = {EAGLE1: ("llama", "qwen2"), EAGLE3: ("llama", "qwen3")}  # the decoder layer each kind is built from


def head_rows(config) -> int:
    """The rows of a draft's head, the one rule every reader uses: an EAGLE-3 head's own draft vocabulary
    (``draft_vocab_size``) where it has one, else ``vocab_size``. ``config``: a ``config.json`` mapping or a config
    object (:class:`EagleConfig`, transformers', vLLM's)."""
    get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
    return int(get("draft_vocab_size") or get("vocab_size"))


@dataclass(frozen=True)
class EagleConfig:
    """The shape of an EAGLE head. ``vocab_size`` is the target's vocabulary (embedding rows).

    ``kind``: :data:`EAGLE1` or :data:`EAGLE3`. ``arch``: the decoder layer's family (:data:`ARCHS`): EAGLE-1
    ``llama`` or ``qwen2`` (a llama layer with q/k/v biases, as cnets1.py builds it with ``qkv_bias``); EAGLE-3
    ``llama`` or ``qwen3`` (speculators' Qwen3 layer: q_norm/k_norm).
    ``aux_hidden_states``: EAGLE-3's explicit target features as indices into the target's hidden states
    (``hidden_states[i]`` enters layer i; i = L is the last layer's output before the final norm), whatever
    layout they were read from; None = the default ``(2, L // 2, L - 3)``.
    The speculators options, run as ``speculators/models/eagle3/core.py`` runs them: ``norm_before_fc`` (one
    RMSNorm ``input_norm`` over the concatenated features before ``fc``), ``fc_norm`` (one RMSNorm per tapped
    layer, ``fc_norm.{i}``), ``norm_output`` (the *normed* output feeds back between steps), ``sliding_window``
    (the draft layer attends only the last ``sliding_window`` positions, itself included).
    """

    kind: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    arch: str = "llama"
    head_dim: int | None = None
    target_hidden_size: int | None = None  # EAGLE-3 only; None = hidden_size
    draft_vocab_size: int | None = None  # EAGLE-3 only; None = vocab_size
    fc_bias: bool | None = None  # None = the reference default: true for EAGLE-1, false for EAGLE-3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    aux_hidden_states: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    sliding_window: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DynvocabError(f"unknown EAGLE kind '{self.kind}'; use one of {', '.join(KINDS)}")
        archs = ARCHS[self.kind]
        if self.arch not in archs:
            raise DynvocabError(
                f"{'EAGLE-3' if self.kind == EAGLE3 else 'EAGLE-1/2'} heads with a '{self.arch}' layer are not "
                f"supported; use {' or '.join(archs)}"
            )
        if self.norm_before_fc and self.fc_norm:
            raise DynvocabError("norm_before_fc and fc_norm are exclusive (speculators refuses both); keep one")

    @property
    def target_hidden(self) -> int:
        """The target's hidden size this head reads."""
        return self.target_hidden_size or self.hidden_size

    @property
    def draft_vocab(self) -> int:
        """Rows of the head's own ``lm_head`` (EAGLE-3) or of the target's head (EAGLE-1)."""
        return head_rows(self)

    @property
    def has_fc_bias(self) -> bool:
        """Whether ``fc`` has a bias (the references' defaults when the config does not say)."""
        return self.fc_bias if self.fc_bias is not None else self.kind == EAGLE1

    @property
    def feature_size(self) -> int:
        """Width of the target features one step reads: d_target (EAGLE-1) or 3·d_target (EAGLE-3)."""
        return self.target_hidden * (3 if self.kind == EAGLE3 else 1)

    @property
    def num_aux(self) -> int:
        """How many target hidden states EAGLE-3 concatenates (3 unless the ids say otherwise)."""
        return len(self.aux_hidden_states) if self.aux_hidden_states else 3

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose INPUT hidden states EAGLE-3 reads, ``hidden_states[i]`` (``num_layers`` = L
        means the last layer's output, before the final norm); refuses ids outside a target of ``num_layers``."""
        if self.aux_hidden_states is None:
            if num_layers < 4:
                raise DynvocabError(
                    f"this EAGLE-3 head reads target layers (2, L//2, L-3) but the target has {num_layers} layers; "
                    "it was built for another target"
                )
            return (2, num_layers // 2, num_layers - 3)
        if max(self.aux_hidden_states) > num_layers or min(self.aux_hidden_states) < 0:
            raise DynvocabError(
                f"this EAGLE-3 head reads target hidden states {list(self.aux_hidden_states)} but the target has "
                f"{num_layers} layers; it was built for another target"
            )
        return self.aux_hidden_states

    def layer_config(self):
        """The transformers config of the one decoder layer (LlamaConfig, Qwen2Config or Qwen3Config). Its
        layers are full-attention ones (so the KV cache crops on rollback); a sliding window is applied by the
        mask (:attr:`sliding_window`)."""
        from transformers import LlamaConfig, Qwen2Config, Qwen3Config

        cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}.get(self.arch, LlamaConfig)
        extra = {"head_dim": self.head_dim or self.hidden_size // self.num_attention_heads}  # Qwen3's default is 128
        if self.rope_scaling is not None:
            extra["rope_scaling"] = dict(self.rope_scaling)
        if cls is LlamaConfig:
            extra["attention_bias"] = False
        cfg = cls(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings, hidden_act=self.hidden_act,
            tie_word_embeddings=False, **extra,
        )
        cfg.sliding_window = self.sliding_window  # read by create_sliding_window_causal_mask only
        cfg._attn_implementation = "sdpa"
        return cfg


def config_like(layer_config, kind: str = EAGLE1, **overrides) -> EagleConfig:
    """An :class:`EagleConfig` shaped like a target's decoder layer (``layer_config``: its transformers config):
    a new head for that target, e.g. to train or to initialise from its last layer."""
    rope = getattr(layer_config, "rope_parameters", None) or {}
    if "full_attention" in rope:  # one set per layer type (Gemma-3): the head attends to its whole context
        rope = rope["full_attention"]
    scaling = None
    if rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    theta = float(rope.get("rope_theta", getattr(layer_config, "rope_theta", 10000.0)))
    arch = "qwen2" if layer_config.model_type == "qwen2" and kind == EAGLE1 else "llama"  # EAGLE-3: llama layers
    cfg = EagleConfig(
        kind=kind, arch=arch, hidden_size=layer_config.hidden_size, intermediate_size=layer_config.intermediate_size,
        num_attention_heads=layer_config.num_attention_heads, num_key_value_heads=layer_config.num_key_value_heads,
        vocab_size=layer_config.vocab_size, head_dim=getattr(layer_config, "head_dim", None),
        rms_norm_eps=layer_config.rms_norm_eps, rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=layer_config.max_position_embeddings,
        hidden_act=getattr(layer_config, "hidden_act", None) or layer_config.hidden_activation,  # Gemma's name
    )
    return replace(cfg, **overrides)


def check_target(cfg: EagleConfig, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """Refuse, in one line naming the number that differs, a head built for another target."""
    if cfg.target_hidden != hidden_size:
        raise DynvocabError(
            f"the EAGLE head reads target hidden size {cfg.target_hidden} but the target's is {hidden_size}; "
            "it was built for another target"
        )
    if cfg.vocab_size != vocab_size:
        raise DynvocabError(
            f"the EAGLE head's vocabulary has {cfg.vocab_size} ids but the target's has {vocab_size}; "
            "it was built for another target"
        )
    if cfg.kind == EAGLE3:
        cfg.target_layers(num_layers)
