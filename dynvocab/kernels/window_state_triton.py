"""Triton kernel for ``WindowState.push``: append entries to the ring and update token counts (imported lazily)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_new", "start"])
def window_push_kernel(
    ring_ptr,  # [W] int32 ring of stream entries, -1 = empty
    counts_ptr,  # [V] int32 occurrences of each token in the window
    tokens_ptr,  # [n_new] entries to append, oldest first (n_new <= W)
    n_new,
    start,  # ring slot of the first new entry
    window,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < n_new
    slots = (start + offs) % window  # distinct because n_new <= W: no two programs touch one slot
    old = tl.load(ring_ptr + slots, mask=mask, other=-1)  # [BLOCK] evicted entries
    tok = tl.load(tokens_ptr + offs, mask=mask, other=0).to(tl.int32)  # [BLOCK]
    tl.atomic_add(counts_ptr + tl.where(old >= 0, old, 0), -1, mask=mask & (old >= 0), sem="relaxed")
    tl.atomic_add(counts_ptr + tok, 1, mask=mask, sem="relaxed")
    tl.store(ring_ptr + slots, tok, mask=mask)
