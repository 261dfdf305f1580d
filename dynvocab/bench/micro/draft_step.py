"""Draft-step benchmark at the demo draft's shapes: body (one decode step over a KV cache) plus LM head, with
the head over the full vocabulary, a static 32k slice, and a 3k packed MicroSpec buffer.

Weights are random, built from a ``Qwen2Config`` (nothing is downloaded); timings depend on shapes only. On a
CPU pass ``layers`` to shorten the body; the GPU session runs the full 24 layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rich.table import Table

from dynvocab.kernels.gathered_head import gathered_logits_auto
from dynvocab.bench.micro.timing import CacheFlusher, StepParams, cpu_threads, resolve_dtype, time_ms

QWEN2_0_5B = {  # Qwen2.5(-Coder)-0.5B: the demo draft
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
DRAFT_CONFIGS = {"qwen2-0.5b": QWEN2_0_5B}


def draft_dims(config: str | dict, layers: int | None = None) -> dict:
    """Qwen2Config fields for a named draft (``DRAFT_CONFIGS``) or for overrides of the 0.5B dims."""
    if isinstance(config, str):
        if config not in DRAFT_CONFIGS:
            raise ValueError(f"unknown draft config {config!r}; known: {sorted(DRAFT_CONFIGS)}")
        dims = dict(DRAFT_CONFIGS[config])
    else:
        dims = {**QWEN2_0_5B, **config}
    if layers is not None:
        dims["num_hidden_layers"] = layers
    return dims


@torch.inference_mode()
def draft_step_bench(
    config_name_or_dims: str | dict = "qwen2-0.5b",
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    layers: int | None = None,
    step: StepParams = StepParams(),
    threads: int | None = None,
) -> dict:
    """Median times of one draft step's body and head (M = 1) on a randomly initialised Qwen2 body.

    The body decodes one token after ``step.context`` cached tokens (the cache is cropped back after each step).
    Heads: ``full`` (all V rows), ``"<K>"`` for each K in ``step.active`` (a contiguous K-row buffer: FR-Spec's
    static slice or MicroSpec's packed buffer, the same matmul), and ``"<K>_gathered"`` (``gathered_logits_auto``
    over K random ids: the fused kernel on CUDA, index_select + matmul elsewhere). Returns ``config``, ``device``,
    ``dtype``, ``context``, ``repeats``, ``threads``, ``body_ms``, ``head_ms``, ``step_ms`` (body + head) and
    ``head_share`` per head. ``threads`` sets the CPU intra-op threads for the run (None: unchanged).
    """
    with cpu_threads(threads):
        return _draft_step_bench(config_name_or_dims, torch.device(device), resolve_dtype(dtype), layers, step)


def _draft_step_bench(config_name_or_dims: str | dict, dev: torch.device, dt: torch.dtype, layers: int | None,
                      step: StepParams) -> dict:
    from transformers import DynamicCache, Qwen2Config, Qwen2Model

    context, repeats, warmup = step.context, step.repeats, step.warmup
    dims = draft_dims(config_name_or_dims, layers)
    cfg = Qwen2Config(**dims)
    torch.manual_seed(step.seed)
    with torch.device(dev):
        body = Qwen2Model(cfg).to(dt).eval()
    weight = body.embed_tokens.weight.detach()  # [V, d] the tied LM head
    vocab = weight.shape[0]

    cache = DynamicCache(config=cfg)
    prompt = torch.randint(vocab, (1, context), device=dev)  # [1, context]
    body(input_ids=prompt, past_key_values=cache, use_cache=True)
    token = torch.randint(vocab, (1, 1), device=dev)  # [1, 1]

    def body_step() -> torch.Tensor:
        hidden = body(input_ids=token, past_key_values=cache, use_cache=True).last_hidden_state[0]  # [1, d]
        cache.crop(-1)  # back to the context: every timed step sees the same cache length
        return hidden

    body_ms = time_ms(body_step, dev, repeats, warmup)
    h = body_step()  # [1, d]
    flush = CacheFlusher(dev)  # the body streams its weights through the cache before the head runs
    heads = {"full": lambda: F.linear(h, weight)}
    for k in (k for k in step.active if k <= vocab):
        rows = weight[torch.randperm(vocab, device=dev)[:k]].contiguous()  # [k, d]
        ids = torch.randperm(vocab, device=dev)[:k]  # [k]
        heads[str(k)] = lambda rows=rows: F.linear(h, rows)
        heads[f"{k}_gathered"] = lambda ids=ids: gathered_logits_auto(h, weight, ids)
    head_ms = {name: time_ms(fn, dev, repeats, warmup, flush) for name, fn in heads.items()}
    step_ms = {name: body_ms + t for name, t in head_ms.items()}
    return {
        "config": dims,
        "device": str(dev),
        "dtype": str(dt).removeprefix("torch."),
        "context": context,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "body_ms": body_ms,
        "head_ms": head_ms,
        "step_ms": step_ms,
        "head_share": {name: head_ms[name] / step_ms[name] for name in head_ms},
    }


def render_draft_step_table(result: dict) -> Table:
    """One row per head of a :func:`draft_step_bench` result: head ms, step ms (body + head) and the head's share."""
    dims = result["config"]
    table = Table(title=f"one draft-model step · {dims['num_hidden_layers']} layers, d {dims['hidden_size']:,}, "
                        f"V {dims['vocab_size']:,} · {result['dtype']} on {result['device']} · "
                        f"{result['threads']} threads · body {result['body_ms']:.2f} ms")
    for col in ("head", "head ms", "step ms", "head share"):
        table.add_column(col, justify="left" if col == "head" else "right")
    for name, head_ms in result["head_ms"].items():
        table.add_row(name, f"{head_ms:.3f}", f"{result['step_ms'][name]:.2f}",
                      f"{100 * result['head_share'][name]:.0f}%")
    table.caption = f"median of {result['repeats']} after {result['context']} cached tokens"
    return table
