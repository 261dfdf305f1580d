"""A draft head over its own vocabulary (EAGLE-3's ``lm_head``), answering in target ids."""

from __future__ import annotations

from collections import OrderedDict

import torch

from dynvocab.runtime.active_set import ActiveSet
from dynvocab.runtime.head import DraftHead


class MappedHead:
    """A draft head over its own vocabulary (EAGLE-3's ``lm_head``): row i stands for target id ``row_token[i]``.

    Active sets arrive in target ids, as every policy names them; ids outside the draft vocabulary are dropped
    (an active set with none inside falls back to the whole draft vocabulary). ``None`` is the whole draft
    vocabulary. Columns come back as target ids. The mapped rows of a set are remembered by its memory (as
    :class:`~dynvocab.runtime.head.PackedHead` recognises a set or a prefix of a ranking), so the packed rows
    behind an unchanged set are reused as they are for a draft model.
    """

    def __init__(self, weight, row_token: torch.Tensor, vocab_size: int, softcap: float | None = None):
        """``weight``: the rows [Vd, d], a tensor or a row source (int8, :mod:`dynvocab.runtime.head`)."""
        self.weight = weight  # [Vd, d]
        self.row_token = row_token  # [Vd] target ids
        self.row_of = torch.full((vocab_size,), -1, dtype=torch.long, device=row_token.device)  # [V] -> row or -1
        self.row_of[row_token] = torch.arange(row_token.numel(), device=row_token.device)
        self.inner = DraftHead(weight, None, softcap)
        self._memo: OrderedDict = OrderedDict()

    @property
    def rows_copied(self) -> int:
        """Rows gathered into packed buffers so far."""
        return self.inner.rows_copied

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The draft rows of target ids ``ids`` [n] that the draft vocabulary has, in order: [n']."""
        key = (ids.data_ptr(), ids.numel())  # a set is never changed in place (the packed head trusts it too)
        hit = self._memo.get(key)
        if hit is not None:
            return hit[1]
        rows = self.row_of[ids]
        rows = rows[rows >= 0]
        self._memo[key] = (ids, rows)  # holding ``ids`` keeps its memory from being reused under the same key
        if len(self._memo) > 16:
            self._memo.popitem(last=False)
        return rows

    def logits(self, hidden: torch.Tensor, active: ActiveSet) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [m, n] over the active set's draft rows for hidden states [m, d], and their target ids [n]."""
        if not active.is_full:
            parts = [self.rows(ids) for ids in active.id_segments()]
            if any(p.numel() for p in parts):
                logits, rows = self.inner.logits(hidden, ActiveSet.of(*parts))
                return logits, self.row_token[rows]
        logits, _ = self.inner.logits(hidden, ActiveSet.full(self.weight.shape[0]))
        return logits, self.row_token
