"""The draft's LM head restricted to an active set of rows, kept in packed, contiguous buffers.

Each segment of an :class:`~dynvocab.runtime.heads.active_set.ActiveSet` says what it is by its
:class:`~dynvocab.runtime.heads.active_set.SegmentKey`, and the heads here decide what they reuse from that key alone.
A
:class:`~dynvocab.runtime.heads.active_set.Prefix` is packed in ranking order once, and each shorter prefix of the
same ranking is a slice of the buffer; a set the policy replaces (a new key) is brought up to date incrementally: rows
of tokens that left are overwritten by rows of tokens that entered, so a sliding-window policy that changes a few
dozen ids per cycle copies a few dozen rows, not thousands. :class:`~dynvocab.runtime.heads.active_set.RowRanges`
(DynaSpec's clusters, the centroid blocks, FR-Spec's prefixes) are rows of a fixed order gathered once and kept on the
row source, and each step multiplies only the chosen ranges, so a set that changes completely between steps copies
nothing.

The rows come from a :class:`~dynvocab.models.rows.RowSource` (float rows, a one-row dtype copy, or int8 rows with
per-row scales), chosen once at load; the heads never ask which one they read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynvocab.kernels._triton import triton_available
from dynvocab.kernels.gathered_head import gathered_logits
from dynvocab.models.rows import ordered_rows, row_source
from dynvocab.runtime.heads.active_set import (
    CHANGED,
    PREFIX,
    ActiveSet,
    Gathered,
    Prefix,
    RowRanges,
    Segment,
    SegmentKey,
    segment_key,
    segment_size,
)
from dynvocab.runtime.heads.slots import SlotTable, grown


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Final-logit soft-capping ``tanh(x / cap) * cap`` (Gemma-style); ``cap`` None or 0 leaves logits as they are."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap


class PackedHead:
    """Computes draft logits over ``ids`` only, reusing a packed copy of ``W[ids]`` across calls.

    Which token sits in which row is a :class:`~dynvocab.runtime.heads.slots.SlotTable`, so an update copies only the
    rows of tokens that entered.
    """

    def __init__(self, weight, bias: torch.Tensor | None = None, softcap: float | None = None):
        """``weight``: the head's rows [V, d] (a tensor, with ``bias``) or a
        :class:`~dynvocab.models.rows.RowSource` (:func:`~dynvocab.models.rows.row_source`)."""
        self.source = row_source(weight, bias)
        self.softcap = softcap
        vocab, dim = self.source.shape
        self.slots = SlotTable(vocab, 0, self.source.device)
        src = self.source
        self.rows = torch.empty(0, dim, dtype=src.row_dtype, device=src.device)  # [cap, d] packed rows
        self.row_bias = torch.empty(0, dtype=src.dtype, device=src.device) if src.bias is not None else None
        self.row_scale: torch.Tensor | None = None  # [cap] per-row scales of int8 rows
        self._key: SegmentKey = CHANGED  # the key of the segment the rows [0, used) hold
        self._used = 0  # rows the last segment multiplied
        self._in_order: SegmentKey | None = None  # a ranking's prefix packed in ranking order (its prefixes slice)
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
        """``rows[dst] = W[src]`` (and the scales and bias), growing the rows to the slot table's capacity first."""
        cap = self.slots.capacity
        self.rows = grown(self.rows, cap)
        if self.row_bias is not None:
            self.row_bias = grown(self.row_bias, cap)
        if self.row_scale is not None:
            self.row_scale = grown(self.row_scale, cap)
        if src.numel() == 0:
            return
        rows, scales, bias = self.source.gather(src)
        self.rows[dst] = rows
        if scales is not None:
            if self.row_scale is None:
                self.row_scale = scales.new_empty(cap)
            self.row_scale[dst] = scales
        if self.row_bias is not None:
            self.row_bias[dst] = bias
        self.rows_copied += src.numel()

    def repack(self, ids: torch.Tensor) -> None:
        """Pack exactly ``ids`` [n] in the given order, copying every row."""
        self._copy(*self.slots.assign(ids))

    def update(self, ids: torch.Tensor) -> None:
        """Make the packed rows hold exactly the set ``ids`` [n] (order free), copying only changed rows."""
        self._copy(*self.slots.update(ids))

    def logits(self, hidden: torch.Tensor, segment: torch.Tensor | Prefix) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [m, n] over the segment's ids (a :class:`~dynvocab.runtime.heads.active_set.Prefix` or a bare id
        tensor [n], a changed set) for hidden states [m, d], and the token id of each column [n]."""
        n = self._bring(segment)
        if self._in_order is not None and self.source.packs_prefixes:  # a ranking's prefix: a kept int8 pack
            out = self.source.prefix_linear(hidden, self._in_order.of, n)
            if out is not None:
                return self._finish(out), self.slots.ids[:n]
        bias = None if self.row_bias is None else self.row_bias[:n]
        scales = None if self.row_scale is None else self.row_scale[:n]
        return self._finish(self.source.matmul(hidden, self.rows[:n], scales, bias)), self.slots.ids[:n]

    def _bring(self, segment: torch.Tensor | Prefix) -> int:
        """Make the rows ``[0, n)`` hold the segment's ids, deciding from its key alone; returns ``n``.

        The same key as the last call: nothing to do. A prefix of the ranking packed in order: a slice when no
        longer, else its next rows appended in order. Otherwise the rows are repacked in the segment's order (the
        buffer is empty, or the set is over half the vocabulary) or updated, copying only the rows that changed.
        """
        key = segment_key(segment)
        if key == self._key:
            return self._used
        ids = segment if isinstance(segment, torch.Tensor) else segment.ids
        n = ids.numel()
        if key.same_order(self._in_order):
            if n > self._in_order.n:
                self.update(ids)  # the packed prefix is live at [0, k): the entering ids fill [k, n) in order
                self._in_order = key
        elif self.n == 0 or 2 * n > self.source.shape[0]:
            self.repack(ids)
            self._in_order = key if key.kind == PREFIX else None
        else:
            self.update(ids)
            self._in_order = None
        self._key, self._used = key, n
        return n

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        return soft_cap(logits.float(), self.softcap)


class RangeHead:
    """Logits over :class:`RowRanges` of one fixed order: ``W[order]`` is packed once (taken from the row source's
    kept orders when the segment's key names another order), each range is a slice.

    On CUDA (``fused``) every range is computed in one launch of the fused gathered-rows kernel over the ranges'
    row positions, reading the packed rows in place. Elsewhere float rows are multiplied one merged range at a
    time over slices: on a CPU (AMD EPYC, bf16, 1 thread, 17.6k rows in 119 ranges) that took 17 ms against 107 ms
    for one ``index_select`` + matmul (the gathered copy costs far more than the calls it saves) and 8 ms for one
    contiguous matmul of as many rows. Int8 rows (a quarter of the bytes) are gathered by position and multiplied
    in one call (4,096 rows in 32 ranges of 128, d = 896, 2 threads: 0.11 ms gathered against 0.16 ms per range);
    a single range is a slice.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, softcap: float | None = None,
        fused: bool | None = None,
    ):
        """``fused``: one gathered-rows kernel launch per step (default: on CUDA when Triton is installed and the
        head has no bias). ``weight``: the rows [V, d] (a tensor, with ``bias``) or a row source."""
        self.source = row_source(weight, bias)
        self.softcap = softcap
        has_bias = self.source.bias is not None
        on_cuda = self.source.device.type == "cuda"
        self.fused = on_cuda and not has_bias and triton_available() if fused is None else fused
        self._key: SegmentKey = CHANGED  # the order whose rows ``rows`` holds
        self.rows = self.row_scale = self.row_bias = None
        self.rows_copied = 0

    def logits(self, hidden: torch.Tensor, ranges: RowRanges) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [m, n] over the ranges' ids for hidden states [m, d], and those ids [n]."""
        if ranges.key != self._key:
            self._key = ranges.key
            (self.rows, self.row_scale, self.row_bias), copied = ordered_rows(self.source, ranges.order)  # [N, d]
            self.rows_copied += ranges.order.numel() if copied else 0
        if self.source.packs_prefixes and ranges.starts == (0,):  # a ranking's prefix: its kept int8 pack
            out = self.source.prefix_linear(hidden, ranges.order, ranges.ends[0])
            if out is not None:
                return soft_cap(out.float(), self.softcap), ranges.ids
        if self.fused:
            logits = gathered_logits(hidden.contiguous(), self.rows, ranges.positions)  # [m, n] float32, one launch
        elif self.row_scale is not None:
            logits = self._int8_logits(hidden, ranges)
        else:
            parts = [
                F.linear(hidden, self.rows[a:b], None if self.row_bias is None else self.row_bias[a:b])
                for a, b in zip(ranges.starts, ranges.ends)
            ]
            logits = torch.cat(parts, dim=-1) if parts else hidden.new_empty(hidden.shape[0], 0)
        return soft_cap(logits.float(), self.softcap), ranges.ids

    def _int8_logits(self, hidden: torch.Tensor, ranges: RowRanges) -> torch.Tensor:
        """Int8 rows of the ranges: a slice for one range, else gathered by position; one product."""
        if len(ranges.starts) == 1:
            part = slice(ranges.starts[0], ranges.ends[0])
            rows, scales = self.rows[part], self.row_scale[part]
            bias = None if self.row_bias is None else self.row_bias[part]
        else:
            pos = ranges.positions
            rows, scales = self.rows.index_select(0, pos), self.row_scale.index_select(0, pos)
            bias = None if self.row_bias is None else self.row_bias.index_select(0, pos)
        return self.source.matmul(hidden, rows, scales, bias)


class GatherHead:
    """Logits over a :class:`~dynvocab.runtime.heads.active_set.Gathered` segment: its rows gathered from the row
    source at each step (int8 rows with their scales where the source keeps them so) and multiplied once."""

    def __init__(self, weight, bias: torch.Tensor | None = None, softcap: float | None = None):
        self.source = row_source(weight, bias)
        self.softcap = softcap
        self.rows_copied = 0

    def logits(self, hidden: torch.Tensor, segment: Gathered) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [m, n] over the segment's ids for hidden states [m, d], and those ids [n]."""
        rows, scales, bias = self.source.gather(segment.ids)
        self.rows_copied += segment.size
        return soft_cap(self.source.matmul(hidden, rows, scales, bias).float(), self.softcap), segment.ids


class DraftHead:
    """The draft head over an :class:`~dynvocab.runtime.heads.active_set.ActiveSet`: the full vocabulary, or its
    disjoint segments.

    Each segment position has its own head: :class:`PackedHead` for a
    :class:`~dynvocab.runtime.heads.active_set.Prefix` or a bare id tensor, :class:`RangeHead` for :class:`RowRanges`,
    :class:`GatherHead` for :class:`Gathered`. So a policy can combine a set that changes every cycle (a context
    window) with nested prefixes of a fixed ranking (a static core that shrinks with the draft position) and
    neither segment copies rows the other one changed; each decides its reuse from its segment's key.
    """

    def __init__(self, weight, bias: torch.Tensor | None = None, softcap: float | None = None):
        """``weight``: the head's rows [V, d] (a tensor, with ``bias``) or a
        :class:`~dynvocab.models.rows.RowSource` (:func:`~dynvocab.models.rows.row_source`); every segment and
        the full head read the same source."""
        self.source = row_source(weight, bias)
        self.softcap = softcap
        self.segments: list[PackedHead | RangeHead | GatherHead] = []  # the packed rows of each segment position

    @property
    def rows_copied(self) -> int:
        """Rows gathered into packed buffers so far (all segments)."""
        return sum(p.rows_copied for p in self.segments)

    def _logits(self, i: int, hidden: torch.Tensor, segment: Segment):
        if segment.device != self.source.device:  # a policy that ignored PolicyContext.device
            raise ValueError(f"active ids on {segment.device}, the draft head on {self.source.device}")
        kind = RangeHead if isinstance(segment, RowRanges) else GatherHead if isinstance(segment, Gathered) else PackedHead
        while len(self.segments) <= i:
            self.segments.append(kind(self.source, None, self.softcap))
        if not isinstance(self.segments[i], kind):  # a policy that changed the kind of a segment
            self.segments[i] = kind(self.source, None, self.softcap)
        return self.segments[i].logits(hidden, segment)

    def logits(self, hidden: torch.Tensor, active: ActiveSet) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [m, n] and the token id of each column [n] (None = the full vocabulary, column j is id j).

        ``hidden`` is cast to the rows' dtype (a draft may keep a bfloat16 copy of its head for its steps; int8
        rows are multiplied from float32).
        """
        hidden = hidden.to(self.source.dtype)
        if active.is_full:
            return soft_cap(self.source.linear(hidden).float(), self.softcap), None
        parts = [self._logits(i, hidden, seg) for i, seg in enumerate(active.segments) if segment_size(seg)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            raise ValueError("the active set is empty: a policy must leave the draft at least one id")
        return torch.cat([p[0] for p in parts], dim=-1), torch.cat([p[1] for p in parts])
