"""LM-head microbenchmark: the ways to compute draft logits over an active set, timed and set against the
device's memory bandwidth (the head is a GEMV/skinny GEMM, so bytes moved decide its speed).

Methods, for M hidden states and ``rows`` active rows of W [V, d]:

- ``full``: ``F.linear`` over all of W (the unpruned head; independent of ``rows``).
- ``static``: ``F.linear`` over a contiguous slice ``W[:rows]`` (FR-Spec's static top-K, packed once).
- ``index_select``: ``W.index_select(0, idx)`` then ``F.linear`` (a gathered copy every call).
- ``fused``: the Triton ``gathered_logits`` kernel reading ``W[idx]`` in place (CUDA only).
- ``packed``: ``F.linear`` over a pre-packed contiguous buffer of the rows (what the runtime's ``PackedHead``
  multiplies).

Achieved GB/s counts the bytes an op must move: W rows read + h read + logits written, so methods compare on one
scale; ``index_select`` moves more than it is credited with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from rich.table import Table

from dynvocab.kernels._triton import triton_available
from dynvocab.bench.micro.draft_step import draft_step_bench
from dynvocab.kernels.gathered_head import gathered_logits
from dynvocab.bench.micro.timing import (
    CacheFlusher,
    copy_bandwidth_gbps,
    cpu_threads,
    resolve_dtype,
    theoretical_bandwidth_gbps,
    time_ms,
)

__all__ = ["METHODS", "draft_step_bench", "render_kernel_table", "run_kernel_bench"]

METHODS = ("full", "static", "index_select", "fused", "packed")
METHOD_TITLES = {
    "full": "full head",
    "static": "static slice",
    "index_select": "index_select+mm",
    "fused": "fused kernel",
    "packed": "packed buffer",
}


def _resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def run_kernel_bench(
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    vocab: int = 151936,
    dim: int = 896,
    sizes: tuple[int, ...] = (1024, 2048, 3072, 4096, 8192, 16384, 32768),
    ms: tuple[int, ...] = (1, 8, 64),
    repeats: int = 20,
    warmup: int = 3,
    flush_cache: bool = True,
    seed: int = 0,
    threads: int | None = None,
) -> dict:
    """Time every head method for each M in ``ms`` and active size in ``sizes`` on a random W [vocab, dim].

    Returns a JSON-ready dict: ``device``, ``device_name``, ``dtype``, ``vocab``, ``dim``, ``repeats``,
    ``threads`` (CPU intra-op threads in use; the ``threads`` argument sets them for the run), ``bandwidth_gbps``
    (measured device copy), ``theoretical_gbps`` (CUDA properties, else None), ``methods``, ``notes``, and
    ``results``: one row per (method, m, rows) with ``time_ms`` (median), ``gbps`` and ``bw_frac`` (achieved /
    measured bandwidth).
    """
    with cpu_threads(threads):
        return _run_kernel_bench(_resolve_device(device), resolve_dtype(dtype), vocab, dim, sizes, ms, repeats,
                                 warmup, flush_cache, seed)


def _run_kernel_bench(dev: torch.device, dt: torch.dtype, vocab: int, dim: int, sizes: tuple[int, ...],
                      ms: tuple[int, ...], repeats: int, warmup: int, flush_cache: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, dim, generator=gen) * dim**-0.5).to(dev, dt)  # [V, d]
    esize = weight.element_size()
    flush = CacheFlusher(dev, enabled=flush_cache)
    sizes = tuple(s for s in sizes if s <= vocab)
    fused_ok = dev.type == "cuda" and triton_available()
    methods = [m for m in METHODS if m != "fused" or fused_ok]
    notes = []
    if not fused_ok:
        notes.append(f"fused: skipped on {dev.type} (the Triton kernel needs a GPU with triton installed)")
    if not flush_cache:
        notes.append("cache not flushed between repeats: small heads may be served from cache")
    bandwidth = copy_bandwidth_gbps(dev)
    results = []

    def record(method: str, m: int, rows: int, fn, nbytes: int) -> None:
        t = time_ms(fn, dev, repeats, warmup, flush)
        gbps = nbytes / (t * 1e-3) / 1e9
        results.append({"method": method, "m": m, "rows": rows, "time_ms": t, "gbps": gbps,
                        "bw_frac": gbps / bandwidth})

    def head_bytes(rows: int, m: int, out_esize: int) -> int:
        return rows * dim * esize + m * dim * esize + m * rows * out_esize

    with torch.inference_mode():
        ids = {s: torch.randperm(vocab, generator=gen)[:s].to(dev) for s in sizes}  # [s] random active rows
        packed = {s: weight.index_select(0, ids[s]) for s in sizes}  # [s, d] pre-packed buffers
        for m in ms:
            h = torch.randn(m, dim, generator=gen).to(dev, dt)  # [M, d]
            record("full", m, vocab, lambda: F.linear(h, weight), head_bytes(vocab, m, esize))
            for s in sizes:
                idx, rows = ids[s], packed[s]
                record("static", m, s, lambda s=s: F.linear(h, weight[:s]), head_bytes(s, m, esize))
                record("index_select", m, s, lambda idx=idx: F.linear(h, weight.index_select(0, idx)),
                       head_bytes(s, m, esize))
                if fused_ok:
                    record("fused", m, s, lambda idx=idx: gathered_logits(h, weight, idx), head_bytes(s, m, 4))
                record("packed", m, s, lambda rows=rows: F.linear(h, rows), head_bytes(s, m, esize))

    return {
        "device": str(dev),
        "device_name": _device_name(dev),
        "dtype": str(dt).removeprefix("torch."),
        "vocab": vocab,
        "dim": dim,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "bandwidth_gbps": bandwidth,
        "theoretical_gbps": theoretical_bandwidth_gbps(dev),
        "methods": methods,
        "notes": notes,
        "results": results,
    }


def _cell(row: dict | None) -> str:
    if row is None:
        return "—"
    t, gbps = row["time_ms"], row["gbps"]
    time_text = f"{t * 1e3:.0f} µs" if t < 1 else f"{t:.2f} ms"
    gbps_text = f"{gbps:.1f}" if gbps < 10 else f"{gbps:.0f}"
    return f"{time_text}\n{gbps_text} GB/s {100 * row['bw_frac']:.0f}%"


def render_kernel_table(result: dict) -> Table:
    """A rich table of a ``run_kernel_bench`` result: one row per (M, active rows), one column per method;
    each cell is the median time over its achieved GB/s and that rate's share of the measured bandwidth."""
    table = Table(
        title=f"LM-head kernels · {result['device_name']} · {result['dtype']} · "
        f"V={result['vocab']} d={result['dim']}"
    )
    methods = result["methods"]
    table.add_column("M", justify="right")
    table.add_column("rows", justify="right")
    for method in methods:
        table.add_column(METHOD_TITLES.get(method, method), justify="right")
    by_key = {(r["method"], r["m"], r["rows"]): r for r in result["results"]}
    ms = sorted({r["m"] for r in result["results"]})
    sizes = sorted({r["rows"] for r in result["results"] if r["method"] != "full"})
    for m in ms:
        for s in sizes:
            cells = []
            for method in methods:
                key = (method, m, result["vocab"] if method == "full" else s)
                cells.append(_cell(by_key.get(key)))
            table.add_row(str(m), str(s), *cells)
        table.add_section()
    caption = [f"device copy bandwidth {result['bandwidth_gbps']:.0f} GB/s (measured)"]
    if result.get("theoretical_gbps"):
        caption.append(f"theoretical {result['theoretical_gbps']:.0f} GB/s")
    caption.append(f"median of {result['repeats']}")
    if result["device"] == "cpu":
        caption.append(f"{result['threads']} thread(s)")
    table.caption = " · ".join(caption) + "".join(f"\n{note}" for note in result["notes"])
    return table
