"""Triton kernels for the draft head and MicroSpec's device-side state, each beside its torch reference.

Importing this package never imports Triton: the ``*_triton.py`` kernel modules load on the first launch (so
``TRITON_INTERPRET`` may be set any time before it), and the ``*_auto`` functions use the torch references on
CPU. Their timings live in :mod:`dynvocab.bench.microbench`.

What the runtime calls: ``SlotTable`` / ``grown`` (the draft head's slot bookkeeping, :mod:`dynvocab.runtime.head`)
and ``WindowState`` (MicroSpec). The gathered-head kernels, ``PackedBuffer`` and ``gather_rows_auto`` are not on
the decode path today: only the bench package (microbenchmarks, draft-step timing) and the tests call them; they
stay here, beside their references, as the GPU head the runtime may adopt. Public entry points:

- ``gathered_logits_auto(h, weight, idx)``: logits [M, n] over rows ``idx`` of the LM head, fused on CUDA.
- ``batched_gathered_logits_auto(h, weight, idx)``: per-sequence active sets, ``idx`` [B, n] padded with -1.
- ``PackedBuffer``: the contiguous ``W[I_t]`` buffer, refilled on a side stream (``schedule`` / ``wait``).
- ``WindowState``: MicroSpec's sliding window (ring + counts bitmap) on the device.
"""

from dynvocab.kernels._triton import interpreting, triton_available
from dynvocab.kernels.gathered_head import (
    batched_gathered_logits,
    batched_gathered_logits_auto,
    batched_gathered_logits_reference,
    gathered_logits,
    gathered_logits_auto,
    gathered_logits_reference,
)
from dynvocab.kernels.packed_buffer import PackedBuffer, SlotTable, gather_rows, gather_rows_auto, gather_rows_reference
from dynvocab.kernels.window_state import W_MAX, WindowState, window_push, window_push_reference

__all__ = [
    "PackedBuffer",
    "SlotTable",
    "W_MAX",
    "WindowState",
    "batched_gathered_logits",
    "batched_gathered_logits_auto",
    "batched_gathered_logits_reference",
    "gather_rows",
    "gather_rows_auto",
    "gather_rows_reference",
    "gathered_logits",
    "gathered_logits_auto",
    "gathered_logits_reference",
    "interpreting",
    "triton_available",
    "window_push",
    "window_push_reference",
]
