"""Opt-in section timing for the loop that never waits on a device inside a cycle.

On a CPU a mark is ``time.perf_counter()``. On a GPU it is a recorded CUDA event, and the time between two marks
is read once per cycle (:meth:`SectionTimer.flush`), after the verification has brought the tokens to the host
anyway, as gpt-fast and the serving engines time their steps. With timing off, marks are None and nothing runs.
"""

from __future__ import annotations

import time

import torch

from dynvocab.runtime.decoding.metrics import Metrics


class SectionTimer:
    """Charges the time between two marks to a :class:`Metrics` field (``draft_s``, ``head_s``, …)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self.pending: list[tuple[str, object, object]] = []

    def mark(self):
        """A point in time (None when timing is off)."""
        if not self.enabled:
            return None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, field: str, start, end=None) -> None:
        """Charge ``field`` with the time from ``start`` to ``end`` (default: now)."""
        if not self.enabled:
            return
        self.pending.append((field, start, self.mark() if end is None else end))

    def flush(self, m: Metrics) -> None:
        """Add the pending sections to ``m`` (on a GPU: waits for the last event once)."""
        if not self.pending:
            return
        if self.cuda:
            self.pending[-1][2].synchronize()
            for field, start, end in self.pending:
                setattr(m, field, getattr(m, field) + start.elapsed_time(end) / 1000)
        else:
            for field, start, end in self.pending:
                setattr(m, field, getattr(m, field) + end - start)
        self.pending.clear()
