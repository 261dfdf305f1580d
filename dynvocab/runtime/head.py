"""The draft's LM head restricted to an active set of rows, kept in a packed, contiguous buffer.

The buffer is updated incrementally: rows of tokens that left the active set are overwritten by rows of
tokens that entered, so a sliding-window policy that changes a few dozen ids per cycle copies a few dozen
rows, not thousands. A policy that returns nested prefixes of one ranking (FR-Spec, position-aware FR) is
packed once in ranking order; each prefix is then a slice of the buffer. A policy whose set is a union of
fixed groups (DynaSpec's clusters) returns :class:`RowRanges`: the rows are packed once in group order and
each step multiplies only the chosen ranges, so a set that changes completely between steps copies nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynvocab.kernels._triton import triton_available
from dynvocab.kernels.gathered_head import gathered_logits
from dynvocab.runtime.slots import SlotTable, grown


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Final-logit soft-capping ``tanh(x / cap) * cap`` (Gemma-style); ``cap`` None or 0 leaves logits as they are."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap


@dataclass(frozen=True, eq=False)
class RowRanges:
    """An active set given as ranges of a fixed id order: ``order[starts[i]:ends[i]]`` for every i.

    ``order`` must be the same tensor at every step (the head packs ``W[order]`` once, keyed by it); the ranges
    must not overlap. Sorted, adjacent ranges merged, they cost one matmul each.
    """

    order: torch.Tensor  # [N] token ids, e.g. grouped by cluster
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    @functools.cached_property
    def ids(self) -> torch.Tensor:
        """The token ids of the set, LongTensor [n], in range order."""
        if not self.starts:
            return self.order[:0]
        return torch.cat([self.order[a:b] for a, b in zip(self.starts, self.ends)])

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """Rows of ``W[order]`` the ranges cover, LongTensor [n] on ``order``'s device (built from the host's
        ranges: a copy to the device, no read back)."""
        spans = [torch.arange(a, b) for a, b in zip(self.starts, self.ends)]
        idx = torch.cat(spans) if spans else torch.empty(0, dtype=torch.long)
        return idx.to(self.order.device, non_blocking=True)

    @functools.cached_property
    def size(self) -> int:
        """Number of ids in the set."""
        return sum(b - a for a, b in zip(self.starts, self.ends))

    def numel(self) -> int:
        """Number of ids in the set (as ``Tensor.numel``, so segments of either kind count alike)."""
        return self.size


def merge_ranges(starts: list[int], ends: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sort non-overlapping ranges and merge those that touch: ``(starts, ends)``."""
    out_s: list[int] = []
    out_e: list[int] = []
    for a, b in sorted(zip(starts, ends)):
        if b <= a:
            continue
        if out_e and out_e[-1] == a:
            out_e[-1] = b
        else:
            out_s.append(a)
            out_e.append(b)
    return tuple(out_s), tuple(out_e)


class PackedHead:
    """Computes draft logits over ``ids`` only, reusing a packed copy of ``W[ids]`` across calls.

    Which token sits in which row is a :class:`~dynvocab.runtime.slots.SlotTable`, so an update copies only the
    rows of tokens that entered.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, softcap: float | None = None):
        self.weight = weight  # [V, d]
        self.bias = bias  # [V] or None
        self.softcap = softcap
        vocab, dim = weight.shape
        self.slots = SlotTable(vocab, 0, weight.device)
        self.rows = weight.new_empty(0, dim)  # [cap, d] packed W rows
        self.row_bias = None if bias is None else bias.new_empty(0)  # [cap]
        self._ordered: torch.Tensor | None = None  # ids packed in order by the last repack (prefixes reuse it)
        self._last: torch.Tensor | None = None  # the ids tensor of the previous call
        self.rows_copied = 0

    @property
    def n(self) -> int:
        """Rows in use: ``[0, n)``."""
        return self.slots.n

    @property
    def slot_of(self) -> torch.Tensor:
        """[V] token id -> row, -1 where absent."""
        return self.slots.slot_of

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``rows[dst] = W[src]`` (and the bias), growing the rows to the slot table's capacity first."""
        self.rows = grown(self.rows, self.slots.capacity)
        if self.row_bias is not None:
            self.row_bias = grown(self.row_bias, self.slots.capacity)
        if src.numel() == 0:
            return
        self.rows[dst] = self.weight.index_select(0, src)
        if self.row_bias is not None:
            self.row_bias[dst] = self.bias.index_select(0, src)
        self.rows_copied += src.numel()

    def repack(self, ids: torch.Tensor) -> None:
        """Pack exactly ``ids`` [n] in the given order, copying every row."""
        self._copy(*self.slots.assign(ids))

    def update(self, ids: torch.Tensor) -> None:
        """Make the packed rows hold exactly the set ``ids`` [n] (order free), copying only changed rows."""
        self._copy(*self.slots.update(ids))

    def logits(self, hidden: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [m, n] over the active set for hidden states [m, d], and the token id of each column [n].

        ``ids=None`` means the full vocabulary (column j is token j).
        """
        if ids is None:
            return self._finish(F.linear(hidden, self.weight, self.bias)), None
        ordered = self._ordered
        if ids is self._last:
            n = ids.numel()  # the same active set as the previous step
        elif (
            ordered is not None
            and ids.data_ptr() == ordered.data_ptr()
            and ids.numel() <= ordered.numel()
        ):
            n = ids.numel()  # a prefix of the ranking packed in order: a slice of the buffer
        elif self.n == 0 or 2 * ids.numel() > self.weight.shape[0]:
            self.repack(ids)
            self._ordered, n = ids, ids.numel()
        else:
            self.update(ids)
            self._ordered, n = None, self.n
        self._last = ids
        bias = None if self.row_bias is None else self.row_bias[:n]
        return self._finish(F.linear(hidden, self.rows[:n], bias)), self.slots.ids[:n]

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        return soft_cap(logits.float(), self.softcap)


class RangeHead:
    """Logits over :class:`RowRanges` of one fixed order: ``W[order]`` is packed once, each range is a slice.

    On CUDA (``fused``) every range is computed in one launch of the fused gathered-rows kernel over the ranges'
    row positions, reading the packed rows in place. Elsewhere each merged range is one matmul over a slice:
    on a CPU (AMD EPYC, bf16, 1 thread, 17.6k rows in 119 ranges) that took 17 ms against 107 ms for one
    ``index_select`` + matmul (the gathered copy costs far more than the calls it saves) and 8 ms for one
    contiguous matmul of as many rows.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, softcap: float | None = None,
        fused: bool | None = None,
    ):
        """``fused``: one gathered-rows kernel launch per step (default: on CUDA when Triton is installed and the
        head has no bias)."""
        self.weight = weight  # [V, d]
        self.bias = bias
        self.softcap = softcap
        self.fused = weight.is_cuda and bias is None and triton_available() if fused is None else fused
        self.order: torch.Tensor | None = None
        self.rows = self.row_bias = None
        self.rows_copied = 0

    def logits(self, hidden: torch.Tensor, ranges: RowRanges) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [m, n] over the ranges' ids for hidden states [m, d], and those ids [n]."""
        if ranges.order is not self.order:
            self.order = ranges.order
            self.rows = self.weight.index_select(0, ranges.order)  # [N, d], once per order
            self.row_bias = None if self.bias is None else self.bias.index_select(0, ranges.order)
            self.rows_copied += ranges.order.numel()
        if self.fused:
            logits = gathered_logits(hidden.contiguous(), self.rows, ranges.positions)  # [m, n] float32, one launch
        else:
            parts = [
                F.linear(hidden, self.rows[a:b], None if self.row_bias is None else self.row_bias[a:b])
                for a, b in zip(ranges.starts, ranges.ends)
            ]
            logits = torch.cat(parts, dim=-1) if parts else hidden.new_empty(hidden.shape[0], 0)
        return soft_cap(logits.float(), self.softcap), ranges.ids


class DraftHead:
    """The draft head over an active set given as None (full), one id tensor, or disjoint segments (id tensors
    or :class:`RowRanges`).

    Each segment position has its own packed rows (:class:`PackedHead`, or :class:`RangeHead` for
    :class:`RowRanges`), so a policy can combine a set that changes every
    cycle (a context window) with nested prefixes of a fixed ranking (a static core that shrinks with the
    draft position) and neither segment copies rows the other one changed.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, softcap: float | None = None):
        self.weight = weight  # [V, d]
        self.bias = bias
        self.softcap = softcap
        self.segments: list[PackedHead | RangeHead] = []  # the packed rows of each segment position

    @property
    def rows_copied(self) -> int:
        """Rows gathered into packed buffers so far (all segments)."""
        return sum(p.rows_copied for p in self.segments)

    def _logits(self, i: int, hidden: torch.Tensor, ids):
        if ids is not None:
            ids_device = ids.order.device if isinstance(ids, RowRanges) else ids.device
            if ids_device != self.weight.device:  # a policy that ignored PolicyContext.device
                raise ValueError(f"active ids on {ids_device}, the draft head on {self.weight.device}")
        kind = RangeHead if isinstance(ids, RowRanges) else PackedHead
        while len(self.segments) <= i:
            self.segments.append(kind(self.weight, self.bias, self.softcap))
        if not isinstance(self.segments[i], kind):  # a policy that changed the kind of a segment
            self.segments[i] = kind(self.weight, self.bias, self.softcap)
        return self.segments[i].logits(hidden, ids)

    def logits(self, hidden: torch.Tensor, active) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [m, n] and the token id of each column [n] (None = the full vocabulary, column j is id j).

        ``hidden`` is cast to the head's dtype (a draft may keep a bfloat16 copy of its head for its steps).
        """
        hidden = hidden.to(self.weight.dtype)
        if active is None or isinstance(active, (torch.Tensor, RowRanges)):
            return self._logits(0, hidden, active)
        parts = [self._logits(i, hidden, ids) for i, ids in enumerate(active) if ids.numel()]
        return torch.cat([p[0] for p in parts], dim=-1), torch.cat([p[1] for p in parts])


def active_segments(active) -> list[torch.Tensor]:
    """The id tensors of an active set that is not None: one per segment (:class:`RowRanges` expanded)."""
    parts = [active] if isinstance(active, (torch.Tensor, RowRanges)) else list(active)
    return [p.ids if isinstance(p, RowRanges) else p for p in parts]


def active_size(active, vocab: int) -> int:
    """Number of ids in an active set (None = the full vocabulary)."""
    if active is None:
        return vocab
    if isinstance(active, (torch.Tensor, RowRanges)):
        return active.numel()
    return sum(ids.numel() for ids in active)


def active_contains(active, token: int) -> bool:
    """Whether ``token`` is in an active set."""
    if active is None:
        return True
    return any(bool((ids == token).any()) for ids in active_segments(active))
