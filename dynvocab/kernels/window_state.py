"""MicroSpec's sliding-window vocabulary state, kept on the device with no host sync per step (§3.2, §3.3).

The window holds the last ``W_max`` (3072) entries of the candidate stream in a ring buffer; ``counts`` [V]
(int32) holds how often each token occurs in it, so the active set ``I_t = Unique(Suffix(S, W_max))`` is the
bitmap ``counts > 0``. A push writes the new entries over the oldest ones (FIFO) and adjusts the counts of the
entries it evicts and adds.

Implementation: on CUDA a push is one Triton kernel (``window_push_kernel``: a ring write plus atomic count
updates); elsewhere, and as the reference the tests check the kernel against, it is a few torch index and
``scatter_add_`` ops. Either way the write position is host arithmetic on the push length, so no step reads a
device value back (no ``.item()``, ``.tolist()`` or ``nonzero``). Callers read the set from ``counts`` (the
policies test ``counts[ids] > 0`` for the ids a push returned as evicted and the ids it pushed).
"""

from __future__ import annotations

import torch

from dynvocab.kernels._triton import check_launchable, triton_available

W_MAX = 3072


def window_push_reference(ring: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor, start: int) -> None:
    """Torch reference: write ``tokens`` [n] (n <= W) into ``ring`` [W] from slot ``start``; update ``counts`` [V]."""
    window = ring.numel()
    slots = torch.arange(start, start + tokens.numel(), device=ring.device) % window  # [n]
    old = ring[slots]  # [n] evicted entries, -1 = empty
    counts.scatter_add_(0, old.clamp(min=0).long(), -(old >= 0).to(counts.dtype))
    counts.scatter_add_(0, tokens.long(), torch.ones_like(tokens, dtype=counts.dtype))
    ring[slots] = tokens.to(ring.dtype)


def window_push(ring: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor, start: int) -> None:
    """Triton kernel: the same update as ``window_push_reference``, in one launch.

    Needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``.
    """
    if ring.dtype != torch.int32 or counts.dtype != torch.int32:
        raise TypeError(f"ring and counts must be int32; got {ring.dtype}, {counts.dtype}")
    if tokens.dtype not in (torch.int32, torch.int64) or tokens.dim() != 1 or not tokens.is_contiguous():
        raise TypeError("tokens must be a contiguous 1-D int32/int64 tensor")
    if tokens.numel() > ring.numel():
        raise ValueError(f"push of {tokens.numel()} entries exceeds the window {ring.numel()}; keep the suffix")
    check_launchable(ring, counts, tokens)
    import triton

    from dynvocab.kernels.window_state_triton import window_push_kernel

    n = tokens.numel()
    if n == 0:
        return
    block = 256
    window_push_kernel[(triton.cdiv(n, block),)](ring, counts, tokens, n, start, ring.numel(), BLOCK=block)


class WindowState:
    """The last ``window`` stream entries and the active-token bitmap they define, all on one device."""

    def __init__(
        self, vocab: int, window: int = W_MAX, device: torch.device | str | None = None, use_kernel: bool | None = None
    ):
        """An empty window of ``window`` entries over ``vocab`` tokens. ``use_kernel``: push with the Triton kernel
        (default: on CUDA when Triton is installed; ``True`` on CPU needs ``TRITON_INTERPRET=1``)."""
        self.vocab = vocab
        self.window = window
        self.ring = torch.full((window,), -1, dtype=torch.int32, device=device)  # [W] entries, -1 = empty
        self.counts = torch.zeros(vocab, dtype=torch.int32, device=device)  # [V] occurrences in the window
        self._pos = 0  # next ring slot to write (host arithmetic: no device read)
        self.filled = 0  # entries in the window, <= W
        self._use_kernel = self.ring.is_cuda and triton_available() if use_kernel is None else use_kernel

    def reset(self) -> None:
        """Empty the window."""
        self.ring.fill_(-1)
        self.counts.zero_()
        self._pos = self.filled = 0

    def push(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append stream entries ``tokens`` [n] (ids in ``[0, vocab)``, oldest first, duplicates allowed),
        evicting the oldest (FIFO). Returns the evicted entries [n] (int32, -1 where the slot was empty): with
        ``tokens`` they are the only ids whose count changed, so a caller can update its set from them alone.

        A push longer than the window keeps only its last ``window`` entries, exactly as appending one by one.
        """
        tokens = tokens.reshape(-1)[-self.window:]  # [n <= W]
        n = tokens.numel()
        if n == 0:
            return self.ring[:0]
        tokens = tokens.to(self.ring.device).contiguous()
        slots = torch.arange(self._pos, self._pos + n, device=self.ring.device) % self.window  # [n]
        evicted = self.ring[slots]  # [n] a copy, read before the push overwrites the slots
        push = window_push if self._use_kernel else window_push_reference
        push(self.ring, self.counts, tokens, self._pos)
        self._pos = (self._pos + n) % self.window
        self.filled = min(self.window, self.filled + n)
        return evicted
