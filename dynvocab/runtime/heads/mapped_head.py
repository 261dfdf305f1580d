"""A draft head over its own vocabulary (EAGLE-3's ``lm_head``), answering in target ids."""

from __future__ import annotations

from collections import OrderedDict

import torch

from dynvocab.runtime.heads.active_set import (
    ActiveSet, Gathered, Prefix, RowRanges, Segment, SegmentKey, merge_ranges,
)
from dynvocab.runtime.heads.head import DraftHead
from dynvocab.runtime.host import to_host, to_host_tensor


class MappedHead:
    """A draft head over its own vocabulary (EAGLE-3's ``lm_head``): row i stands for target id ``row_token[i]``.

    Active sets arrive in target ids, as every policy names them; ids outside the draft vocabulary are dropped
    (an active set with none inside falls back to the whole draft vocabulary). ``None`` is the whole draft
    vocabulary. Columns come back as target ids.

    Segments are mapped by what their key says they are, so the inner :class:`~dynvocab.runtime.heads.head.DraftHead`
    sees the same structure in draft rows: a ranking (or order) is mapped once to the draft rows of its ids that the
    draft vocabulary has, in order, with the count of kept ids before each position; a
    :class:`~dynvocab.runtime.heads.active_set.Prefix` of ``k`` target ids is then the prefix of ``k'`` ids of the
    mapped ranking (one object per ranking: the inner head slices its packed rows), and
    :class:`~dynvocab.runtime.heads.active_set.RowRanges` of an order are ranges of the mapped order (whose rows are
    gathered once). Changed segments (bare id tensors, :class:`~dynvocab.runtime.heads.active_set.Gathered`) are
    mapped at every step.
    """

    KEEP_ORDERS = 8  # mapped rankings and orders kept (least recently used dropped)
    KEEP_SEGMENTS = 64  # mapped prefixes and range selections kept

    def __init__(self, weight, row_token: torch.Tensor, vocab_size: int, softcap: float | None = None):
        """``weight``: the rows [Vd, d], a tensor or a :class:`~dynvocab.models.rows.RowSource` (int8)."""
        self.weight = weight  # [Vd, d]
        self.row_token = row_token  # [Vd] target ids
        self.row_of = torch.full((vocab_size,), -1, dtype=torch.long, device=row_token.device)  # [V] -> row or -1
        self.row_of[row_token] = torch.arange(row_token.numel(), device=row_token.device)
        self.inner = DraftHead(weight, None, softcap)
        self._orders: OrderedDict[SegmentKey, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._segments: OrderedDict[object, Prefix | RowRanges] = OrderedDict()

    @property
    def rows_copied(self) -> int:
        """Rows gathered into packed buffers so far."""
        return self.inner.rows_copied

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The draft rows of target ids ``ids`` [n] that the draft vocabulary has, in order: [n']."""
        rows = self.row_of[ids]
        return rows[rows >= 0]

    def mapped_order(self, key: SegmentKey, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ranking or order ``order`` [N] (named by ``key``) in draft rows: its rows in the draft vocabulary, in
        order [N'], and the count of those before each position, a host LongTensor [N + 1]. Mapped once per order
        (one read of the device for the counts), then kept."""
        key = key.order
        hit = self._orders.get(key)
        if hit is None:
            rows = self.row_of[order]
            kept = rows >= 0
            before = torch.cat([kept.new_zeros(1, dtype=torch.long), kept.cumsum(0)])
            hit = (rows[kept], to_host_tensor(before))
            self._orders[key] = hit
            if len(self._orders) > self.KEEP_ORDERS:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(key)
        return hit

    def _kept(self, memo: object, build) -> Prefix | RowRanges:
        """The mapped segment remembered under ``memo``, built by ``build()`` the first time."""
        hit = self._segments.get(memo)
        if hit is None:
            hit = self._segments[memo] = build()
            if len(self._segments) > self.KEEP_SEGMENTS:
                self._segments.popitem(last=False)
        else:
            self._segments.move_to_end(memo)
        return hit

    def _prefix(self, segment: Prefix) -> Prefix:
        """The prefix of the mapped ranking holding the draft rows of ``segment``'s ids."""

        def build() -> Prefix:
            rows, before = self.mapped_order(segment.key, segment.ranking)
            return Prefix(rows, to_host(before[segment.n]))

        return self._kept(segment.key, build)

    def _ranges(self, segment: RowRanges) -> RowRanges:
        """The ranges of the mapped order holding the draft rows of ``segment``'s ids."""

        def build() -> RowRanges:
            rows, before = self.mapped_order(segment.key, segment.order)
            bounds = to_host(before[list(segment.starts) + list(segment.ends)])  # one read: [starts…, ends…]
            starts, ends = bounds[: len(segment.starts)], bounds[len(segment.starts) :]
            return RowRanges(rows, *merge_ranges(starts, ends))

        return self._kept((segment.key, segment.starts, segment.ends), build)

    def map(self, segment: Segment) -> Segment:
        """``segment`` (target ids) as the segment of the same kind over the draft rows of its ids."""
        if isinstance(segment, Prefix):
            return self._prefix(segment)
        if isinstance(segment, RowRanges):
            return self._ranges(segment)
        if isinstance(segment, Gathered):
            return Gathered(self.rows(segment.ids))
        return self.rows(segment)

    def logits(self, hidden: torch.Tensor, active: ActiveSet) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [m, n] over the active set's draft rows for hidden states [m, d], and their target ids [n]."""
        if not active.is_full:
            mapped = ActiveSet.of(*(self.map(s) for s in active.segments))
            if mapped.size:
                logits, rows = self.inner.logits(hidden, mapped)
                return logits, self.row_token[rows]
        logits, _ = self.inner.logits(hidden, ActiveSet.full(self.weight.shape[0]))
        return logits, self.row_token
