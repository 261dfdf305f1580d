"""Per-request windows in fixed memory: for each request a batched host holds, the distinct ids of its last W
tokens, in one [slots, W] tensor the selectors gather rows of (:mod:`.context_select`).

A host brings each request's whole token record (prompt and verified output, as its engine keeps it) once per
engine step; a window is rebuilt only where the record grew, and only from its last W tokens, so its cost does not
grow with the request. A record shorter than the one folded in (a request recomputed, a key reused) rebuilds it.
Requests the host no longer holds give their slots back (:meth:`RequestWindows.keep`).

A window holds its distinct ids first, so a host may hand a step only the columns its batch fills
(:meth:`RequestWindows.width`): a bucket of a few widths, so that the shapes a step sees stay few.
"""

from __future__ import annotations

import numpy as np
import torch

from dynvocab.errors import DynvocabError

MIN_WIDTH = 64  # the narrowest bucket :meth:`RequestWindows.width` gives; the others double up to the window


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
        self._distinct = [0] * slots  # each slot's distinct ids (its columns before the padding)
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
            self._distinct[slot] = 0
            return slot
        distinct = torch.unique(tail).to(row.device)
        row[: distinct.numel()] = distinct
        row[distinct.numel():] = tail[-1]
        self._distinct[slot] = int(distinct.numel())
        return slot

    def width(self, slots) -> int:
        """The columns of ``ids`` that hold every distinct id of the windows in ``slots`` (host ints): the largest
        one's count rounded up to a power of two times :data:`MIN_WIDTH`, at most the window's size. The columns
        past it are padding (repeats of a window's last token), so ``ids[rows, :width]`` is the same set per row."""
        most = max((self._distinct[s] for s in slots), default=0)
        width = MIN_WIDTH
        while width < most:
            width *= 2
        return min(width, self.size)

    def keep(self, alive) -> None:
        """Give back the slots of every request not in ``alive``."""
        for key in [k for k in self._slot if k not in alive]:
            slot = self._slot.pop(key)
            self._free.append(slot)
            self._distinct[slot] = 0
            del self._seen[key]
