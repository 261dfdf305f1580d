"""A draft model's one-token step without transformers' per-call machinery: the same modules, the same cache.

A one-token step of the demo draft (24 Qwen2 layers) spent ~18 of its ~43 ms outside any kernel (AVX2 CPU, 2
threads, int8 weights; torch.profiler: 25 ms of ops a step): mask construction, output dataclasses, decorators
and keyword plumbing around every layer — fixed costs that outweigh the int8 linears themselves. This step calls
the model's own modules (embedding, norms, projections — int8, LoRA-wrapped or plain —, rotary embedding, MLP)
in the order transformers' Llama/Qwen2 decoder layer calls them (``modeling_qwen2.Qwen2DecoderLayer.forward`` and
``Qwen2Attention.forward``, transformers 5.23) and appends to the model's own ``DynamicCache``, so the prompt pass,
tree passes and rollback stay transformers'.

One query attends every cached position, so no mask is needed; grouped-query heads are folded into the query
rows of their key/value head (``[1, kv, groups, d]``), which attends without copying the cache. Used for draft
models only: the draft only proposes, so a rounding difference against transformers' pass changes no output,
while the target's one-token passes (``ar``) stay transformers' own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynvocab.models.prepack import Int8Linear
from dynvocab.models.rows import Int8Rows

SUPPORTED_TYPES = ("llama", "qwen2")


def supports(model) -> bool:
    """True for a Llama or Qwen2 causal LM whose layers this step reproduces: full attention (no sliding window),
    no per-head q/k norms, eager or SDPA attention, the body's own rotary embedding."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED_TYPES:
        return False
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False
    body = getattr(model, model.base_model_prefix, None)
    if body is None or not hasattr(body, "rotary_emb") or not hasattr(body, "embed_tokens"):
        return False
    for layer in body.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or getattr(attn, "sliding_window", None) is not None:
            return False
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            return False
    return True


def _fused(linears, cache: dict, key) -> Int8Rows | None:
    """One int8 product for several int8 linears that read the same input (q/k/v; gate/up): their rows stacked,
    quantized per row as each was, so the outputs are the separate products' (fbgemm quantizes the shared input
    once either way). Built on first use and kept in ``cache``; None when any of them is not a plain
    :class:`Int8Linear` (float weights, or LoRA-wrapped by EvoSpec's alignment: their own modules run then)."""
    if not all(type(m) is Int8Linear for m in linears):
        return None
    rows = cache.get(key)
    if rows is None or rows[1] != tuple(id(m) for m in linears):
        biases = [m.bias if m.bias is not None else torch.zeros(m.out_features) for m in linears]
        has_bias = any(m.bias is not None for m in linears)
        with torch.no_grad():
            weight = torch.cat([m.weight for m in linears])
            stacked = Int8Rows(weight, torch.cat(biases) if has_bias else None)
        rows = cache[key] = (stacked, tuple(id(m) for m in linears))
    return rows[0]


def prepare(model, fused: dict) -> int:
    """Build the stacked int8 products of every layer now (not on the first step); their bytes (0 for float
    weights)."""
    total = 0
    for i, layer in enumerate(getattr(model, model.base_model_prefix).layers):
        attn, mlp = layer.self_attn, layer.mlp
        for key, linears in (("qkv", (attn.q_proj, attn.k_proj, attn.v_proj)), ("gate_up", (mlp.gate_proj, mlp.up_proj))):
            rows = _fused(linears, fused, (i, key))
            total += 0 if rows is None else rows.nbytes
    return total


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def one_token_step(model, token: torch.Tensor, position: int, cache, fused: dict | None = None) -> torch.Tensor:
    """Append one token [1] at ``position`` to ``cache`` (a transformers ``DynamicCache``); its final hidden state
    [1, d] (after the body's last norm), as ``model.<body>(input_ids=token[None], …).last_hidden_state[0]``.
    ``fused``: where int8 q/k/v and gate/up products stacked into one are kept between steps (None: none)."""
    body = getattr(model, model.base_model_prefix)
    h = body.embed_tokens(token.view(1, 1))  # [1, 1, d]
    at = torch.arange(position, position + 1, device=h.device).view(1, 1)  # made on the device: no host copy
    cos, sin = body.rotary_emb(h, at)  # [1, 1, hd] each
    cos, sin = cos[:, None], sin[:, None]  # [1, 1, 1, hd]: broadcast over heads
    for i, layer in enumerate(body.layers):
        attn = layer.self_attn
        hd = attn.head_dim
        x = layer.input_layernorm(h)  # [1, 1, d]
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv = None if fused is None else _fused(projections, fused, (i, "qkv"))
        if qkv is not None:
            q, k, v = qkv.linear(x).to(x.dtype).split([m.out_features for m in projections], dim=-1)
        else:
            q, k, v = (m(x) for m in projections)
        q = q.view(1, 1, -1, hd).transpose(1, 2)  # [1, heads, 1, hd]
        k = k.view(1, 1, -1, hd).transpose(1, 2)  # [1, kv, 1, hd]
        v = v.view(1, 1, -1, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = cache.update(k, v, i)  # [1, kv, L, hd]
        kv = keys.shape[1]
        q = q.reshape(1, kv, -1, hd)  # [1, kv, groups, hd]: head j is query row j % groups of kv head j // groups
        out = F.scaled_dot_product_attention(q, keys, values, scale=attn.scaling)  # [1, kv, groups, hd]
        h = h + attn.o_proj(out.reshape(1, 1, -1))
        x = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        gate_up = None if fused is None else _fused((mlp.gate_proj, mlp.up_proj), fused, (i, "gate_up"))
        if gate_up is None:
            h = h + mlp(x)
        else:
            gate, up = gate_up.linear(x).to(x.dtype).chunk(2, dim=-1)
            h = h + mlp.down_proj(mlp.act_fn(gate) * up)
    return body.norm(h)[0]
