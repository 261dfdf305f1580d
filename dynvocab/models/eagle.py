"""EAGLE draft heads (EAGLE-1/2 and EAGLE-3) built from transformers' own decoder layers, and their checkpoints.

An EAGLE head is one decoder layer that reads the target's features and the next token's embedding:

- **EAGLE-1/2** (SafeAILab/EAGLE ``eagle/model/cnets1.py``; SGLang ``python/sglang/srt/models/llama_eagle.py`` and
  ``qwen2_eagle.py``): ``fc`` [d, 2d] (bias per the config's ``bias``, default true) over
  ``cat(embedding, feature)`` — embedding first —, then ``layers.0`` without its ``input_layernorm``; no norm and
  no head of its own: its output is a feature like the target's final *normed* hidden state, so the target's LM
  head applies to it directly, and it feeds back as the next step's feature. A Qwen2 layer keeps its q/k/v biases.
- **EAGLE-3** (SafeAILab/EAGLE ``eagle/model/cnets.py``; SGLang ``models/llama_eagle3.py``; vLLM
  ``vllm/model_executor/models/llama_eagle3.py``): ``fc`` [d, 3·d_target] (bias per ``bias``, default false) over
  the target's hidden states *entering* three layers (low, mid, high), then ``midlayer`` whose attention reads
  ``cat(input_layernorm(embedding), hidden_norm(h))`` (q/k/v are 2d wide), then ``norm`` and ``lm_head``
  [draft_vocab, d]. ``d2t`` is an OFFSET table (SGLang: ``hot_token_id = d2t + arange``): target id = draft id +
  d2t[draft id]; ``t2d`` is a bool mask over the target vocabulary. From the second step the layer's *pre-norm*
  output feeds back without ``fc`` (SGLang: ``hidden_states.shape[-1] != embeds.shape[-1]`` decides).
- The vllm-project/speculators form of EAGLE-3 (vLLM ``transformers_utils/configs/speculators/{base,algos}.py``):
  ``config.json`` with ``speculators_model_type: "eagle3"`` and a nested ``transformer_layer_config``; weights
  ``layers.0.*`` instead of ``midlayer.*``; ``norm_before_residual`` (vLLM's default when absent: true).

Which target layers EAGLE-3 reads — LOUD, because the two engines differ by one. With no ids in the config both
take the hidden states entering layers ``(2, L // 2, L - 3)`` (vLLM ``get_eagle3_aux_hidden_state_layers``; SGLang
``set_eagle3_layers_to_capture(None)``; EAGLE's ``modeling_llama_kv.py`` appends before running those layers).
With explicit ``eagle_aux_hidden_state_layer_ids`` SGLang captures the OUTPUT of each listed layer (it adds 1:
"for the ith layer, it takes the output of the (i-1)th layer"), vLLM the INPUT. We follow SGLang (and SpecForge,
which trains with it): explicit id i means the hidden state entering layer i + 1; id L - 1 is the last layer's
output before the final norm. :meth:`EagleConfig.target_layers` resolves them to "entering" indices, :class:`LayerTap` taps them.

Weight names may carry a ``model.`` prefix; ``embed_tokens`` may be absent (the target's embeddings are used).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from dynvocab.errors import DynvocabError

EAGLE1 = "eagle"  # EAGLE-1 and EAGLE-2 share one head (EAGLE-2 changes only the tree)
EAGLE3 = "eagle3"
KINDS = (EAGLE1, EAGLE3)
LAYOUTS = ("eagle", "eagle3", "speculators")  # what :func:`save_eagle` writes
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class EagleConfig:
    """The shape of an EAGLE head. ``vocab_size`` is the target's vocabulary (embedding rows).

    ``kind``: :data:`EAGLE1` or :data:`EAGLE3`. ``arch``: the decoder layer's family, ``llama`` or ``qwen2``
    (EAGLE-3 heads are llama layers). ``aux_layer_ids``: EAGLE-3's explicit target layer ids as the checkpoint
    writes them (SGLang's reading, see the module docstring); None = the default ``(2, L // 2, L - 3)``.
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

    # -- config.json ---------------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, data: dict, kind: str) -> "EagleConfig":
        """Read a checkpoint's ``config.json`` (EAGLE repo or speculators form) as a head of ``kind``."""
        layer = data.get("transformer_layer_config", data)  # speculators nests the layer's config
        arch = "qwen2" if layer.get("model_type") == "qwen2" or "Qwen2" in "".join(layer.get("architectures") or []) else "llama"
        try:
            heads = int(layer["num_attention_heads"])
            cfg = cls(
                kind=kind,
                arch="llama" if kind == EAGLE3 else arch,
                hidden_size=int(layer["hidden_size"]),
                intermediate_size=int(layer["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
                vocab_size=int(layer.get("vocab_size") or data["vocab_size"]),
                head_dim=layer.get("head_dim"),
                target_hidden_size=data.get("target_hidden_size") or layer.get("target_hidden_size"),
                draft_vocab_size=data.get("draft_vocab_size") or layer.get("draft_vocab_size"),
                fc_bias=data.get("bias", layer.get("bias")),
                rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                rope_theta=float(layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
                rope_scaling=layer.get("rope_scaling"),
                max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
                hidden_act=layer.get("hidden_act", "silu"),
                aux_layer_ids=_ids(data.get("eagle_aux_hidden_state_layer_ids") or layer.get("eagle_aux_hidden_state_layer_ids")),
                norm_before_residual=bool(data.get("norm_before_residual", "speculators_model_type" in data)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DynvocabError(f"the EAGLE config.json lacks or garbles field {exc}; it is not a checkpoint we can read") from None
        return cfg

    def to_json(self, layout: str, target_name: str | None = None) -> dict:
        """``config.json`` of ``layout`` (:data:`LAYOUTS`), as the reference loaders read it."""
        layer = {
            "architectures": ["Qwen2ForCausalLM" if self.arch == "qwen2" else "LlamaForCausalLM"],
            "model_type": self.arch,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "tie_word_embeddings": False,
        }
        if self.head_dim is not None:
            layer["head_dim"] = self.head_dim
        if layout == "eagle":
            if self.kind != EAGLE1:
                raise DynvocabError("layout 'eagle' holds EAGLE-1/2 heads; write an EAGLE-3 head as eagle3 or speculators")
            return {**layer, "bias": self.has_fc_bias}
        if self.kind != EAGLE3:
            raise DynvocabError(f"layout '{layout}' holds EAGLE-3 heads; write an EAGLE-1/2 head as eagle")
        eagle3 = {
            "draft_vocab_size": self.draft_vocab,
            "target_hidden_size": self.target_hidden,
            "bias": self.has_fc_bias,
            "norm_before_residual": self.norm_before_residual,
        }
        if self.aux_layer_ids is not None:
            eagle3["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        if layout == "eagle3":
            return {**layer, "architectures": ["LlamaForCausalLMEagle3"], **eagle3}
        if layout != "speculators":
            raise DynvocabError(f"unknown EAGLE layout '{layout}'; use one of {', '.join(LAYOUTS)}")
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            **eagle3,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target_name, "architectures": []},
            },
        }


def _ids(value) -> tuple[int, ...] | None:
    return None if not value else tuple(int(v) for v in value)


# -- the modules -------------------------------------------------------------------------------------------
def _decoder_layer_class(arch: str):
    if arch == "qwen2":
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

        return Qwen2DecoderLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def _rotary(arch: str, cfg):
    if arch == "qwen2":
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

        return Qwen2RotaryEmbedding(cfg)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(cfg)


def eagle1_layer(cfg: EagleConfig, layer_cfg) -> nn.Module:
    """The library's decoder layer with ``input_layernorm`` dropped (cnets1.py builds layer 0 without it; SGLang
    ``llama_eagle.py`` replaces it by the identity)."""
    layer = _decoder_layer_class(cfg.arch)(layer_cfg, 0)
    layer.input_layernorm = nn.Identity()
    return layer


def _eagle3_layer_class():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    class Eagle3DecoderLayer(LlamaDecoderLayer):
        """``LlamaDecoderLayer`` whose attention reads ``cat(input_layernorm(embedding), hidden_norm(h))``: q/k/v
        take 2d inputs and a ``hidden_norm`` is added (cnets.py ``LlamaDecoderLayeremb``; vLLM llama_eagle3.py)."""

        def __init__(self, layer_cfg, norm_before_residual: bool):
            super().__init__(layer_cfg, 0)
            attn, d = self.self_attn, layer_cfg.hidden_size
            bias = layer_cfg.attention_bias
            attn.q_proj = nn.Linear(2 * d, attn.q_proj.out_features, bias=bias)
            attn.k_proj = nn.Linear(2 * d, attn.k_proj.out_features, bias=bias)
            attn.v_proj = nn.Linear(2 * d, attn.v_proj.out_features, bias=bias)
            self.hidden_norm = LlamaRMSNorm(d, eps=layer_cfg.rms_norm_eps)
            self.norm_before_residual = norm_before_residual

        def forward(self, embeds, hidden_states, **attn_kwargs) -> torch.Tensor:
            """``embeds``, ``hidden_states`` [b, n, d] -> the pre-norm output [b, n, d]."""
            normed = self.hidden_norm(hidden_states)
            residual = normed if self.norm_before_residual else hidden_states  # speculators' option
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [b, n, 2d]
            x, _ = self.self_attn(hidden_states=x, **attn_kwargs)
            x = residual + x
            return x + self.mlp(self.post_attention_layernorm(x))

    return Eagle3DecoderLayer


class EagleModel(nn.Module):
    """An EAGLE head. Its state dict has the published key names of its kind (EAGLE repo layout):
    EAGLE-1: ``embed_tokens``, ``fc``, ``layers.0.*``; EAGLE-3: ``embed_tokens``, ``fc``, ``midlayer.*``, ``norm``,
    ``lm_head``, ``d2t``, ``t2d``.

    ``forward`` returns (feature, head input): the feature feeds back as the next step's input; the head input is
    what the LM head multiplies (EAGLE-1: the feature itself, for the target's head; EAGLE-3: ``norm(feature)``,
    for :attr:`lm_head`).
    """

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.config = cfg
        self.layer_config = cfg.layer_config()
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.fc = nn.Linear(cfg.feature_size if cfg.kind == EAGLE3 else 2 * d, d, bias=cfg.has_fc_bias)
        if cfg.kind == EAGLE1:
            self.layers = nn.ModuleList([eagle1_layer(cfg, self.layer_config)])
        else:
            from transformers.models.llama.modeling_llama import LlamaRMSNorm

            self.midlayer = _eagle3_layer_class()(self.layer_config, cfg.norm_before_residual)
            self.norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
            self.lm_head = nn.Linear(d, cfg.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))  # [Vd] offsets
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # [V]
            with torch.no_grad():
                self.set_draft_vocab(torch.arange(cfg.draft_vocab))
        self.rotary_emb = _rotary(cfg.arch, self.layer_config)

    @property
    def kind(self) -> str:
        """:data:`EAGLE1` or :data:`EAGLE3`."""
        return self.config.kind

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embeddings (the target's, shared, when the checkpoint has none)."""
        return self.embed_tokens

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """EAGLE-3: make draft row i stand for target id ``target_ids[i]`` (sorted, distinct) — fills ``d2t``
        (offsets) and ``t2d``."""
        target_ids = target_ids.to(self.d2t.device, torch.long)
        self.d2t.copy_(target_ids - torch.arange(target_ids.numel(), device=target_ids.device))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    def draft_to_target(self) -> torch.Tensor:
        """EAGLE-3: the target id of each draft row, LongTensor [Vd] (``arange + d2t``)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def new_cache(self):
        """An empty KV cache for the one layer (cropped on rollback like a draft model's)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.layer_config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [b, n]
        features: torch.Tensor,  # [b, n, f]: target features (f = feature_size) or own features (f = d)
        position_ids: torch.Tensor,  # [b, n]
        past_key_values=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(feature [b, n, d], head input [b, n, d]) for token ``input_ids`` paired with the feature of the
        position before it."""
        from transformers.masking_utils import create_causal_mask

        embeds = self.embed_tokens(input_ids).to(self.fc.weight.dtype)  # [b, n, d]
        features = features.to(self.fc.weight.dtype)
        mask = create_causal_mask(
            config=self.layer_config, inputs_embeds=embeds, attention_mask=None,
            past_key_values=past_key_values, position_ids=position_ids,
        )
        rope = self.rotary_emb(embeds, position_ids=position_ids)
        kwargs = dict(
            attention_mask=mask, position_ids=position_ids, past_key_values=past_key_values,
            use_cache=past_key_values is not None, position_embeddings=rope,
        )
        if self.kind == EAGLE1:
            h = self.fc(torch.cat([embeds, features], dim=-1))  # embedding first (cnets1.py)
            out = self.layers[0](h, **kwargs)
            return out, out
        h = self.fc(features) if features.shape[-1] != self.config.hidden_size else features
        out = self.midlayer(embeds, h, **kwargs)
        return out, self.norm(out)


# -- checkpoints -------------------------------------------------------------------------------------------
def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    raise DynvocabError(f"{folder} has no {' or '.join(WEIGHT_FILES)}; it is not an EAGLE checkpoint")


def _weight_names(folder: Path) -> list[str]:
    path = folder / "model.safetensors"
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    if (folder / "pytorch_model.bin").is_file():
        return list(_read_weights(folder))
    return []


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def detect_kind(folder: str | Path) -> str | None:
    """:data:`EAGLE1`, :data:`EAGLE3`, or None when ``folder`` is not an EAGLE checkpoint (from ``config.json``
    and the weight names: an ``fc`` over features and a one-layer body)."""
    folder = Path(folder)
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if data.get("speculators_model_type") == "eagle3":
        return EAGLE3
    if data.get("speculators_model_type"):
        raise DynvocabError(f"speculators model type '{data['speculators_model_type']}' is not supported; use eagle3")
    names = {_strip(n) for n in _weight_names(folder)}
    if "fc.weight" not in names:
        return None
    if any(n.startswith("midlayer.") for n in names) or "d2t" in names:
        return EAGLE3
    if any(n.startswith("layers.0.") for n in names):
        return EAGLE1
    return None


def eagle_checkpoint(spec) -> Path | None:
    """The local folder of an EAGLE checkpoint named by a :class:`~dynvocab.models.loading.ModelSpec` (a folder or
    a hub id; a hub checkpoint is fetched), or None when it is not one (a draft model)."""
    if spec.gguf_file is not None:
        return None
    if spec.is_local:
        return Path(spec.path) if detect_kind(spec.path) else None
    try:
        from huggingface_hub import hf_hub_download, snapshot_download

        data = json.loads(Path(hf_hub_download(spec.path, "config.json")).read_text())
        if data.get("num_hidden_layers", data.get("transformer_layer_config", {}).get("num_hidden_layers")) != 1:
            return None  # EAGLE heads are one layer; anything else is a draft model
        folder = Path(snapshot_download(spec.path, allow_patterns=["config.json", *WEIGHT_FILES]))
    except Exception:  # not reachable or not a hub model: the draft-model loader reports it in one line
        return None
    return folder if detect_kind(folder) else None


def read_config(folder: str | Path) -> EagleConfig:
    """The :class:`EagleConfig` of the checkpoint in ``folder`` (refuses a folder that is not one)."""
    folder = Path(folder)
    kind = detect_kind(folder)
    if kind is None:
        raise DynvocabError(f"{folder} is not an EAGLE checkpoint (no fc over features and one-layer body)")
    return EagleConfig.from_json(json.loads((folder / "config.json").read_text()), kind)


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


def _check_draft_vocab(model: EagleModel) -> None:
    """Refuse a ``d2t`` that is not an offset table consistent with ``t2d`` (read as absolute ids it would map
    the draft onto the first target ids and acceptance would silently collapse)."""
    targets = model.draft_to_target()
    vocab = model.t2d.numel()
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise DynvocabError(f"the EAGLE-3 d2t maps draft ids outside the target's {vocab} ids; it is not an offset table")
    if targets.unique().numel() != targets.numel() or int(model.t2d.sum()) != targets.numel() or not bool(model.t2d[targets].all()):
        raise DynvocabError("the EAGLE-3 d2t and t2d disagree (d2t must hold offsets: target = draft id + d2t[draft id])")


def load_eagle(
    folder: str | Path,
    embeddings: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> EagleModel:
    """Load the EAGLE checkpoint in ``folder``. ``embeddings`` [V, d]: the target's input embeddings, used when
    the checkpoint has none (they are shared, not copied)."""
    folder = Path(folder)
    cfg = read_config(folder)
    state = {_strip(k): v for k, v in _read_weights(folder).items()}
    if cfg.kind == EAGLE3:  # speculators and vLLM name the layer layers.0
        state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    if "t2d" not in state and "d2t" in state:
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(state["d2t"].numel()) + state["d2t"].long()] = True
    with torch.device("meta"):
        model = EagleModel(cfg)
    missing = set(model.state_dict()) - set(state)
    shared = "embed_tokens.weight" in missing
    if shared:
        if embeddings is None:
            raise DynvocabError(f"{folder} has no embed_tokens; pass the target's embeddings")
        if tuple(embeddings.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise DynvocabError(
                f"the target's embeddings are {tuple(embeddings.shape)} but the EAGLE head needs "
                f"({cfg.vocab_size}, {cfg.hidden_size}); it was built for another target"
            )
        state["embed_tokens.weight"] = embeddings
        missing.discard("embed_tokens.weight")
    if cfg.kind == EAGLE3 and "d2t" in missing:
        raise DynvocabError(f"{folder} has no d2t; an EAGLE-3 head needs its draft-to-target id offsets")
    missing = {m for m in missing if "rotary_emb" not in m}
    unexpected = set(state) - set(model.state_dict())
    if missing or unexpected:
        first = sorted(missing or unexpected)[0]
        raise DynvocabError(
            f"{folder} does not match the EAGLE {cfg.kind} layout: {'missing' if missing else 'unexpected'} weight '{first}'"
        )
    for name, tensor in state.items():
        want = model.state_dict()[name].shape
        if tuple(tensor.shape) != tuple(want):
            raise DynvocabError(f"{folder}: weight '{name}' has shape {tuple(tensor.shape)}, the config says {tuple(want)}")
    model.to_empty(device=device)
    model.load_state_dict(state, strict=False, assign=False)
    model.rotary_emb = _rotary(cfg.arch, model.layer_config).to(device)
    model.to(dtype)
    if cfg.kind == EAGLE3:
        model.d2t.data = state["d2t"].to(device, torch.long)
        model.t2d.data = state["t2d"].to(device, torch.bool)
        _check_draft_vocab(model)
    if shared and embeddings.dtype == dtype and embeddings.device == torch.device(device):
        model.embed_tokens.weight = nn.Parameter(embeddings, requires_grad=False)  # shared with the target
    return model.eval()


def state_for_layout(model: EagleModel, layout: str, embeddings: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` under ``layout``'s key names (speculators: ``layers.0.*`` for ``midlayer.*``)."""
    cfg = model.config
    cfg.to_json(layout)  # refuses a layout of the other kind
    state = {}
    for name, tensor in model.state_dict().items():
        if "rotary_emb" in name or (name == "embed_tokens.weight" and not embeddings):
            continue
        if layout == "speculators" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        state[name] = tensor.detach().contiguous().cpu()
    return state


def save_eagle(
    model: EagleModel,
    folder: str | Path,
    layout: str | None = None,
    embeddings: bool = False,
    target_name: str | None = None,
) -> Path:
    """Write ``model`` to ``folder`` as ``layout`` (default: ``eagle`` for EAGLE-1, ``eagle3`` for EAGLE-3):
    ``model.safetensors`` then ``config.json``, each written whole. ``embeddings``: include ``embed_tokens``
    (the published heads mostly leave it out and use the target's)."""
    from safetensors.torch import save_file

    from dynvocab.files import write_atomic

    layout = layout or (EAGLE1 if model.kind == EAGLE1 else "eagle3")
    config = model.config.to_json(layout, target_name)
    state = state_for_layout(model, layout, embeddings)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    write_atomic(folder / "config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    return folder


class LayerTap:
    """Forward pre-hooks on a target that keep the hidden states entering some of its layers at its last pass.

    Index ``L`` (the layer count) taps the final norm's input: the last layer's output. Only references are
    kept (the layers do not write their inputs in place), so a tap costs no copy.
    """

    def __init__(self, target_model, entering: tuple[int, ...]):
        body = getattr(target_model, target_model.base_model_prefix)
        layers = list(body.layers)
        self.entering = entering
        self.seen: dict[int, torch.Tensor] = {}
        self.handles = []
        for i in sorted(set(entering)):
            module = layers[i] if i < len(layers) else body.norm
            self.handles.append(module.register_forward_pre_hook(self._keeper(i), with_kwargs=True))

    def _keeper(self, i: int):
        def keep(module, args, kwargs):
            self.seen[i] = args[0] if args else kwargs["hidden_states"]

        return keep

    def features(self) -> torch.Tensor:
        """The tapped hidden states of the last pass, concatenated low to high: [n, len(entering) * d]."""
        return torch.cat([self.seen[i][0] for i in self.entering], dim=-1)

    def remove(self) -> None:
        """Take the hooks off the target."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


def config_like(layer_config, kind: str = EAGLE1, **overrides) -> EagleConfig:
    """An :class:`EagleConfig` shaped like a target's decoder layer (``layer_config``: its transformers config):
    a new head for that target, e.g. to train or to initialise from its last layer."""
    rope = getattr(layer_config, "rope_parameters", None) or {}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope.get("rope_type", "default") != "default" else None
    arch = "qwen2" if layer_config.model_type == "qwen2" and kind == EAGLE1 else "llama"
    cfg = EagleConfig(
        kind=kind, arch=arch, hidden_size=layer_config.hidden_size, intermediate_size=layer_config.intermediate_size,
        num_attention_heads=layer_config.num_attention_heads, num_key_value_heads=layer_config.num_key_value_heads,
        vocab_size=layer_config.vocab_size, head_dim=getattr(layer_config, "head_dim", None),
        rms_norm_eps=layer_config.rms_norm_eps, rope_theta=float(rope.get("rope_theta", getattr(layer_config, "rope_theta", 10000.0))),
        rope_scaling=scaling, max_position_embeddings=layer_config.max_position_embeddings,
        hidden_act=layer_config.hidden_act,
    )
    return replace(cfg, **overrides)


def init_from_target(model: EagleModel, target_model) -> EagleModel:
    """Initialise an EAGLE-1 head from a target: its last decoder layer (without ``input_layernorm``), its
    embeddings, and ``fc`` as [0 | I] (the feature passes through). A runnable head with real weight shapes and
    statistics, not a trained one."""
    if model.kind != EAGLE1:
        raise DynvocabError("init_from_target builds EAGLE-1 heads")
    body = getattr(target_model, target_model.base_model_prefix)
    last = body.layers[-1].state_dict()
    with torch.no_grad():
        model.layers[0].load_state_dict({k: v for k, v in last.items() if not k.startswith("input_layernorm")})
        model.embed_tokens.weight.copy_(body.embed_tokens.weight)
        d = model.config.hidden_size
        model.fc.weight.zero_()
        model.fc.weight[:, d:].copy_(torch.eye(d))
        if model.fc.bias is not None:
            model.fc.bias.zero_()
    return model


__all__ = [
    "EAGLE1",
    "EAGLE3",
    "KINDS",
    "LAYOUTS",
    "LayerTap",
    "EagleConfig",
    "EagleModel",
    "check_target",
    "config_like",
    "detect_kind",
    "eagle_checkpoint",
    "init_from_target",
    "load_eagle",
    "read_config",
    "save_eagle",
    "state_for_layout",
]
