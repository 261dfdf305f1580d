"""The draft interface: what the speculative loop asks of a draft, whichever kind runs behind it.

Two kinds implement it: an independent draft model (:class:`~dynvocab.runtime.lm.CausalLM`) and an EAGLE head
(:class:`~dynvocab.runtime.eagle_draft.EagleDraft`), which also reads the target's features. The loop never asks
which one it runs (as vLLM's engine never asks which proposer it drives).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class Draft(Protocol):
    """A proposer with a KV cache that rolls back. ``length``: committed and drafted tokens it has consumed."""

    length: int
    device: torch.device
    softcap: float | None

    @property
    def vocab_size(self) -> int:
        """How many target ids a vocabulary policy may name (active sets are target ids)."""

    def reset(self) -> None:
        """Forget the sequence; the next ``step`` starts a new one."""

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Consume tokens ``ids`` [n] (continuing at ``length``); returns the draft head's inputs [n, d]."""

    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens (a draft may keep fewer; ``length`` says how many
        it kept, and the loop feeds the rest again)."""

    def observe(self, start: int, hidden: torch.Tensor | None, rows: Sequence[int] | None) -> None:
        """The target just ran a pass; its ``rows`` (None: all) hold the committed tokens at positions ``start``,
        ``start + 1``, …, with final hidden states ``hidden`` [pass, d]. Draft models ignore it; EAGLE heads keep
        the target's features of those positions."""
