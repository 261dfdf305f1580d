"""The shape of an EAGLE head, the target layers it reads, and the check that it fits a target.

Which layers EAGLE-3 reads, and why explicit ids are read SGLang's way: see :mod:`dynvocab.models.eagle`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dynvocab.errors import DynvocabError

EAGLE1 = "eagle"  # EAGLE-1 and EAGLE-2 share one head (EAGLE-2 changes only the tree)
EAGLE3 = "eagle3"
KINDS = (EAGLE1, EAGLE3)


@dataclass(frozen=True)
class EagleConfig:
    """The shape of an EAGLE head. ``vocab_size`` is the target's vocabulary (embedding rows).

    ``kind``: :data:`EAGLE1` or :data:`EAGLE3`. ``arch``: the decoder layer's family, ``llama`` or ``qwen2``
    (EAGLE-3 heads are llama layers). ``aux_layer_ids``: EAGLE-3's explicit target layer ids as the checkpoint
    writes them (SGLang's reading, see :mod:`dynvocab.models.eagle`); None = the default ``(2, L // 2, L - 3)``.
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
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DynvocabError(f"unknown EAGLE kind '{self.kind}'; use one of {', '.join(KINDS)}")
        if self.arch not in ("llama", "qwen2"):
            raise DynvocabError(f"EAGLE heads with a '{self.arch}' layer are not supported; use llama or qwen2")

    @property
    def target_hidden(self) -> int:
        """The target's hidden size this head reads."""
        return self.target_hidden_size or self.hidden_size

    @property
    def draft_vocab(self) -> int:
        """Rows of the head's own ``lm_head`` (EAGLE-3) or of the target's head (EAGLE-1)."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def has_fc_bias(self) -> bool:
        """Whether ``fc`` has a bias (the references' defaults when the config does not say)."""
        return self.fc_bias if self.fc_bias is not None else self.kind == EAGLE1

    @property
    def feature_size(self) -> int:
        """Width of the target features one step reads: d_target (EAGLE-1) or 3·d_target (EAGLE-3)."""
        return self.target_hidden * (3 if self.kind == EAGLE3 else 1)

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose INPUT hidden states EAGLE-3 reads (``num_layers`` = L means the last layer's
        output, before the final norm); refuses ids outside a target with ``num_layers`` layers."""
        if self.aux_layer_ids is None:
            if num_layers < 4:
                raise DynvocabError(
                    f"this EAGLE-3 head reads target layers (2, L//2, L-3) but the target has {num_layers} layers; "
                    "it was built for another target"
                )
            return (2, num_layers // 2, num_layers - 3)
        if max(self.aux_layer_ids) >= num_layers or min(self.aux_layer_ids) < 0:
            raise DynvocabError(
                f"this EAGLE-3 head reads target layers {list(self.aux_layer_ids)} but the target has {num_layers} "
                "layers; it was built for another target"
            )
        return tuple(i + 1 for i in self.aux_layer_ids)  # SGLang's reading: the output of layer i

    def layer_config(self):
        """The transformers config of the one decoder layer (LlamaConfig or Qwen2Config)."""
        from transformers import LlamaConfig, Qwen2Config

        cls = Qwen2Config if self.arch == "qwen2" else LlamaConfig
        extra = {} if self.head_dim is None else {"head_dim": self.head_dim}
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
        cfg._attn_implementation = "sdpa"
        return cfg


def config_like(layer_config, kind: str = EAGLE1, **overrides) -> EagleConfig:
    """An :class:`EagleConfig` shaped like a target's decoder layer (``layer_config``: its transformers config):
    a new head for that target, e.g. to train or to initialise from its last layer."""
    rope = getattr(layer_config, "rope_parameters", None) or {}
    scaling = None
    if rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    theta = float(rope.get("rope_theta", getattr(layer_config, "rope_theta", 10000.0)))
    arch = "qwen2" if layer_config.model_type == "qwen2" and kind == EAGLE1 else "llama"
    cfg = EagleConfig(
        kind=kind, arch=arch, hidden_size=layer_config.hidden_size, intermediate_size=layer_config.intermediate_size,
        num_attention_heads=layer_config.num_attention_heads, num_key_value_heads=layer_config.num_key_value_heads,
        vocab_size=layer_config.vocab_size, head_dim=getattr(layer_config, "head_dim", None),
        rms_norm_eps=layer_config.rms_norm_eps, rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=layer_config.max_position_embeddings,
        hidden_act=layer_config.hidden_act,
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
