"""The draft interface: what the speculative loop asks of a draft, whichever kind runs behind it.

Two kinds implement it: an independent draft model (:class:`~dynvocab.runtime.lm.CausalLM`) and an EAGLE head
(:class:`~dynvocab.runtime.eagle_draft.EagleDraft`), which also reads the target's features. The loop never asks
which one it runs (as vLLM's engine never asks which proposer it drives).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from dynvocab.runtime.active_set import ActiveSet
from dynvocab.runtime.rows import prepare_order, row_source


class Draft(Protocol):
    """A proposer with a KV cache that rolls back and a head it owns. ``length``: committed and drafted tokens it
    has consumed. Whatever a policy, the loop or bench needs to know about a draft, the draft answers here."""

    length: int
    device: torch.device

    @property
    def vocab_size(self) -> int:
        """How many target ids a vocabulary policy may name (active sets are target ids)."""

    @property
    def hidden_size(self) -> int:
        """Width of the hidden state ``step`` returns: what the head and the policies read."""

    @property
    def embedding(self) -> torch.Tensor:
        """The draft's input embeddings by token id, [V, d_e] (DynaSpec's router reads them)."""

    @property
    def shares_target_head(self) -> bool:
        """Whether the head is the target's own LM head (EAGLE-1): its HNSW index is then the target's."""

    @property
    def index_rows(self) -> torch.Tensor | None:
        """The head rows a bundle's ``draft_hnsw`` stage indexes, [V, d] (a draft model's head), or None."""

    @property
    def adaptable(self) -> torch.nn.Module | None:
        """The transformers model whose attention projections online LoRA alignment may adapt; None where
        alignment does not apply."""

    @property
    def hf_model(self) -> torch.nn.Module | None:
        """The transformers model that transformers' own assisted generation can drive, or None."""

    @property
    def label(self) -> str:
        """What the draft is, for people (reports, tables)."""

    @property
    def rows_copied(self) -> int:
        """Head rows gathered into packed buffers since ``reset``."""

    def reset(self) -> None:
        """Forget the sequence (and the head's packed rows); the next ``step`` starts a new one."""

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Consume tokens ``ids`` [n] (continuing at ``length``); returns the head's inputs [n', d]."""

    def head_logits(self, hidden: torch.Tensor, active: ActiveSet) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's logits [m, n] (float32) over the ``active`` ids for head inputs ``hidden`` [m, d], and the
        target id of each column [n] (None when the columns are all target ids in order)."""

    def prepare_rows(self, order: torch.Tensor, prefixes: Sequence[int] = ()) -> None:
        """Pack the head's rows of a policy's fixed id ``order`` (and its ``prefixes``) now, when the policy is
        built, not at its first draft step; kept across sequences."""

    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens (a draft may keep fewer; ``length`` says how many
        it kept, and the loop feeds the rest again)."""

    def observe(self, start: int, hidden: torch.Tensor | None, rows: Sequence[int] | None) -> None:
        """The target just ran a pass; its ``rows`` (None: all) hold the committed tokens at positions ``start``,
        ``start + 1``, …, with final hidden states ``hidden`` [pass, d]. Draft models ignore it; EAGLE heads keep
        the target's features of those positions."""


class OwnsHead:
    """The head-owning half of a :class:`Draft`: ``head_logits`` runs the head ``_new_head()`` builds, once per
    sequence (``_forget_head()`` at ``reset``), so its packed rows live exactly as long as the sequence."""

    _head = None

    def _new_head(self):
        """A fresh head over this draft's step rows (:class:`~dynvocab.runtime.head.DraftHead` or alike)."""
        raise NotImplementedError

    def _forget_head(self) -> None:
        self._head = None

    def head_logits(self, hidden: torch.Tensor, active: ActiveSet) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits [m, n] (float32) over ``active`` for head inputs ``hidden`` [m, d], and the target id of
        each column [n] (None: the columns are all target ids in order)."""
        if self._head is None:
            self._head = self._new_head()
        return self._head.logits(hidden, active)

    @property
    def rows_copied(self) -> int:
        """Head rows gathered into packed buffers since the last reset."""
        return 0 if self._head is None else self._head.rows_copied

    _rows = None

    @property
    def head_rows(self):
        """The head's rows as one row source for the draft's life (:func:`~dynvocab.runtime.head.row_source` of
        ``step_rows``): the rows of fixed orders it keeps outlive a sequence's head."""
        if self._rows is None:
            self._rows = row_source(*self.step_rows)
        return self._rows

    def _row_source(self):
        """The row source the head multiplies target ids from (None where its rows are not target ids)."""
        return self.head_rows

    def prepare_rows(self, order: torch.Tensor, prefixes: Sequence[int] = ()) -> None:
        """Pack the head's rows of a policy's fixed id ``order`` (and its ``prefixes``) now: see :class:`Draft`."""
        source = self._row_source()
        if source is not None:
            prepare_order(source, order, tuple(prefixes))
