"""An Adaptive Replacement Cache (ARC, Megiddo & Modha 2003) over token ids: EvoSpec's dynamic buffer.

Two resident lists — T1 (seen once recently) and T2 (seen at least twice) — share ``capacity`` slots; two
ghost lists B1 and B2 remember ids recently evicted from T1 and T2 (ids only, no slot). The target size
``p`` of T1 adapts: a request that hits B1 says T1 was too small (p grows), a hit in B2 says T2 was too
small (p shrinks). Every list is an ``OrderedDict`` in LRU → MRU order.

EvoSpec's changes to textbook ARC (paper appendix A.3, Table 5), all configurable:

- the ghost lists have their own capacities (256 each) instead of sharing a directory of 2·capacity;
- a resident id is evictable only after ``min_residency`` clock ticks (the EvoSpec policy ticks once per
  draft-verify cycle, so "8 decoding steps" means 8 cycles). When the preferred list has no id old enough
  the other list is tried; when neither has one, the new id is not admitted (the budget is strict);
- ``p`` stays fixed during the first ``warmup_events`` admission events;
- one event (:meth:`ARCCache.admit`) inserts at most ``max_new`` ids not already resident; ids already
  resident count as hits (T1 → T2 promotion, or MRU in T2) and do not use up the cap.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable


@dataclass
class ARCStats:
    """Counters of what the cache did (for metrics and tests)."""

    events: int = 0  # admit() calls
    requests: int = 0  # ids looked up by admit() and touch()
    hits: int = 0  # requests that found the id resident
    admitted: int = 0  # ids that became resident (misses and ghost hits)
    ghost_hits_b1: int = 0
    ghost_hits_b2: int = 0
    evicted: int = 0
    blocked: int = 0  # admissions refused: every resident id was younger than min_residency


class ARCCache:
    """ARC over integer keys with EvoSpec's minimum residency, warm-up and per-event insertion cap."""

    def __init__(
        self,
        capacity: int = 256,
        ghost_capacity: int = 256,
        p_init: float = 128,
        min_residency: int = 8,
        warmup_events: int = 50,
    ):
        if capacity < 1:
            raise ValueError("ARC capacity must be at least 1")
        self.capacity = capacity
        self.ghost_capacity = ghost_capacity
        self.p = float(min(max(p_init, 0), capacity))
        self.min_residency = min_residency
        self.warmup_events = warmup_events
        self.t1: OrderedDict[int, int] = OrderedDict()  # id -> clock tick at admission
        self.t2: OrderedDict[int, int] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.now = 0  # the residency clock
        self.version = 0  # bumped whenever the resident set changes (membership, not order)
        self.stats = ARCStats()

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, token: int) -> bool:
        return token in self.t1 or token in self.t2

    def resident(self) -> list[int]:
        """Resident ids: T1 then T2, each LRU first."""
        return [*self.t1, *self.t2]

    def tick(self, n: int = 1) -> None:
        """Advance the residency clock."""
        self.now += n

    @property
    def adapting(self) -> bool:
        """Whether ghost hits move ``p`` now (false during the warm-up events)."""
        return self.stats.events > self.warmup_events

    def touch(self, token: int) -> bool:
        """A use of ``token``: if resident it is a hit (T1 → T2, or MRU of T2). Never admits. Returns residency."""
        self.stats.requests += 1
        return self._hit(token)

    def admit(self, tokens: Iterable[int], max_new: int | None = None) -> list[int]:
        """One admission event: request ``tokens`` in order (duplicates dropped) until ``max_new`` ids were newly
        admitted. Returns the newly admitted ids."""
        self.stats.events += 1
        admitted: list[int] = []
        seen: set[int] = set()
        for token in tokens:
            if max_new is not None and len(admitted) >= max_new:
                break
            token = int(token)
            if token in seen:
                continue
            seen.add(token)
            self.stats.requests += 1
            if self._hit(token):
                continue
            if self._miss(token):
                admitted.append(token)
        return admitted

    def _hit(self, token: int) -> bool:
        if token in self.t1:
            self.t2[token] = self.t1.pop(token)  # second hit: recent -> frequent, keeping its admission tick
        elif token in self.t2:
            self.t2.move_to_end(token)
        else:
            return False
        self.stats.hits += 1
        return True

    def _miss(self, token: int) -> bool:
        """Admit a non-resident id (cases II–IV of ARC). False when no slot could be freed."""
        in_b1, in_b2 = token in self.b1, token in self.b2
        if in_b1 and self.adapting:
            self.p = min(float(self.capacity), self.p + max(1.0, len(self.b2) / len(self.b1)))
        elif in_b2 and self.adapting:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
        ghost = self.b1 if in_b1 else self.b2 if in_b2 else None
        if ghost is not None:
            ghost.pop(token)  # out of its ghost list first, so the eviction below cannot trim it away
        if len(self) >= self.capacity and not self._replace(in_b2):
            if ghost is not None:
                ghost[token] = None  # not admitted: it stays a ghost
            self.stats.blocked += 1
            return False
        if ghost is not None:
            self.stats.ghost_hits_b1 += in_b1
            self.stats.ghost_hits_b2 += in_b2
            self.t2[token] = self.now  # seen before: straight into the frequent list
        else:
            self.t1[token] = self.now
        self.stats.admitted += 1
        self.version += 1
        return True

    def _replace(self, in_b2: bool) -> bool:
        """Evict one resident id old enough: from T1 if |T1| > p (or = p on a B2 hit), else from T2."""
        from_t1 = bool(self.t1) and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p))
        order = ((self.t1, self.b1), (self.t2, self.b2)) if from_t1 else ((self.t2, self.b2), (self.t1, self.b1))
        for lst, ghost in order:
            victim = next((t for t, since in lst.items() if self.now - since >= self.min_residency), None)
            if victim is not None:
                del lst[victim]
                ghost[victim] = None
                while len(ghost) > self.ghost_capacity:
                    ghost.popitem(last=False)
                self.stats.evicted += 1
                self.version += 1
                return True
        return False
