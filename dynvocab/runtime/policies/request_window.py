"""Per-request windows in fixed memory: for each request a batched host holds, the distinct ids of its last W
tokens, in one [slots, W] tensor the selectors gather rows of (:mod:`.context_select`).

A host brings each request's whole token record (prompt and verified output, as its engine keeps it) once per
engine step; a window is rebuilt only where the record grew, and only from its last W tokens, so its cost does not
grow with the request. A record shorter than the one folded in (a request recomputed, a key reused) rebuilds it.
Requests the host no longer holds give their slots back (:meth:`RequestWindows.keep`).
"""

from __future__ import annotations

import numpy as np
import torch

from dynvocab.errors import DynvocabError


class RequestWindows:
    """``slots`` windows of ``size`` tokens; ``ids`` [slots, size] holds each request's distinct ids, padded by
    repeating its last token (a slot with no tokens holds ``fill``)."""

    def __init__(self, slots: int, size: int, vocab_size: int, fill: int = 0, device: torch.device | str = "cpu"):
        if slots < 1 or size < 1:
            raise DynvocabError(f"request windows need at least 1 slot of 1 token (got {slots} × {size})")
        self.size, self.vocab_size, self.fill = size, vocab_size, fill
        self.ids = torch.full((slots, size), fill, dtype=torch.long, device=device)  # [slots, size]
        self._slot: dict[object, int] = {}  # request key -> its slot
        self._seen: dict[object, int] = {}  # request key -> tokens of its record folded in
        self._free = list(range(slots - 1, -1, -1))

    def __len__(self) -> int:
        """Requests that hold a slot."""
        return len(self._slot)

    def keys(self) -> set:
        """The requests that hold a slot."""
        return set(self._slot)

    def update(self, key, record: np.ndarray | torch.Tensor) -> int:
        """Fold request ``key``'s whole token record [n] in (only where it changed) and return its slot."""
        n = int(record.shape[0])
        slot = self._slot.get(key)
        if slot is None:
            if not self._free:
                raise DynvocabError(f"request windows are full ({self.ids.shape[0]} requests); free finished ones")
            slot = self._free.pop()
            self._slot[key] = slot
        elif self._seen[key] == n:
            return slot
        self._seen[key] = n
        tail = torch.as_tensor(np.asarray(record[max(0, n - self.size):n]), dtype=torch.long)
        tail = tail[(tail >= 0) & (tail < self.vocab_size)]
        row = self.ids[slot]
        if tail.numel() == 0:
            row.fill_(self.fill)
            return slot
        distinct = torch.unique(tail).to(row.device)
        row[: distinct.numel()] = distinct
        row[distinct.numel():] = tail[-1]
        return slot

    def keep(self, alive) -> None:
        """Give back the slots of every request not in ``alive``."""
        for key in [k for k in self._slot if k not in alive]:
            self._free.append(self._slot.pop(key))
            del self._seen[key]
