"""The draft's LM head restricted to an active set of rows, kept in a packed, contiguous buffer.

The buffer is updated incrementally: rows of tokens that left the active set are overwritten by rows of
tokens that entered, so a sliding-window policy that changes a few dozen ids per cycle copies a few dozen
rows, not thousands. A policy that returns nested prefixes of one ranking (FR-Spec, position-aware FR) is
packed once in ranking order; each prefix is then a slice of the buffer. A policy whose set is a union of
fixed groups (DynaSpec's clusters) returns :class:`RowRanges`: the rows are packed once in group order and
each step multiplies only the chosen ranges, so a set that changes completely between steps copies nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynvocab.kernels._triton import triton_available
from dynvocab.kernels.gathered_head import gathered_logits
from dynvocab.runtime.slots import SlotTable, grown
from dynvocab.runtime.active_set import ActiveSet, RowRanges, Segment, segment_size


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Final-logit soft-capping ``tanh(x / cap) * cap`` (Gemma-style); ``cap`` None or 0 leaves logits as they are."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap


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

    def logits(self, hidden: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [m, n] over the ids ``ids`` [n] for hidden states [m, d], and the token id of each column [n]."""
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
    """The draft head over an :class:`~dynvocab.runtime.active_set.ActiveSet`: the full vocabulary, or its
    disjoint segments (id tensors or :class:`RowRanges`).

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

    def _logits(self, i: int, hidden: torch.Tensor, segment: Segment):
        if segment.device != self.weight.device:  # a policy that ignored PolicyContext.device
            raise ValueError(f"active ids on {segment.device}, the draft head on {self.weight.device}")
        kind = RangeHead if isinstance(segment, RowRanges) else PackedHead
        while len(self.segments) <= i:
            self.segments.append(kind(self.weight, self.bias, self.softcap))
        if not isinstance(self.segments[i], kind):  # a policy that changed the kind of a segment
            self.segments[i] = kind(self.weight, self.bias, self.softcap)
        return self.segments[i].logits(hidden, segment)

    def logits(self, hidden: torch.Tensor, active: ActiveSet) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [m, n] and the token id of each column [n] (None = the full vocabulary, column j is id j).

        ``hidden`` is cast to the head's dtype (a draft may keep a bfloat16 copy of its head for its steps).
        """
        hidden = hidden.to(self.weight.dtype)
        if active.is_full:
            return soft_cap(F.linear(hidden, self.weight, self.bias).float(), self.softcap), None
        parts = [self._logits(i, hidden, seg) for i, seg in enumerate(active.segments) if segment_size(seg)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            raise ValueError("the active set is empty: a policy must leave the draft at least one id")
        return torch.cat([p[0] for p in parts], dim=-1), torch.cat([p[1] for p in parts])
