"""One demo-draft step eagerly and as a replayed CUDA graph (``scripts/gpu_check.sh``'s ``graph_step`` section).

The body reads a transformers ``StaticCache`` whose length is reset on the device inside the step, so the step
holds no host value and every call (and every replay) writes the same slot; the head runs over all rows and over
packed K-row buffers. On a CPU the same step runs eagerly and the graph columns say why they are empty.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F

from dynvocab.bench.micro.timing import resolve_dtype, time_ms
from dynvocab.runtime.host import host_reads


def capture(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn`` captured as a CUDA graph after three warm-up calls on a side stream (as ``torch.cuda.graphs``
    requires); returns the graph and its static output, which each ``graph.replay()`` rewrites."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize(device)
    return graph, out


@torch.inference_mode()
def graph_step_bench(dims: dict, device: str = "cpu", dtype: str = "float32", context: int = 128,
                     heads: tuple[int, ...] = (3072,), repeats: int = 20, warmup: int = 3, seed: int = 0) -> dict:
    """One draft step (a random Qwen2 body at ``dims`` decoding one token after ``context`` cached ones, then the
    head over all rows, ``"full"``, and over a packed K-row buffer for each K in ``heads``) timed eagerly and, on
    CUDA, as a replayed CUDA graph. Returns ``dims``, ``device``, ``dtype``, ``context``, ``repeats``,
    ``host_reads_per_step`` (device reads in one step: none, or capture fails), ``static_vs_dynamic`` (max |diff|
    of the body's output against the usual DynamicCache step), ``eager_ms`` per head and ``graph``: per head
    ``{"captured", "ms", "speedup", "max_abs_diff"}`` or ``{"captured": False, "reason"}``."""
    dev, dt = torch.device(device), resolve_dtype(dtype)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    weight, body_step, reference = _static_step(dims, dev, dt, context, seed)
    vocab = weight.shape[0]
    rows = {"full": weight}
    for k in (k for k in heads if k < vocab):
        rows[str(k)] = weight[torch.randperm(vocab, device=dev)[:k]].contiguous()  # [k, d]
    steps = {name: (lambda w=w: F.linear(body_step(), w)) for name, w in rows.items()}
    with host_reads() as reads:
        steps["full"]()
    eager_ms = {name: time_ms(fn, dev, repeats, warmup) for name, fn in steps.items()}
    return {
        "dims": dims, "device": str(dev), "dtype": str(dt).removeprefix("torch."), "context": context,
        "repeats": repeats, "host_reads_per_step": dict(reads.elsewhere),
        "static_vs_dynamic": float((body_step().float() - reference.float()).abs().max()),
        "eager_ms": eager_ms,
        "graph": _graph_times(steps, eager_ms, dev, repeats, warmup),
    }


def _static_step(dims: dict, dev: torch.device, dt: torch.dtype, context: int, seed: int):
    """A random Qwen2 body at ``dims`` after a ``context``-token prompt: its head weight [V, d], its one-token step
    over a ``StaticCache`` (``() -> hidden [1, d]``) and that step's output over the usual ``DynamicCache``."""
    from transformers import DynamicCache, Qwen2Config, Qwen2Model, StaticCache

    cfg = Qwen2Config(**dims)
    torch.manual_seed(seed)
    with torch.device(dev):
        body = Qwen2Model(cfg).to(dt).eval()
    weight = body.embed_tokens.weight.detach()  # [V, d] the tied head
    vocab = weight.shape[0]
    prompt = torch.randint(vocab, (1, context), device=dev)  # [1, context]
    token = torch.randint(vocab, (1, 1), device=dev)  # [1, 1]
    position = torch.tensor([[context]], device=dev)  # [1, 1]
    cache = StaticCache(config=cfg, max_cache_len=context + 1)
    body(input_ids=prompt, past_key_values=cache, use_cache=True)
    lengths = [layer.cumulative_length for layer in cache.layers]

    def body_step() -> torch.Tensor:
        for length in lengths:
            length.fill_(context)  # back to the context on the device: no host value to capture
        return body(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).last_hidden_state[0]

    dynamic = DynamicCache(config=cfg)
    body(input_ids=prompt, past_key_values=dynamic, use_cache=True)
    reference = body(input_ids=token, past_key_values=dynamic, use_cache=True).last_hidden_state[0]  # [1, d]
    return weight, body_step, reference


def _graph_times(steps: dict, eager_ms: dict, dev: torch.device, repeats: int, warmup: int) -> dict:
    """Per step: captured as a CUDA graph and its replays timed against the eager step, or why it was not."""
    if dev.type != "cuda":
        reason = "CUDA graphs need a CUDA device; the step ran eagerly on the same static cache"
        return {name: {"captured": False, "reason": reason} for name in steps}
    out = {}
    for name, fn in steps.items():
        out[name] = replayed(fn, fn(), dev, repeats, warmup)
        if out[name]["captured"]:
            out[name]["speedup"] = eager_ms[name] / out[name]["ms"]
    return out


def replayed(fn: Callable[[], torch.Tensor], expected: torch.Tensor, dev: torch.device, repeats: int,
             warmup: int) -> dict:
    """``fn`` captured as a CUDA graph (:func:`capture`) and its replays timed: ``{"captured": True, "ms",
    "max_abs_diff"}`` against ``expected``, or ``{"captured": False, "reason"}`` where it cannot be (a step that
    reads the device or allocates by a size only the host knows) or ``dev`` is not CUDA."""
    if dev.type != "cuda":
        return {"captured": False, "reason": "CUDA graphs need a CUDA device"}
    try:
        graph, static_out = capture(fn, dev)
    except Exception as exc:  # say why, and let the caller time the next step
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(dev)
        return {"captured": False, "reason": f"{type(exc).__name__}: {exc}"[:800]}
    ms = time_ms(graph.replay, dev, repeats, warmup)
    return {"captured": True, "ms": ms, "max_abs_diff": float((static_out.float() - expected.float()).abs().max())}
