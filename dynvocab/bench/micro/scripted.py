"""A scripted draft and verifier that drive :func:`~dynvocab.runtime.decoding.cycle.run_cycle` without models.

``microbench policy-steps`` and the policy tests replay scripted cycles — the draft's hidden states and tokens per
step, the verdict, the target's logits and hidden states — through the same ``run_cycle`` the loop runs, so a
policy sees exactly the calls, in the order and with the tokens, that ``generate`` gives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from dynvocab.runtime.decoding.cycle import Checked, CycleResult, CycleSetup, Sections, run_cycle
from dynvocab.runtime.decoding.timing import SectionTimer
from dynvocab.runtime.drafts.draft import DraftInfo
from dynvocab.runtime.heads.active_set import ActiveSet
from dynvocab.runtime.trees.tree import DraftTree
from dynvocab.runtime.trees.verify import SamplingConfig, Verdict


@dataclass
class ScriptedCycle:
    """One cycle to replay: the γ ``draft_tokens`` the draft proposes (with its hidden state [1, d] per step and
    its ``draft_top`` alternatives), the ``accepted`` count and the recovered/bonus ``next_token`` the verifier
    returns, and the target's pass (``target_logits`` [γ+1, V], ``target_hidden`` [γ+1, d])."""

    draft_tokens: list[int]
    accepted: int
    next_token: int
    target_logits: torch.Tensor
    target_hidden: torch.Tensor
    draft_hidden: torch.Tensor | Sequence[torch.Tensor]  # γ × [1, d]
    draft_top: list[torch.Tensor] = field(default_factory=list)  # γ × [k]

    @property
    def emitted(self) -> list[int]:
        """The tokens the cycle commits: the accepted draft tokens and the next token."""
        return self.draft_tokens[: self.accepted] + [self.next_token]


class ScriptedDraft:
    """A :class:`~dynvocab.runtime.drafts.draft.Proposer` replaying :class:`ScriptedCycle` s, and their verifier.

    ``info``: what the policies read of the draft (bench's stand-in of a draft kind). Each step returns the
    script's hidden state; the head, when given (a :class:`~dynvocab.runtime.heads.head.DraftHead`), runs over the
    policy's active set (its columns are kept in ``columns``), and the logits returned make the script's token the
    draft's choice, its ``draft_top`` the next ones."""

    def __init__(self, info: DraftInfo, head=None):
        self.info = info
        self.head = head
        self.device = info.device
        self.length = 0
        self.columns: list[torch.Tensor | None] = []  # the head's column ids per step (with a head)
        self._cycle: ScriptedCycle | None = None
        self._picks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._j = 0

    def start(self, cycle: ScriptedCycle, tokens: list[int]) -> None:
        """Replay ``cycle`` next, after the committed ``tokens`` (the draft has seen all but the last)."""
        self._cycle, self._j, self.length = cycle, 0, len(tokens) - 1
        self._picks = []
        for j, token in enumerate(cycle.draft_tokens):
            top = cycle.draft_top[j] if j < len(cycle.draft_top) else torch.empty(0, dtype=torch.long)
            cols = torch.cat([torch.tensor([token]), top.long()]).to(self.device)  # [1 + k]
            self._picks.append((torch.arange(cols.numel(), 0, -1, dtype=torch.float32, device=self.device)[None], cols))

    @property
    def rows_copied(self) -> int:
        """Rows the head (if any) gathered into packed buffers."""
        return 0 if self.head is None else self.head.rows_copied

    def reset(self) -> None:
        """Forget the sequence."""
        self.length = 0

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """The script's hidden state [1, d] of the next step."""
        hidden = self._cycle.draft_hidden[self._j]
        self._j += 1
        self.length += ids.numel()
        return hidden

    def head_logits(self, hidden: torch.Tensor, active: ActiveSet) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head (if any) over ``active``; logits [1, 1 + k] ranking the script's token first."""
        if self.head is not None:
            self.columns.append(self.head.logits(hidden, active)[1])
        return self._picks[self._j - 1]

    def rollback(self, length: int) -> None:
        """Nothing is cached."""
        self.length = min(self.length, length)

    def observe(self, start: int, hidden: torch.Tensor | None, rows) -> None:
        """Nothing is kept of the target's pass."""

    def verify(self, tree: DraftTree, proposals, tokens: list[int]) -> Checked:
        """The script's verdict over the drafted chain, with its target pass."""
        c = self._cycle
        verdict = Verdict(c.draft_tokens[: c.accepted], c.next_token, tuple(range(1, c.accepted + 1)),
                          (-1, *c.draft_tokens), c.accepted)
        return Checked(verdict, c.target_logits, c.target_hidden)


def run_script(policy, cycles: Sequence[ScriptedCycle], tokens: list[int], draft: ScriptedDraft,
               timer: SectionTimer | None = None, sections: Sections = Sections(), times=None) -> list[CycleResult]:
    """Drive ``policy`` through ``cycles`` with :func:`~dynvocab.runtime.decoding.cycle.run_cycle` (greedy, no early
    stop, no leaves) after the committed ``tokens``, which grow in place. With ``timer``, the ``sections`` are flushed
    into ``times`` (an object with those attributes) after each cycle."""
    timer = timer or SectionTimer(torch.device("cpu"), False)
    setup = CycleSetup(draft, draft.verify, policy, SamplingConfig(), torch.Generator().manual_seed(0), timer,
                       sections=sections)
    results = []
    for cycle in cycles:
        draft.start(cycle, tokens)
        result = run_cycle(setup, tokens, len(cycle.draft_tokens), len(cycle.draft_tokens) + 1)
        if times is not None:
            timer.flush(times)
        tokens += result.emitted
        results.append(result)
    return results
