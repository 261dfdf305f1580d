"""One EAGLE draft step at real shapes with random weights: the head over the full vocabulary vs 32k vs 3k rows.

An EAGLE step is one decoder layer plus the LM head, so the head is most of it: for an EAGLE-1 head on
Llama-3-8B, 525M head parameters against ~250M in the layer (MicroSpec reports −51.6% draft latency with a small
active set). Shapes:

- ``demo-eagle1``: an EAGLE-1 head for the demo target (Qwen2.5-Coder-1.5B: d 1,536, V 151,936, a Qwen2 layer);
- ``gemma3-270m-eagle1`` / ``gemma3-270m-eagle3``: heads for the 262k demo target (Gemma-3-270M: d 640, V 262,144;
  EAGLE-3 over a 32,768-id draft vocabulary), where the head is nearly the whole step;
- ``llama3-8b-eagle1``: EAGLE-1 for Llama-3-8B (d 4,096, V 128,256, ~250M layer parameters);
- ``llama3.1-8b-eagle3``: EAGLE-3 for Llama-3.1-8B, the same layer with 2d-wide q/k/v and a 32,000-id draft
  vocabulary (its head is a smaller share, so the three points sit closer).

The model is built on the meta device and materialised with random weights (nothing is downloaded); the
embedding shares the head's memory. ``weights="int8"`` steps it as the runtime steps an int8 draft
(``--draft-weights int8``): the layer's and fc's linears through fbgemm, the full head and a static 32k prefix
from fbgemm packs of its int8 rows, a 3k set as its gathered, dequantized rows (a dynamic policy's set). The step
decodes one token (its own feature fed back, as from the second draft step on) after ``context`` cached positions;
the cache is cropped back after each step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rich.table import Table

from dynvocab.bench.micro.timing import CacheFlusher, StepParams, cpu_threads, interleaved_ms, resolve_dtype
from dynvocab.models.eagle import EAGLE1
from dynvocab.models.int8 import INT8
from dynvocab.models.prepack import quantize_linears
from dynvocab.models.rows import Int8Rows

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)
GEMMA3_270M = dict(hidden_size=640, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                   vocab_size=262144, rope_theta=1000000.0, hidden_act="gelu_pytorch_tanh", max_position_embeddings=32768)
EAGLE_SHAPES = {
    "demo-eagle1": dict(kind="eagle", arch="qwen2", hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                        num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768),
    "gemma3-270m-eagle1": dict(kind="eagle", **GEMMA3_270M),
    "gemma3-270m-eagle3": dict(kind="eagle3", draft_vocab_size=32768, **GEMMA3_270M),
    "llama3-8b-eagle1": dict(kind="eagle", **LLAMA3_8B),
    "llama3.1-8b-eagle3": dict(kind="eagle3", draft_vocab_size=32000, **LLAMA3_8B),
}


def _random_head(shape: dict, dev: torch.device, dt: torch.dtype, seed: int):
    from dynvocab.models.eagle import EagleConfig, EagleModel

    cfg = EagleConfig(**shape)
    with torch.device("meta"):
        model = EagleModel(cfg)
    model.embed_tokens = None  # set below to the head's memory: an [V, d] table of its own would only cost RAM
    model.to_empty(device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, p.shape[-1] ** -0.5, generator=gen)
        model.to(dt)
        if cfg.kind == EAGLE1:  # the target's head [V, d]
            weight = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, device=dev)
            weight = (weight * cfg.hidden_size**-0.5).to(dt)
            table = weight
        else:  # the head's own lm_head [Vd, d]; the embedding rows are never read at these timings' scale
            weight = model.lm_head.weight.detach()
            table = weight.new_zeros(1, cfg.hidden_size).expand(cfg.vocab_size, -1)
    model.embed_tokens = torch.nn.Embedding.from_pretrained(table, freeze=True)
    model.rotary_emb = type(model.rotary_emb)(model.layer_config).to(dev)
    return model.eval(), weight


@torch.inference_mode()
def eagle_step_bench(
    shape: str = "demo-eagle1",
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    step: StepParams = StepParams(),
    threads: int | None = None,
    weights: str | None = None,
) -> dict:
    """Median times of one EAGLE draft step (M = 1) at ``shape`` (:data:`EAGLE_SHAPES`): the layer alone
    (``body_ms``) and the whole step with the head over ``full`` and over a contiguous K-row buffer for each K in
    ``step.active`` (FR-Spec's slice or a packed dynamic set: the same matmul). Returns ``shape``, ``dims``, ``device``,
    ``dtype``, ``context``, ``repeats``, ``threads``, ``layer_params``, ``head_rows``, ``body_ms``, ``step_ms``
    and ``ratio`` (step / full step) per head, ``head_share`` (of the full step) and ``weights``. ``weights``:
    ``"int8"`` for int8 draft weights, else (``None`` or the dtype's name) ``dtype``'s."""
    if shape not in EAGLE_SHAPES:
        raise ValueError(f"unknown EAGLE shape {shape!r}; known: {sorted(EAGLE_SHAPES)}")
    dev, dt = torch.device(device), resolve_dtype(dtype)
    int8 = weights == INT8
    with cpu_threads(threads):
        model, weight = _random_head(EAGLE_SHAPES[shape], dev, dt, step.seed)
        body = _decode_step(model, step.context, dev, dt)
        heads = _heads(model, weight, step.active, int8, dev, step.seed)
        fns = {"body": body, **{name: (lambda head=head: head(body())) for name, head in heads.items()}}
        step_ms = interleaved_ms(fns, dev, step.repeats, step.warmup, CacheFlusher(dev))
        body_ms = step_ms.pop("body")
        heads_and_tables = ("embed_tokens", "lm_head")
        return {
            "shape": shape,
            "dims": EAGLE_SHAPES[shape],
            "device": str(dev),
            "dtype": str(dt).removeprefix("torch."),
            "context": step.context,
            "repeats": step.repeats,
            "threads": torch.get_num_threads(),
            "layer_params": sum(p.numel() for n, p in model.named_parameters() if not n.startswith(heads_and_tables)),
            "head_rows": weight.shape[0],
            "body_ms": body_ms,
            "step_ms": step_ms,
            "ratio": {name: t / step_ms["full"] for name, t in step_ms.items()},
            "head_share": max(0.0, 1.0 - body_ms / step_ms["full"]),
            "weights": INT8 if int8 else str(dt).removeprefix("torch."),
        }


def _decode_step(model, context: int, dev: torch.device, dt: torch.dtype):
    """The layer's part of a draft step after ``context`` cached positions, as a function returning the head's
    input [1, d]; its own feature is fed back, as from the second draft step on, and every call sees the same cache."""
    cfg = model.config
    cache = model.new_cache()
    ids = torch.randint(cfg.vocab_size, (1, context), device=dev)  # [1, context]
    feats = torch.randn(1, context, cfg.feature_size, device=dev, dtype=dt)  # [1, context, f]
    model(ids, feats, torch.arange(context, device=dev)[None], cache)  # [1, context] cached positions
    token = torch.randint(cfg.vocab_size, (1, 1), device=dev)  # [1, 1]
    own = torch.randn(1, 1, cfg.hidden_size if cfg.kind == "eagle3" else cfg.feature_size, device=dev, dtype=dt)
    position = torch.tensor([[context]], device=dev)  # [1, 1]

    def body() -> torch.Tensor:
        head_in = model(token, own, position, cache)[1][0]  # [1, d]
        cache.crop(-1)  # every timed step sees the same cache length
        return head_in

    return body


def _heads(model, weight: torch.Tensor, active: tuple[int, ...], int8: bool, dev: torch.device, seed: int) -> dict:
    """The heads a step is timed with, by name: ``full``, one per K of ``active`` below the head's rows, and on
    EAGLE-1 the learned candidate selectors. ``int8``: the layer's linears quantized first, as an int8 draft runs."""
    vocab = weight.shape[0]
    subsets = {str(k): torch.randperm(vocab, device=dev)[:k] for k in active if k < vocab}  # [k] ids each
    if int8:
        quantize_linears(model)
        rows = Int8Rows(weight, keep_rows=True)
        heads = {"full": rows.linear}
        for name, ids in subsets.items():  # a static prefix runs from its own pack, a dynamic set gathered
            static = int(name) > DYNAMIC_ROWS
            heads[name] = Int8Rows(weight[ids]).linear if static else _gathered(rows, ids)
    else:
        heads = {"full": lambda h, w=weight: F.linear(h, w)}
        for name, ids in subsets.items():
            heads[name] = lambda h, w=weight[ids].contiguous(): F.linear(h, w)  # [k, d] packed rows
    if model.config.kind == EAGLE1:  # the learned candidate selectors over the target's vocabulary
        heads.update(_candidate_heads(rows if int8 else weight, vocab, dev, seed))
    return heads


def _candidate_heads(source, vocab: int, dev: torch.device, seed: int, contexts: int = 8) -> dict:
    """``lowrank`` (rank 256, 4,096 ids) and ``centroids`` (32 blocks of 128) steps as the runtime runs them: the
    policy selects from one of ``contexts`` random hidden states in turn (a set that changes every step, as in a
    run), the draft head (:class:`~dynvocab.runtime.heads.head.DraftHead` over the step's rows) multiplies the set."""
    from dynvocab.artifacts.selectors import random_selectors
    from dynvocab.runtime.heads.head import DraftHead
    from dynvocab.runtime.selection import SelectorPolicy
    from dynvocab.runtime.selection.centroids import centroid_selector
    from dynvocab.runtime.selection.lowrank import lowrank_selector

    dim = source.shape[1]
    gen = torch.Generator().manual_seed(seed + 7)
    low, cen = random_selectors(vocab, dim, gen)
    eos = torch.empty(0, dtype=torch.long)
    states = torch.randn(contexts, 1, dim, generator=gen).to(dev)
    out = {}
    for name, policy in (("lowrank", SelectorPolicy(lowrank_selector(low, vocab, eos, dev, 4096))),
                         ("centroids", SelectorPolicy(centroid_selector(cen, vocab, eos, dev, 32)))):
        head, turn = DraftHead(source), [0]

        def step(h, policy=policy, head=head, turn=turn):
            turn[0] += 1
            return head.logits(h, policy.active_ids(1, states[turn[0] % contexts]))[0]

        out[name] = step
    return out


DYNAMIC_ROWS = 4096  # int8: sets up to this size are timed as a dynamic policy's (gathered rows), larger as static


def _gathered(rows: Int8Rows, ids: torch.Tensor):
    """A head over the rows ``ids`` gathered as the runtime keeps them for a set that changes every cycle (int8
    with their scales where the CPU multiplies int8 rows fast, else dequantized float32)."""
    packed = rows.gather(ids)
    return lambda h: rows.matmul(h, *packed)


def render_eagle_step_table(results: list[dict]) -> Table:
    """One row per shape: layer time, full / 32k / 3k step times and their ratios to the full step."""
    weights = results[0].get("weights", results[0]["dtype"])
    table = Table(title=f"one EAGLE draft step ({results[0]['dtype']}, {weights} weights, on {results[0]['device']}, "
                        f"{results[0]['threads']} threads)")
    columns = ("shape", "layer params", "head rows", "layer ms", "full ms", "head share", "32k ms (×full)",
               "3k ms (×full)", "lowrank ms (×full)", "centroids ms (×full)")
    for col in columns:
        table.add_column(col, justify="left" if col == "shape" else "right")
    for r in results:
        cells = []
        for k in ("32768", "3072", "lowrank", "centroids"):
            cells.append("–" if k not in r["step_ms"] else f"{r['step_ms'][k]:.2f} ({r['ratio'][k]:.2f}×)")
        table.add_row(r["shape"], f"{r['layer_params'] / 1e6:.0f}M", f"{r['head_rows']:,}", f"{r['body_ms']:.2f}",
                      f"{r['step_ms']['full']:.2f}", f"{100 * r['head_share']:.0f}%", *cells)
    return table
