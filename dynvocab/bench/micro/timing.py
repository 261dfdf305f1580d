"""Timing helpers shared by the kernel and draft-step benchmarks: median wall/device times, cache flushing, the
device's memory bandwidth as a copy achieves it, and the parameters of a one-step benchmark."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from dynvocab.models.loading import DTYPE_ALIASES, DTYPES

CPU_FLUSH_BYTES = 64 << 20  # larger than this machine's 32 MiB L3


@dataclass(frozen=True)
class StepParams:
    """What a one-step benchmark (:mod:`~dynvocab.bench.micro.draft_step`,
    :mod:`~dynvocab.bench.micro.eagle_step`) times and how often: one token decoded after ``context`` cached positions,
    the head over the full vocabulary and over a K-row set for each K in ``active``, each timed ``repeats`` times after
    ``warmup`` untimed runs; ``seed`` draws the random weights and ids."""

    context: int = 128
    active: tuple[int, ...] = (32768, 3072)
    repeats: int = 10
    warmup: int = 2
    seed: int = 0


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` → ``torch.bfloat16`` (likewise float32, float16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted([*DTYPES, *DTYPE_ALIASES])}")
    return DTYPES[name]


@contextlib.contextmanager
def cpu_threads(threads: int | None) -> Iterator[int]:
    """Run the block with ``threads`` intra-op CPU threads (None: unchanged); yields the count in use.

    On a loaded machine a multi-threaded op waits at its barrier for a descheduled thread, so small ops time at
    scheduler-slice scale (milliseconds); one thread gives stable numbers there.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CacheFlusher:
    """Overwrites a buffer larger than the last-level cache, so a timed op reads its operands from memory, as it
    does inside a draft step where the model body has just streamed through the cache."""

    def __init__(self, device: torch.device, enabled: bool = True):
        nbytes = CPU_FLUSH_BYTES
        if device.type == "cuda":
            nbytes = max(4 * torch.cuda.get_device_properties(device).L2_cache_size, 64 << 20)
        self.buffer = torch.empty(nbytes if enabled else 0, dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        if self.buffer.numel():
            self.buffer.fill_(1)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int,
            flush: CacheFlusher | None = None) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs (CUDA: event timing)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(max(1, repeats)):
        if flush is not None:
            flush()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def interleaved_ms(fns: dict, device: torch.device, repeats: int, warmup: int, flush: CacheFlusher) -> dict:
    """Median milliseconds of each of ``fns`` when they take turns, one call each per round (a shared machine's
    load then weighs on all of them alike, so their ratios hold); ``flush`` runs before every call."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            flush()
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth_gbps(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """GB/s of a large device-to-device tensor copy (bytes read + bytes written per second)."""
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, repeats=repeats, warmup=1)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def theoretical_bandwidth_gbps(device: torch.device) -> float | None:
    """Peak DRAM bandwidth from the CUDA device properties (DDR: 2 transfers per clock), None when unknown."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
