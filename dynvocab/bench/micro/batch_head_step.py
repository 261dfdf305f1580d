"""The batched heads at one draft step (``scripts/gpu_check.sh``'s ``batch_heads`` section): every strategy that runs
inside vLLM, its selector and its head over B rows, as the plugin calls them (:class:`SelectedHead`), eagerly and, on
CUDA, captured as a CUDA graph.

The bundle is random at the demo draft's sizes (:func:`~dynvocab.artifacts.random_stages.random_bundle`), and so is
the head (Qwen2.5-0.5B's tied [151,936, 896] by default); each row's request window holds the distinct ids of
``context`` tokens drawn at log-uniform frequency ranks (Zipf's law with s = 1), so rows share their frequent ids as
real requests do. The figures are costs, not recall. Per strategy, batch size and draft position: ids per row and
the selector's ms; then for each way the head scores a changing set, over the batch's distinct ids (``union``, what
it does on a CPU) and row by row (``per_row``, [B, k, d] gathered and one batched product: what it does elsewhere,
with no ``torch.unique`` whose output size the host must read), selector + head ms, device reads in one step, rows
multiplied (context strategies), max |diff| against ``union``, and the graph (captured or why not, replay ms).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from dynvocab.artifacts.bundle import load_bundle
from dynvocab.artifacts.random_stages import random_bundle
from dynvocab.bench.micro.graph_step import replayed
from dynvocab.bench.micro.timing import resolve_dtype, time_ms
from dynvocab.runtime.batched import SelectorSpec, batch_strategies, build_selector, bundle_stages
from dynvocab.runtime.host import host_reads
from dynvocab.runtime.heads.selected_head import SelectedHead
from dynvocab.runtime.selection.batch_select import StepContext
from dynvocab.runtime.selection.context.window import RequestWindows


@torch.inference_mode()
def batch_head_bench(vocab: int = 151936, hidden: int = 896, strategies: tuple[str, ...] | None = None,
                     batches: tuple[int, ...] = (1, 4, 8), steps: tuple[int, ...] = (0, 3), context: int = 1024,
                     device: str = "cpu", dtype: str = "float32", repeats: int = 20, warmup: int = 3, seed: int = 0,
                     bundle_sizes: dict | None = None) -> dict:
    """Each of ``strategies`` (None: :func:`timed_strategies`) at each of ``batches`` rows and draft
    positions ``steps`` (see the module's docstring). Returns ``vocab``, ``hidden``, ``device``, ``dtype``,
    ``context``, ``full_ms`` (the whole head per batch size) and ``results``: one dict per (strategy, batch, step)."""
    dev, dt = torch.device(device), resolve_dtype(dtype)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).to(dev, dt)  # [V, d] the tied head
    with tempfile.TemporaryDirectory() as tmp:
        bundle = load_bundle(random_bundle(Path(tmp) / "bundle.safetensors", vocab, hidden, seed,
                                           **(bundle_sizes or {})))
        selectors = {s: build_selector(bundle, SelectorSpec(s), vocab, hidden, dev)
                     for s in strategies or timed_strategies(bundle)}
    top = max(batches)
    states = torch.randn(top, hidden, generator=gen).to(dev, dt)  # [B, d]
    fed = torch.randint(vocab, (top,), generator=gen).to(dev)  # [B]
    records = _records(top, vocab, context, gen)
    sizes = {getattr(s, "window", 0) for s in selectors.values()} - {0}  # the request windows the selectors read
    windows = {size: _windows(records, size, vocab, dev) for size in sizes}
    embed = lambda ids: weight.index_select(0, ids)  # noqa: E731  (the demo draft ties its embedding to its head)
    full_ms = {str(b): time_ms(lambda b=b: F.linear(states[:b], weight), dev, repeats, warmup) for b in batches}
    results = []
    for name, selector in selectors.items():
        for b in batches:
            for step in steps:
                size = getattr(selector, "window", 0)
                ctx = StepContext(step, fed[:b], windows[size][:b] if size else None, embed)
                results.append(_one(name, selector, states[:b], weight, ctx, dev, repeats, warmup))
    return {"vocab": vocab, "hidden": hidden, "device": str(dev), "dtype": str(dt).removeprefix("torch."),
            "context": context, "repeats": repeats, "full_ms": full_ms, "results": results}


def timed_strategies(bundle) -> tuple[str, ...]:
    """The strategies that run inside vLLM whose stages ``bundle`` has: every one but ``evospec``, whose HNSW stage a
    random bundle does not build (minutes at these sizes) and whose retrieval and per-request buffers run on the host,
    so no CUDA graph could hold them (the plugin builds its search on CPU devices only)."""
    return tuple(s for s in batch_strategies() if all(bundle.has(stage) for stage in bundle_stages(s)))


def _records(batch: int, vocab: int, context: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``batch`` requests' token records of ``context`` tokens each, at log-uniform ranks of a random ranking."""
    ranking = torch.randperm(vocab, generator=gen)
    ranks = (vocab ** torch.rand(batch, context, generator=gen)).long().clamp(max=vocab) - 1  # [batch, context]
    return list(ranking[ranks])


def _windows(records: list[torch.Tensor], size: int, vocab: int, dev: torch.device) -> torch.Tensor:
    """Request windows of ``records`` as the plugin hands them to a step: [len(records), width], the columns
    their distinct ids fill (:meth:`RequestWindows.width`)."""
    store = RequestWindows(len(records), size, vocab, device=dev)
    slots = [store.update(row, record) for row, record in enumerate(records)]
    return store.ids[:, : store.width(slots)]


def _one(name: str, selector, hidden: torch.Tensor, weight: torch.Tensor, ctx: StepContext, dev: torch.device,
         repeats: int, warmup: int) -> dict:
    """One (strategy, batch, step): sizes, the selector's time, and per way of scoring a changing set (``union``,
    a CPU's default; ``per_row``, the default elsewhere) the head's time, device reads, rows multiplied and graph."""
    reads_context = getattr(selector, "reads_context", False)
    pick = (lambda: selector.select(hidden, ctx)) if reads_context else (lambda: selector(hidden))  # noqa: E731
    out = {"strategy": name, "batch": int(hidden.shape[0]), "step": ctx.step,
           "selector_ms": time_ms(pick, dev, repeats, warmup)}
    reference = None
    for way, union in (("union", True), ("per_row", False)):
        head = SelectedHead(selector, union=union)
        step = lambda head=head: head.select_and_score(hidden, weight, ctx=ctx if reads_context else None)  # noqa: E731
        logits, ids = step()
        reference = logits if reference is None else reference
        head.scored = [0, 0]
        with host_reads() as reads:
            step()
        multiplied = int(head.scored[0]) if reads_context else None  # by that one step
        out["ids_per_row"] = int(ids.shape[1])
        out[way] = {"ms": time_ms(step, dev, repeats, warmup), "host_reads_per_step": dict(reads.elsewhere),
                    "rows_multiplied": multiplied,
                    "max_abs_diff": float((logits.float() - reference.float()).abs().max()),
                    "graph": replayed(lambda step=step: step()[0], logits, dev, repeats, warmup)}
    return out
