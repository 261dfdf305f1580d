"""The interface between the speculative loop and a vocabulary policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvocab.runtime.active_set import ActiveSet


@dataclass(frozen=True)
class CycleReport:
    """What one draft-verify cycle did, reported to the policy after verification.

    ``target_logits`` and ``target_hidden`` cover the γ+1 verified positions (position j predicts the
    token after ``draft_tokens[:j]``); only the first ``accepted + 1`` of them lie on the accepted path.
    """

    position: int  # sequence length before the cycle (prompt + tokens emitted so far)
    draft_tokens: list[int]  # [γ] drafted ids
    draft_top: list[torch.Tensor]  # γ × [k] the draft's top alternatives per step (empty when not asked)
    accepted: int  # tokens accepted on the path, an accepted tree leaf included (then ``leaf`` is set)
    emitted: list[int]  # tokens appended this cycle (accepted + correction/bonus, after EOS/length cuts)
    target_logits: torch.Tensor  # [γ+1, V] float32
    target_hidden: torch.Tensor  # [γ+1, d_target]
    active_sets: tuple[ActiveSet, ...] | list[ActiveSet] = ()  # the active set of each draft step
    leaf: bool = False  # the last of the ``accepted`` tokens is a tree leaf, not a chain token (see runtime.tree)


class VocabPolicy:
    """Chooses the draft's active vocabulary before each draft step and learns from each cycle.

    The loop calls ``prefill`` once, then per cycle ``active_ids(j, hidden, token)`` for each draft step and
    ``observe`` after verification. Returning the same tensor object (or a prefix view of a tensor the head
    packed in order) tells the packed head nothing changed, so it copies no rows.
    """

    name = "base"
    prefill_logits = False  # set when prefill needs target logits at every prompt position
    draft_topk = 0  # >0 asks the loop to report the draft's top-k alternatives per step

    def prefill(self, prompt_ids: torch.Tensor, target_logits: torch.Tensor | None, target_hidden) -> None:
        """See the prompt [L] (and, if asked for, target logits [L-1, V] and hidden states [L-1, d])."""

    def active_ids(self, step: int, hidden: torch.Tensor | None = None, token: int | None = None) -> ActiveSet:
        """Token ids the draft may propose at draft position ``step`` (0-based).

        ``hidden`` [1, d] is the draft's final hidden state at this step (before its head) and ``token`` the
        last token fed to the draft; context-routed policies (DynaSpec) use them, others ignore them.
        Returns an :class:`~dynvocab.runtime.active_set.ActiveSet`: the full vocabulary or disjoint segments.
        """
        raise NotImplementedError

    def observe(self, cycle: CycleReport) -> None:
        """Update state after a verified cycle."""

    def close(self) -> None:
        """Undo what the policy changed outside itself (EvoSpec's LoRA on the shared draft); nothing by default."""
