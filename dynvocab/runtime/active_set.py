"""The active vocabulary of one draft step: the one type a policy returns, the head computes over, and bench reads.

A set is the full vocabulary, or disjoint segments: id tensors, :class:`RowRanges` (ranges of one fixed id
order: DynaSpec's clusters, the centroid blocks, a ranking's prefix), or :class:`Gathered` (ids chosen anew at
every step, a selector's top-k). Segments are what lets the draft's head reuse packed rows: a policy that returns the
same tensor object for a segment (or a prefix view of a ranking the head packed in order) tells the head that
segment did not change, so it copies nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union

import torch


@dataclass(frozen=True, eq=False)
class RowRanges:
    """An active segment given as ranges of a fixed id order: ``order[starts[i]:ends[i]]`` for every i.

    ``order`` must be the same tensor at every step (the head packs ``W[order]`` once, keyed by it); the ranges
    must not overlap. Sorted, adjacent ranges merged, they cost one matmul each.
    """

    order: torch.Tensor  # [N] token ids, e.g. grouped by cluster
    starts: tuple[int, ...]
    ends: tuple[int, ...]

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


Segment = Union[torch.Tensor, RowRanges, Gathered]


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
        """The union of disjoint ``segments`` (LongTensors [n], :class:`RowRanges` or :class:`Gathered`). A segment
        keeps its position even when empty: the head packs the rows of each position apart."""
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
        """The id tensor of each segment (:class:`RowRanges` expanded); [] for the full vocabulary."""
        return [_segment_ids(s) for s in self.segments]

    def contains(self, token: int) -> bool:
        """Whether ``token`` is in the set (reads the device: not for a step's hot path on a GPU)."""
        if self.is_full:
            return 0 <= token < self.vocab
        return any(bool((ids == token).any()) for ids in self.id_segments())

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
