"""Per-request windows in fixed memory: for each request a batched host holds, the distinct ids of its last W
tokens, in one [slots, W] tensor the selectors gather rows of (:mod:`.context_select`).

A host brings each request's whole token record (prompt and verified output, as its engine keeps it) once per
engine step; a window is rebuilt only where the record grew, and only from its last W tokens, so its cost does not
grow with the request. A record shorter than the one folded in (a request recomputed, a key reused) rebuilds it.
A step's records come as one batch (:meth:`RequestWindows.update_many`: the engine's token rows and their lengths),
and its changed windows are rebuilt together: their last W tokens gathered into one array, each row sorted, its
first occurrences packed first, the rest padded.
Requests the host no longer holds give their slots back (:meth:`RequestWindows.keep`).

A window holds its distinct ids first, so a host may hand a step only the columns its batch fills
(:meth:`RequestWindows.width`): a bucket of a few widths, so that the shapes a step sees stay few.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        record = np.asarray(record)
        return self.update_many([key], record[None], [record.shape[0]])[0]

    def update_many(self, keys: Sequence, tokens: np.ndarray | torch.Tensor, counts) -> list[int]:
        """Fold in the token record of each request ``keys[i]``, the first ``counts[i]`` entries of ``tokens[i]``,
        and return their slots: the same as :meth:`update` for each key in order, but the windows whose records
        changed are rebuilt together (:meth:`_rebuild`), the others left alone.

        ``tokens`` [R, L] host ints with a row for each key (R >= len(keys); in vLLM ``input_batch.token_ids_cpu``),
        ``counts`` [>= len(keys)] host ints (``input_batch.num_tokens_no_spec``)."""
        counts = np.asarray(counts)[: len(keys)].tolist()
        if len(counts) < len(keys):
            raise DynvocabError(f"request windows got {len(keys)} requests but {len(counts)} record lengths")
        slots: list[int] = []
        changed: dict[int, tuple[int, int]] = {}  # slot -> (row of tokens, record length) it is rebuilt from
        try:
            for row, (key, n) in enumerate(zip(keys, counts)):
                slot = self._slot.get(key)
                if slot is None:
                    if not self._free:
                        raise DynvocabError(
                            f"request windows are full ({self.ids.shape[0]} requests); free finished ones")
                    slot = self._free.pop()
                    self._slot[key] = slot
                elif self._seen[key] == n:
                    slots.append(slot)
                    continue
                self._seen[key] = n
                changed[slot] = (row, n)
                slots.append(slot)
        finally:  # the keys folded in before a full table refused one hold their windows, as with update
            if changed:
                self._rebuild(np.asarray(tokens), changed)
        return slots

    def _rebuild(self, tokens: np.ndarray, changed: dict[int, tuple[int, int]]) -> None:
        """Rebuild each window ``slot`` of ``changed`` from its record, the first ``n`` of ``tokens[row]``, all at
        once (:meth:`_windows`): one write of the rows, one read of their distinct counts."""
        slots = list(changed)
        rows, ends = (np.array(x, dtype=np.int64) for x in zip(*changed.values()))
        out, distinct = self._windows(tokens, rows, ends)
        device = self.ids.device
        self.ids[torch.tensor(slots, device=device)] = torch.from_numpy(out).to(device)
        for slot, count in zip(slots, distinct.tolist()):
            self._distinct[slot] = count

    def _windows(self, tokens: np.ndarray, rows: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The windows [m, size] of the records ``tokens[rows[i], :ends[i]]`` and their distinct counts [m]: the last
        ``size`` tokens gathered [m, w] (w the window, or the longest record if shorter), those before the record's
        start or outside the vocabulary sorted past every id, each row sorted, its first occurrences packed to its
        front in order, and the rest padded with the record's last valid token (``fill`` where it has none). On the
        host in numpy: its row sort of a few thousand ints was ~9x faster than torch's (0.06 against 0.5 ms, 8 rows
        of 3,000)."""
        width = min(self.size, int(ends.max()))
        if width == 0:  # every record empty
            return np.full((len(rows), self.size), self.fill, dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
        at = ends[:, None] - width + np.arange(width)  # [m, w] the positions of each record's last w tokens
        tail = tokens[rows[:, None], np.maximum(at, 0)]
        if tail.dtype != np.int32:  # vLLM's int32 as it is (a faster sort), any other as int64
            tail = tail.astype(np.int64)
        valid = (at >= 0) & (tail >= 0) & (tail < self.vocab_size)
        keyed = np.sort(np.where(valid, tail, self.vocab_size), axis=1)  # the invalid ones last
        first = keyed < self.vocab_size
        first[:, 1:] &= keyed[:, 1:] != keyed[:, :-1]
        distinct = first.sum(axis=1)
        last = width - 1 - valid[:, ::-1].argmax(axis=1)  # each record's last valid token (where it has one)
        pad = np.where(valid.any(axis=1), tail[np.arange(len(rows)), last], self.fill)
        out = np.repeat(pad.astype(np.int64)[:, None], self.size, axis=1)
        out[np.arange(self.size) < distinct[:, None]] = keyed[first]  # row-major: each row's distinct ids first
        return out, distinct

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
