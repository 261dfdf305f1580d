"""The EAGLE head as an ``nn.Module``, built from transformers' own decoder layers (see :mod:`dynvocab.models.eagle`)."""

from __future__ import annotations

import torch
from torch import nn

from dynvocab.models.eagle.config import EAGLE1, EAGLE3, EagleConfig


def _decoder_layer_class(arch: str):
    if arch == "qwen2":
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

        return Qwen2DecoderLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def rotary_embedding(arch: str, cfg):
    """The rotary embedding of ``arch``'s decoder layer for its config ``cfg``."""
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


def _eagle3_layer_class(arch: str):
    """The EAGLE-3 layer built on ``arch``'s decoder layer (speculators ``model_definitions.py``: llama, qwen3)."""
    if arch == "qwen3":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer as Base
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm as Norm
    else:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as Base
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as Norm

    class Eagle3DecoderLayer(Base):
        """The library's decoder layer whose attention reads ``cat(input_layernorm(embedding), hidden_norm(h))``:
        q/k/v take 2d inputs and a ``hidden_norm`` is added (cnets.py ``LlamaDecoderLayeremb``; vLLM
        llama_eagle3.py; speculators ``Eagle3FirstLayerMixin``). Qwen3's q_norm/k_norm act per head, unchanged."""

        def __init__(self, layer_cfg, norm_before_residual: bool):
            super().__init__(layer_cfg, 0)
            attn, d = self.self_attn, layer_cfg.hidden_size
            bias = layer_cfg.attention_bias
            attn.q_proj = nn.Linear(2 * d, attn.q_proj.out_features, bias=bias)
            attn.k_proj = nn.Linear(2 * d, attn.k_proj.out_features, bias=bias)
            attn.v_proj = nn.Linear(2 * d, attn.v_proj.out_features, bias=bias)
            self.hidden_norm = Norm(d, eps=layer_cfg.rms_norm_eps)
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


def embedding_scale(target_model) -> float:
    """The factor ``target_model`` multiplies its embedding rows by (Gemma's ``Gemma3TextScaledWordEmbedding``:
    sqrt(d)); 1.0 for a target that embeds plainly."""
    return float(getattr(target_model.get_input_embeddings(), "embed_scale", 1.0))


class EagleModel(nn.Module):
    """An EAGLE head. Its state dict has the published key names of its kind (EAGLE repo layout):
    EAGLE-1: ``embed_tokens``, ``fc``, ``layers.0.*``; EAGLE-3: ``embed_tokens``, ``fc``, ``midlayer.*``, ``norm``,
    ``lm_head``, ``d2t``, ``t2d`` (and speculators' ``input_norm`` or ``fc_norm.{i}`` when the config has them).

    ``EagleModel(cfg)`` builds the class of ``cfg.kind``: :class:`Eagle1Model` or :class:`Eagle3Model`, which share
    the embedding, the rotary embedding, the mask and the cache; each builds and runs its own body. ``forward``
    returns (feature, head input): the feature feeds back as the next step's input; the head input is what the LM
    head multiplies (EAGLE-1: the feature itself, for the target's head; EAGLE-3: ``norm(feature)``, for
    ``lm_head``; with ``norm_output`` the normed one is also the feature, speculators core.py).
    """

    def __new__(cls, cfg: EagleConfig | None = None):
        if cls is EagleModel and cfg is not None:
            cls = {EAGLE1: Eagle1Model, EAGLE3: Eagle3Model}[cfg.kind]
        return super().__new__(cls)

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.config = cfg
        self.layer_config = cfg.layer_config()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = rotary_embedding(cfg.arch, self.layer_config)
        self.embed_scale = 1.0  # the target's input-embedding scale (Gemma: sqrt(d)), set by :meth:`pair_with`

    def pair_with(self, target_model) -> "EagleModel":
        """Embed tokens as ``target_model`` does: the head shares the target's embedding table, and a target that
        scales it (Gemma's ``Gemma3TextScaledWordEmbedding``: × sqrt(d)) scales it here too. The scale is the
        target's, not the checkpoint's, so the published layouts stay as they are. Returns the head."""
        self.embed_scale = embedding_scale(target_model)
        return self

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [b, n, d] in the head's dtype, scaled as the target scales its own."""
        embeds = self.embed_tokens(input_ids).to(self.fc.weight.dtype)
        return embeds if self.embed_scale == 1.0 else embeds * self.embed_scale

    @property
    def kind(self) -> str:
        """:data:`EAGLE1` or :data:`EAGLE3`."""
        return self.config.kind

    def own_state(self) -> dict[str, torch.Tensor]:
        """The state dict without the target's embeddings and the rotary buffers: what training changes and a
        checkpoint or a continued run (``train-draft --init-from``) carries over."""
        return {k: v for k, v in self.state_dict().items() if k != "embed_tokens.weight" and "rotary_emb" not in k}

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embeddings (the target's, shared, when the checkpoint has none)."""
        return self.embed_tokens

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
        attention_mask: torch.Tensor | None = None,  # [b, past + n] 1 = attend, 0 = padding (training batches)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(feature [b, n, d], head input [b, n, d]) for token ``input_ids`` paired with the feature of the
        position before it (see :meth:`body`)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        embeds = self.embed(input_ids)  # [b, n, d]
        features = features.to(self.fc.weight.dtype)
        make_mask = create_sliding_window_causal_mask if self.config.sliding_window else create_causal_mask
        mask = make_mask(
            config=self.layer_config, inputs_embeds=embeds, attention_mask=attention_mask,
            past_key_values=past_key_values, position_ids=position_ids,
        )
        rope = self.rotary_emb(embeds, position_ids=position_ids)
        kwargs = dict(
            attention_mask=mask, position_ids=position_ids, past_key_values=past_key_values,
            use_cache=past_key_values is not None, position_embeddings=rope,
        )
        return self.body(embeds, features, kwargs)

    def body(self, embeds: torch.Tensor, features: torch.Tensor, attn_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The kind's own layers over ``embeds`` [b, n, d] and ``features`` [b, n, f]: (feature, head input)."""
        raise NotImplementedError


class Eagle1Model(EagleModel):
    """EAGLE-1/2: ``fc`` over ``cat(embedding, feature)``, then one decoder layer without its input norm; its
    output is both the next feature and the head input (the target's LM head applies to it)."""

    def __init__(self, cfg: EagleConfig):
        super().__init__(cfg)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.has_fc_bias)
        self.layers = nn.ModuleList([eagle1_layer(cfg, self.layer_config)])

    def body(self, embeds: torch.Tensor, features: torch.Tensor, attn_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``fc`` over the embedding and the feature (embedding first, cnets1.py), then the layer."""
        out = self.layers[0](self.fc(torch.cat([embeds, features], dim=-1)), **attn_kwargs)
        return out, out


class Eagle3Model(EagleModel):
    """EAGLE-3: ``fc`` over the target's three tapped hidden states (the head's own features skip it), the
    ``midlayer`` over ``cat(input_layernorm(embedding), hidden_norm(h))``, ``norm`` and ``lm_head`` over its draft
    vocabulary (``d2t`` offsets, ``t2d`` mask)."""

    def __init__(self, cfg: EagleConfig):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        super().__init__(cfg)
        d = cfg.hidden_size
        self.fc = nn.Linear(cfg.feature_size, d, bias=cfg.has_fc_bias)
        self.midlayer = _eagle3_layer_class(cfg.arch)(self.layer_config, cfg.norm_before_residual)
        self.norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        if cfg.norm_before_fc:  # one norm over cat(h_low, h_mid, h_high)
            self.input_norm = LlamaRMSNorm(cfg.feature_size, eps=cfg.rms_norm_eps)
        if cfg.fc_norm:  # one norm per tapped layer
            self.fc_norm = nn.ModuleList(
                [LlamaRMSNorm(cfg.target_hidden, eps=cfg.rms_norm_eps) for _ in range(cfg.num_aux)]
            )
        self.lm_head = nn.Linear(d, cfg.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))  # [Vd] offsets
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # [V]
        with torch.no_grad():
            self.set_draft_vocab(torch.arange(cfg.draft_vocab))

    def body(self, embeds: torch.Tensor, features: torch.Tensor, attn_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Target features through :meth:`project` (features as wide as the head's own skip it), the midlayer,
        the norm."""
        h = self.project(features) if features.shape[-1] != self.config.hidden_size else features
        out = self.midlayer(embeds, h, **attn_kwargs)
        normed = self.norm(out)
        return (normed if self.config.norm_output else out), normed

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target features [..., f] through speculators' optional norms, then ``fc`` -> [..., d]."""
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        if self.config.fc_norm:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Make draft row i stand for target id ``target_ids[i]`` (sorted, distinct) — fills ``d2t`` (offsets) and
        ``t2d``."""
        target_ids = target_ids.to(self.d2t.device, torch.long)
        self.d2t.copy_(target_ids - torch.arange(target_ids.numel(), device=target_ids.device))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    def draft_to_target(self) -> torch.Tensor:
        """The target id of each draft row, LongTensor [Vd] (``arange + d2t``)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t
