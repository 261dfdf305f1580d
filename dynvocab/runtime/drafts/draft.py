"""The draft boundary: what the speculative loop drives (:class:`Proposer`) apart from what policies read
(:class:`DraftInfo`), whichever kind of draft runs behind it.

Each kind (a draft model, an EAGLE-1/2 head, an EAGLE-3 head, or one a plugin brings) is one entry in the draft
registry (:mod:`dynvocab.runtime.drafts.kinds`) whose loader returns a :class:`Proposer`. The loop never asks which
kind it drives (as vLLM's engine never asks which proposer it runs), and policies read only the proposer's frozen
:class:`DraftInfo`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from dynvocab.models.rows import prepare_order, row_source
from dynvocab.runtime.heads.active_set import ActiveSet


@dataclass(frozen=True, eq=False)
class DraftInfo:
    """What a policy may read of a draft: fixed for the draft's life.

    ``rows``: the draft head's rows as a row source (:mod:`dynvocab.models.rows`) whose row ``i`` is target id
    ``i`` — what a policy packs a fixed order of at build, what a per-step search is weighed against — or None
    where the head's rows are not target ids (EAGLE-3's own draft vocabulary).
    """

    label: str  # what the draft is, for people (reports, tables)
    vocab_size: int  # how many target ids a policy may name (active sets are target ids)
    hidden_size: int  # width of the hidden state ``step`` returns: what the head and the policies read
    device: torch.device
    embedding: torch.Tensor  # [V, d_e] the draft's input embeddings by token id (DynaSpec's router reads them)
    rows: object | None = None  # RowSource [V, d] of the head over target ids, or None
    shares_target_head: bool = False  # the head is the target's own LM head (EAGLE-1): its HNSW index is the target's
    index_rows: torch.Tensor | None = None  # [V', d] the head rows a bundle's ``draft_hnsw`` stage indexes, or None
    adaptable: object | None = None  # the draft CausalLM whose attention projections online LoRA alignment adapts, or None
    hf_model: torch.nn.Module | None = None  # the model transformers' assisted generation can drive, or None

    def prepare_rows(self, order: torch.Tensor, prefixes: Sequence[int] = ()) -> None:
        """Pack the head's rows of a policy's fixed id ``order`` (and its ``prefixes``) now, when the policy is
        built, not at its first draft step; kept on the row source across sequences. Nothing where ``rows`` is
        None."""
        if self.rows is not None:
            prepare_order(self.rows, order, tuple(prefixes))


@runtime_checkable
class Proposer(Protocol):
    """What the loop drives: a draft with a KV cache that rolls back and a head over active sets.

    ``length``: committed and drafted tokens it has consumed. ``info``: what policies read of it."""

    info: DraftInfo
    length: int

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

    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens (a draft may keep fewer; ``length`` says how many
        it kept, and the loop feeds the rest again)."""

    def observe(self, start: int, hidden: torch.Tensor | None, rows: Sequence[int] | None) -> None:
        """The target just ran a pass; its ``rows`` (None: all) hold the committed tokens at positions ``start``,
        ``start + 1``, …, with final hidden states ``hidden`` [pass, d]. Draft models ignore it; EAGLE heads keep
        the target's features of those positions."""


PROPOSER_METHODS = ("reset", "step", "head_logits", "rollback", "observe")


def protocol_gaps(draft) -> list[str]:
    """What ``draft`` lacks of :class:`Proposer`: missing members, methods whose parameters differ from the
    protocol's, an ``info`` that is not a :class:`DraftInfo`; [] when it conforms."""
    gaps = [name for name in ("info", "length", "rows_copied", *PROPOSER_METHODS) if not hasattr(draft, name)]
    for name in PROPOSER_METHODS:
        if name in gaps:
            continue
        method = getattr(draft, name)
        if not callable(method):
            gaps.append(f"{name} is not a method")
            continue
        want = list(inspect.signature(getattr(Proposer, name)).parameters)[1:]
        params = inspect.signature(method).parameters
        have = list(params)
        extra_required = any(params[p].default is inspect.Parameter.empty for p in have[len(want):])
        if have[: len(want)] != want or extra_required:
            gaps.append(f"{name}{tuple(have)} (the protocol: {tuple(want)})")
    if "info" not in gaps and not isinstance(draft.info, DraftInfo):
        gaps.append(f"info is a {type(draft.info).__name__}, not a DraftInfo")
    return gaps


class OwnsHead:
    """The head-owning half of a :class:`Proposer`: ``head_logits`` runs the head ``_new_head()`` builds, once
    per sequence (``_forget_head()`` at ``reset``), so its packed rows live exactly as long as the sequence; the
    head's rows are one row source for the draft's life (the rows of fixed orders it keeps outlive a sequence)."""

    _head = None
    _rows = None

    def _new_head(self):
        """A fresh head over this draft's rows (:class:`~dynvocab.runtime.heads.head.DraftHead` or alike)."""
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

    @property
    def head_rows(self):
        """The head's rows as one row source (:func:`~dynvocab.models.rows.row_source` of ``step_rows``)."""
        if self._rows is None:
            self._rows = row_source(*self.step_rows)
        return self._rows
