"""The draft head's packed buffer for GPUs: ``W[I_t]`` kept contiguous, refilled asynchronously (MicroSpec §3.3).

``SlotTable`` is the bookkeeping — which token sits in which slot — shared with the CPU path
(``runtime.head.PackedHead``): slots freed by tokens that left are reused by tokens that entered, new slots
are appended when more enter than leave, and when the set shrinks live rows past the new end move into the holes
below it, so the active rows are always ``[0, n)``. Each update yields a list of copies ``rows[dst] = W[src]``.

``PackedBuffer`` owns the rows. ``schedule`` plans the copies on the current stream and launches the gather on a
side CUDA stream, recording an event; ``wait`` makes the current stream wait on that event. Call ``schedule``
as soon as ``I_{t+1}`` is known (after verification), run the draft body, and ``wait`` (or ``logits``, which
waits) just before the head matmul: the gather hides behind the body. On CPU the gather is a synchronous copy
and ``wait`` does nothing.

Planning reads the sizes of ``nonzero`` results, a host sync on CUDA; it happens once per update, right after
verification, where the loop synchronizes anyway. The copies themselves never block the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynvocab.kernels._triton import check_launchable, triton_available


def gather_rows_reference(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """Torch reference: ``dst[dst_idx] = src[src_idx]`` in place (``src`` [V, d], ``dst`` [cap, d], indices [k])."""
    dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))


def gather_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """Triton kernel: copy rows ``src[src_idx]`` [k, d] into ``dst[dst_idx]`` in place, without a temporary.

    ``dst_idx`` must not repeat a slot. Needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``.
    """
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1]:
        raise ValueError(f"src [V, d] and dst [cap, d] must share d; got {tuple(src.shape)}, {tuple(dst.shape)}")
    if src.dtype != dst.dtype:
        raise TypeError(f"src and dst dtypes differ: {src.dtype}, {dst.dtype}")
    if src_idx.dim() != 1 or src_idx.shape != dst_idx.shape:
        raise ValueError(f"src_idx and dst_idx must be [k]; got {tuple(src_idx.shape)}, {tuple(dst_idx.shape)}")
    if src_idx.dtype not in (torch.int32, torch.int64) or dst_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError("indices must be int32 or int64")
    if src.stride(1) != 1 or dst.stride(1) != 1 or not src_idx.is_contiguous() or not dst_idx.is_contiguous():
        raise ValueError("src and dst need unit stride along d, and the indices must be contiguous")
    check_launchable(src, dst, src_idx, dst_idx)
    import triton

    from dynvocab.kernels.packed_buffer_triton import gather_rows_kernel

    k, d = src_idx.numel(), src.shape[1]
    if k == 0:
        return
    block_r, block_d = 4, min(triton.next_power_of_2(d), 1024)
    grid = (triton.cdiv(k, block_r), triton.cdiv(d, block_d))
    gather_rows_kernel[grid](
        src, dst, src_idx, dst_idx, k, d, src.stride(0), dst.stride(0), BLOCK_R=block_r, BLOCK_D=block_d
    )


def gather_rows_auto(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """``dst[dst_idx] = src[src_idx]`` in place: the Triton kernel on CUDA, the torch reference elsewhere."""
    if src.is_cuda and triton_available():
        gather_rows(src, src_idx, dst, dst_idx)
    else:
        gather_rows_reference(src, src_idx, dst, dst_idx)


def grown(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """``t`` [cap, ...] itself when it has ``capacity`` rows, else a larger copy keeping its rows (a buffer's growth)."""
    if t.shape[0] >= capacity:
        return t
    out = t.new_empty(capacity, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


class SlotTable:
    """Token ↔ slot bookkeeping of a packed buffer; live slots are always ``[0, n)``."""

    def __init__(self, vocab: int, capacity: int = 0, device: torch.device | str | None = None):
        self.slot_of = torch.full((vocab,), -1, dtype=torch.long, device=device)  # [V] token -> slot, -1 = absent
        self.ids = torch.full((capacity,), -1, dtype=torch.long, device=device)  # [cap] slot -> token, -1 = empty
        self.n = 0
        self._inside = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V] scratch, all False between calls

    @property
    def capacity(self) -> int:
        """Slots allocated (grows by doubling)."""
        return self.ids.numel()

    @property
    def active(self) -> torch.Tensor:
        """Token id of each live slot [n]."""
        return self.ids[: self.n]

    def update(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the live slots hold exactly the set ``ids`` [n'] (distinct; order free).

        Returns the copies to perform, ``(dst, src)``: slots [k] and the token (W row) [k] to copy into each.
        Work is O(n + n'), not O(V): a persistent [V] scratch mask is set at ``ids`` and cleared again.
        """
        self._inside[ids] = True
        leaving = ~self._inside[self.active]  # [n] live slots whose token is not in ids
        self._inside[ids] = False
        fresh = ids[self.slot_of[ids] < 0]  # [f] tokens that entered
        return self._apply(leaving, fresh)

    def assign(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Make slot ``i`` hold ``ids[i]`` (distinct), whatever was live before; returns the copies ``(dst, src)``."""
        self.slot_of[self.active] = -1
        self.ids[: self.n] = -1
        self._reserve(ids.numel())
        self.n = ids.numel()
        dst = torch.arange(self.n, device=ids.device)
        self.ids[dst] = ids
        self.slot_of[ids] = dst
        return dst, ids

    def update_changes(self, entered: torch.Tensor, left: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same as ``update``, from masks [V] of tokens that entered / left the set since the last update."""
        fresh = torch.nonzero(entered).flatten()  # [f]
        return self._apply(left[self.active], fresh)

    def _apply(self, leaving: torch.Tensor, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``leaving`` [n]: which live slots lose their token; ``fresh`` [f]: tokens to add."""
        stale = torch.nonzero(leaving).flatten()  # [s] freed slots, ascending
        self.slot_of[self.ids[stale]] = -1
        n_old = self.n
        n_new = n_old - stale.numel() + fresh.numel()
        self._reserve(n_new)
        if fresh.numel() >= stale.numel():
            tail = torch.arange(n_old, n_new, device=stale.device)
            dst, src = torch.cat([stale, tail]), fresh
        else:
            holes = stale[fresh.numel():]
            self.ids[holes] = -1
            # Keep the rows compact: live rows past the new end move into the holes below it.
            low_holes = holes[holes < n_new]
            tail = torch.arange(n_new, n_old, device=stale.device)
            movers = tail[self.ids[tail] >= 0]
            moved = self.ids[movers]
            self.ids[movers] = -1
            dst = torch.cat([stale[: fresh.numel()], low_holes])
            src = torch.cat([fresh, moved])
        self.ids[dst] = src
        self.slot_of[src] = dst
        self.n = n_new
        return dst, src

    def _reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        ids = self.ids.new_full((max(n, 2 * self.capacity),), -1)
        ids[: self.capacity] = self.ids
        self.ids = ids


class PackedBuffer:
    """A persistent contiguous buffer of LM-head rows ``W[I_t]`` refilled by a gather on a side stream."""

    def __init__(self, weight: torch.Tensor, capacity: int = 3072, side_stream: bool = True):
        """``weight`` [V, d]; ``capacity`` rows are preallocated (MicroSpec's W_max) and grow on demand."""
        self.weight = weight  # [V, d]
        vocab, dim = weight.shape
        self.slots = SlotTable(vocab, capacity, weight.device)
        self.rows = weight.new_empty(capacity, dim)  # [cap, d]
        use_stream = side_stream and weight.is_cuda
        self._stream = torch.cuda.Stream(weight.device) if use_stream else None
        self._event = torch.cuda.Event() if use_stream else None
        self._pending = False
        self.rows_copied = 0

    @property
    def n(self) -> int:
        """Number of live rows."""
        return self.slots.n

    @property
    def ids(self) -> torch.Tensor:
        """Token id of each live row [n] (column j of ``logits`` is token ``ids[j]``)."""
        return self.slots.active

    def schedule(self, ids: torch.Tensor) -> None:
        """Start packing exactly the token set ``ids`` [n] (distinct), copying only rows that changed."""
        self._gather(*self.slots.update(ids))

    def schedule_changes(self, entered: torch.Tensor, left: torch.Tensor) -> None:
        """Start packing from masks [V] of tokens that entered / left since the last schedule
        (``WindowState.changed_since_last`` called once per schedule gives exactly these)."""
        self._gather(*self.slots.update_changes(entered, left))

    def wait(self) -> None:
        """Make the current stream wait for the scheduled gather (call just before the head matmul)."""
        if self._pending:
            torch.cuda.current_stream(self.weight.device).wait_event(self._event)
            self._pending = False

    def logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 logits [M, n] of ``hidden`` [M, d] over the packed rows, and the token id of each column [n]."""
        self.wait()
        return F.linear(hidden, self.rows[: self.n]).float(), self.ids

    def _grow(self) -> torch.Tensor | None:
        """Reallocate the rows to the table's capacity; returns the old rows (still to be copied) or None."""
        if self.rows.shape[0] >= self.slots.capacity:
            return None
        old = self.rows
        self.rows = old.new_empty(self.slots.capacity, old.shape[1])
        return old

    def _gather(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.rows_copied += src.numel()
        if self._stream is None:
            self.rows = grown(self.rows, self.slots.capacity)
            gather_rows_auto(self.weight, src, self.rows, dst)
            return
        # The side stream starts after the plan (and the previous head matmul reading the rows) on this stream.
        self._stream.wait_stream(torch.cuda.current_stream(self.weight.device))
        old = self._grow()
        with torch.cuda.stream(self._stream):
            if old is not None:
                self.rows[: old.shape[0]] = old
                old.record_stream(self._stream)
            gather_rows_auto(self.weight, src, self.rows, dst)
        src.record_stream(self._stream)
        dst.record_stream(self._stream)
        self._event.record(self._stream)
        self._pending = True
