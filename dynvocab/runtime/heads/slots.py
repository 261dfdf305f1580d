"""Which token sits in which row of a packed draft head (:class:`~dynvocab.runtime.heads.head.PackedHead`).

Slots freed by tokens that left are reused by tokens that entered, new slots are appended when more enter than
leave, and when the set shrinks live rows past the new end move into the holes below it, so the active rows are
always ``[0, n)``. Each update yields a list of copies ``rows[dst] = W[src]``, and only rows that changed are
copied. Planning reads three counts (slots freed, tokens entering, holes to fill) in one host read per
update; the index lists are then taken with ``nonzero_static`` at those sizes, which needs no further wait.
"""

from __future__ import annotations

import torch

from dynvocab.runtime.host import to_host


def grown(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """``t`` [cap, ...] itself when it has ``capacity`` rows, else a larger copy keeping its rows (a buffer's growth)."""
    if t.shape[0] >= capacity:
        return t
    out = t.new_empty(capacity, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


class SlotTable:
    """Token ↔ slot bookkeeping of a packed head; live slots are always ``[0, n)``."""

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
        entering = self.slot_of[ids] < 0  # [n'] tokens that enter
        return self._apply(leaving, ids, entering)

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

    def _apply(
        self, leaving: torch.Tensor, ids: torch.Tensor, entering: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``leaving`` [n]: which live slots lose their token; ``entering`` [n']: which of ``ids`` are added."""
        n_old = self.n
        stale_n, fresh_n, low_n = _counts(leaving, entering, n_old)
        stale = torch.nonzero_static(leaving, size=stale_n).flatten()  # [s] freed slots, ascending
        fresh = ids[torch.nonzero_static(entering, size=fresh_n).flatten()]  # [f] tokens that entered
        self.slot_of[self.ids[stale]] = -1
        n_new = n_old - stale_n + fresh_n
        self._reserve(n_new)
        if fresh_n >= stale_n:
            tail = torch.arange(n_old, n_new, device=stale.device)
            dst, src = torch.cat([stale, tail]), fresh
        else:
            holes = stale[fresh_n:]  # ascending: the first ``low_n`` lie below the new end
            self.ids[holes] = -1
            # Keep the rows compact: live rows past the new end move into the holes below it.
            tail = torch.arange(n_new, n_old, device=stale.device)
            movers = tail[torch.nonzero_static(self.ids[tail] >= 0, size=low_n).flatten()]
            moved = self.ids[movers]
            self.ids[movers] = -1
            dst = torch.cat([stale[:fresh_n], holes[:low_n]])
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


def _counts(leaving: torch.Tensor, entering: torch.Tensor, n_old: int) -> tuple[int, int, int]:
    """One host read: slots freed ``s``, tokens entering ``f`` and, when the set shrinks, the holes left below the
    new end ``n_old - s + f`` (the freed slots past the ``f`` lowest, which the entering tokens reuse)."""
    stale, fresh = leaving.sum(), entering.sum()
    freed_below = torch.cat([leaving.new_zeros(1, dtype=torch.long), leaving.long().cumsum(0)])  # [n + 1]
    n_new = (n_old - stale + fresh).clamp(0, n_old)
    low = (freed_below.index_select(0, n_new.view(1))[0] - fresh).clamp(min=0)
    s, f, m = to_host(torch.stack([stale, fresh, low]))
    return s, f, m
