"""The active vocabulary of one draft step: the one type a policy returns, the head computes over, and bench reads.

A set is the full vocabulary, or disjoint segments. Each segment says what it is by its :class:`SegmentKey`, and the
heads decide what they may reuse from that key alone:

- :class:`Prefix` ``(ranking, n)``: the first ``n`` ids of a ranking the policy keeps (key: the ranking object and
  ``n``). A head packs the ranking's prefix in order once; a shorter prefix of it is a slice, the same key copies
  nothing. A set a policy keeps until it replaces it (a context window) is a prefix of itself
  (:meth:`Prefix.whole`); a new set is a new tensor, so a new key, and the head copies only the rows that changed.
- :class:`RowRanges` ``(order, starts, ends)``: ranges of a fixed id order (key: the order object): DynaSpec's
  clusters, the centroid blocks, a ranking's prefix as one range from 0. The rows of the order are gathered once and
  kept on the row source; each step multiplies only the ranges.
- :class:`Gathered` and a bare id tensor: changed (key :data:`CHANGED`, which equals no key). A selector's top-k is
  gathered anew each step; a bare tensor's rows are brought up to date incrementally (only changed rows copied).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union

import torch

from dynvocab.runtime.host import to_host

PREFIX, RANGES, CHANGED_KIND = "prefix", "ranges", "changed"


@dataclass(frozen=True, eq=False)
class SegmentKey:
    """What a segment is, as a head reads it to decide which of its packed rows it may reuse.

    ``kind``: :data:`PREFIX` (the first ``n`` ids of the ranking ``of``), :data:`RANGES` (ranges of the fixed order
    ``of``) or :data:`CHANGED_KIND` (nothing to reuse). ``of`` is an object the policy keeps unchanged while it
    names it (the ranking or order tensor itself); keys compare it by identity, never by value, so comparing keys
    reads no device. A changed key equals no key, itself included.
    """

    kind: str
    of: object = None
    n: int = 0

    @classmethod
    def prefix(cls, ranking: object, n: int) -> "SegmentKey":
        """The first ``n`` ids of ``ranking``."""
        return cls(PREFIX, ranking, n)

    @classmethod
    def ranges(cls, order: object) -> "SegmentKey":
        """Ranges of the fixed ``order`` (which ranges is the segment's, not the key's)."""
        return cls(RANGES, order)

    @property
    def order(self) -> "SegmentKey":
        """The key of the whole ranking or order this key names a part of (for caches kept per ranking)."""
        return self if self.n == 0 else SegmentKey(self.kind, self.of)

    def same_order(self, other: "SegmentKey | None") -> bool:
        """Whether ``other`` names a part of the same ranking or order (any prefix length)."""
        return other is not None and self.kind != CHANGED_KIND and self.kind == other.kind and self.of is other.of

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SegmentKey) and self.same_order(other) and self.n == other.n

    def __hash__(self) -> int:
        return hash((self.kind, id(self.of), self.n))


CHANGED = SegmentKey(CHANGED_KIND)  # a segment with nothing to reuse: a bare id tensor, a :class:`Gathered` one


@dataclass(frozen=True, eq=False)
class Prefix:
    """An active segment given as the first ``n`` ids of ``ranking`` [K], a LongTensor the policy keeps unchanged for
    as long as it names prefixes of it (a new ranking is a new tensor). Key: the ranking object and ``n``."""

    ranking: torch.Tensor  # [K] token ids
    n: int

    def __post_init__(self):
        if not 0 <= self.n <= self.ranking.numel():
            raise ValueError(f"a prefix of {self.n} ids of a ranking of {self.ranking.numel()}")

    @classmethod
    def whole(cls, ids: torch.Tensor) -> "Prefix":
        """A set the policy keeps until it replaces it by a new tensor: the whole of ``ids`` [n]."""
        return cls(ids, ids.numel())

    @functools.cached_property
    def key(self) -> SegmentKey:
        """:meth:`SegmentKey.prefix` of the ranking."""
        return SegmentKey.prefix(self.ranking, self.n)

    @functools.cached_property
    def ids(self) -> torch.Tensor:
        """The token ids, LongTensor [n]: the ranking itself when whole, else a view of it (no copy)."""
        return self.ranking if self.n == self.ranking.numel() else self.ranking[: self.n]

    @property
    def size(self) -> int:
        """Number of ids in the segment."""
        return self.n

    @property
    def device(self) -> torch.device:
        """Where the ids live."""
        return self.ranking.device


@dataclass(frozen=True, eq=False)
class RowRanges:
    """An active segment given as ranges of a fixed id order: ``order[starts[i]:ends[i]]`` for every i.

    ``order`` must be the same tensor at every step (the head packs ``W[order]`` once, keyed by it: the key is
    :meth:`SegmentKey.ranges` of it); the ranges must not overlap. Sorted, adjacent ranges merged, they cost one
    matmul each. A ranking's prefix is one range from 0.
    """

    order: torch.Tensor  # [N] token ids, e.g. grouped by cluster
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    @functools.cached_property
    def key(self) -> SegmentKey:
        """:meth:`SegmentKey.ranges` of the order."""
        return SegmentKey.ranges(self.order)

    @functools.cached_property
    def ids(self) -> torch.Tensor:
        """The token ids of the segment, LongTensor [n], in range order."""
        if not self.starts:
            return self.order[:0]
        return torch.cat([self.order[a:b] for a, b in zip(self.starts, self.ends)])

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """Rows of ``W[order]`` the ranges cover, LongTensor [n] on ``order``'s device (built from the host's
        ranges in a few vector ops: a copy to the device, no read back)."""
        starts = torch.tensor(self.starts, dtype=torch.long)
        lengths = torch.tensor(self.ends, dtype=torch.long) - starts
        offsets = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths)  # [n] start - done
        idx = offsets + torch.arange(offsets.numel())
        return idx.to(self.order.device, non_blocking=True)

    @functools.cached_property
    def size(self) -> int:
        """Number of ids in the segment."""
        return sum(b - a for a, b in zip(self.starts, self.ends))

    @property
    def device(self) -> torch.device:
        """Where the ids live."""
        return self.order.device


@dataclass(frozen=True, eq=False)
class Gathered:
    """An active segment chosen anew at every step (a selector's top-k ids): the head gathers its rows straight from
    the head's rows each step, with no packed buffer to keep up to date (the packed head's slot table costs more
    than the gather when most ids change: 16,384 of 151,936 int8 rows, d 896)."""

    ids: torch.Tensor  # [n] token ids

    key = CHANGED  # nothing to reuse

    @property
    def size(self) -> int:
        """Number of ids in the segment."""
        return self.ids.numel()

    @property
    def device(self) -> torch.device:
        """Where the ids live."""
        return self.ids.device


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


Segment = Union[torch.Tensor, Prefix, RowRanges, Gathered]


def segment_key(segment: Segment) -> SegmentKey:
    """What ``segment`` is, for a head's reuse: its :class:`SegmentKey`; a bare id tensor is :data:`CHANGED`."""
    return CHANGED if isinstance(segment, torch.Tensor) else segment.key


def _segment_ids(segment: Segment) -> torch.Tensor:
    return segment if isinstance(segment, torch.Tensor) else segment.ids


def segment_size(segment: Segment) -> int:
    """Number of ids in one segment."""
    return segment.numel() if isinstance(segment, torch.Tensor) else segment.size


class ActiveSet:
    """Token ids the draft may propose at one draft step (target ids): all ``vocab`` ids, or disjoint segments.

    Build with :meth:`full` or :meth:`of`. The segments must not share ids (each
    policy keeps them disjoint); nothing checks that on the hot path.
    """

    __slots__ = ("segments", "vocab", "_size")

    def __init__(self, segments: tuple[Segment, ...], vocab: int | None):
        self.segments = segments  # () for the full vocabulary
        self.vocab = vocab  # set for the full vocabulary only
        self._size: int | None = None

    @classmethod
    def full(cls, vocab: int) -> "ActiveSet":
        """The whole vocabulary of ``vocab`` ids."""
        return cls((), vocab)

    @classmethod
    def of(cls, *segments: Segment) -> "ActiveSet":
        """The union of disjoint ``segments`` (:class:`Prefix`, :class:`RowRanges`, :class:`Gathered`, or bare
        LongTensors [n], which are changed sets). A segment keeps its position even when empty: the head packs the
        rows of each position apart."""
        return cls(segments, None)

    @property
    def is_full(self) -> bool:
        """Whether this is the whole vocabulary."""
        return self.vocab is not None

    @property
    def device(self) -> torch.device | None:
        """Where the ids live (None for the full vocabulary, which lists none)."""
        return self.segments[0].device if self.segments else None

    @property
    def size(self) -> int:
        """Number of ids in the set."""
        if self._size is None:
            self._size = self.vocab if self.is_full else sum(segment_size(s) for s in self.segments)
        return self._size

    def ids(self) -> torch.Tensor:
        """All ids of a set that is not full, LongTensor [n], segment after segment."""
        if self.is_full:
            raise ValueError("the full vocabulary has no id list; ask is_full first")
        parts = [_segment_ids(s) for s in self.segments]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def id_segments(self) -> list[torch.Tensor]:
        """The id tensor of each segment (:class:`Prefix` and :class:`RowRanges` expanded); [] for the full
        vocabulary."""
        return [_segment_ids(s) for s in self.segments]

    def contains(self, token: int) -> bool:
        """Whether ``token`` is in the set (one host read: not for a step's hot path on a GPU)."""
        if self.is_full:
            return 0 <= token < self.vocab
        hits = [(ids == token).any() for ids in self.id_segments()]
        return bool(hits) and to_host(torch.stack(hits).any())

    def mask(self, width: int, device: torch.device | str | None = None) -> torch.Tensor:
        """BoolTensor [width]: True at the set's ids (ids at or beyond ``width`` are left out)."""
        device = device or self.device or "cpu"
        out = torch.zeros(width, dtype=torch.bool, device=device)
        if self.is_full:
            out[: min(self.vocab, width)] = True
            return out
        for ids in self.id_segments():
            out[ids[ids < width].to(device)] = True
        return out

    def __repr__(self) -> str:
        return f"ActiveSet(full, {self.vocab})" if self.is_full else f"ActiveSet({len(self.segments)} segments, {self.size} ids)"


@dataclass(frozen=True, eq=False)
class NodeSets:
    """Each node of a tree depth its own set, scored in one head call: ``active`` the union of the nodes' sets (the
    rows the head multiplies) and ``own`` [B, n] whether each of its n ids (in the head's column order) is in each
    node's set. A node's logits outside its own set are ``-inf``, so its log-probabilities are normalised over its own
    set, as one row alone would be."""

    active: ActiveSet
    own: torch.Tensor

    @classmethod
    def of(cls, ids: torch.Tensor) -> "NodeSets":
        """The sets of rows ``ids`` [B, k] (an id may repeat within a row): their distinct ids gathered once."""
        union, where = torch.unique(ids, return_inverse=True)  # [U], [B, k]
        own = torch.zeros(ids.shape[0], union.numel(), dtype=torch.bool, device=ids.device)
        return cls(ActiveSet.of(Gathered(union)), own.scatter_(1, where, True))

    def mask(self, logits: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """``logits`` [B, m] of a head over ``active`` whose columns hold the target ids ``cols`` [m] (every id of
        ``active`` in order, or those a mapped head's own vocabulary has), ``-inf`` outside each row's own set. A row
        none of whose own ids the head has keeps the whole union (a draft over other ids stays exact: the target
        verifies it)."""
        ids = self.active.ids()  # [n] the order ``own`` follows
        order = torch.argsort(ids)
        at = order[torch.searchsorted(ids[order], cols)]  # [m] each column's place in ``ids``
        own = self.own[:, at]
        own |= ~own.any(dim=1, keepdim=True)
        return logits.masked_fill(~own, float("-inf"))
