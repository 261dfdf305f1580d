"""The interface between the speculative loop and a strategy: a :class:`VocabPolicy` names each draft step's active
set and learns from each cycle; a strategy whose set reads the draft step alone runs its one batched selector through
:class:`SelectorPolicy`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvocab.runtime.heads.active_set import ActiveSet, NodeSets
from dynvocab.runtime.selection.batch_select import StepContext


@dataclass(frozen=True)
class CycleReport:
    """What one draft-verify cycle did, reported to the policy after verification.

    ``draft_tokens`` are the accepted path, then the draft's best continuation below it (a chain's remaining
    tokens; a tree's first child at each row); ``target_logits`` and ``target_hidden`` hold their rows of the pass,
    the root's first (row j predicts the token after ``draft_tokens[:j]``); only the first ``accepted + 1`` of them
    lie on the accepted path.
    """

    position: int  # sequence length before the cycle (prompt + tokens emitted so far)
    draft_tokens: list[int]  # [γ] drafted ids along the path
    draft_top: list[torch.Tensor]  # γ × [k] the draft's top alternatives per step (empty when not asked)
    accepted: int  # tokens accepted on the path (a runner-up leaf or a side branch included)
    emitted: list[int]  # tokens appended this cycle (accepted + correction/bonus, after EOS/length cuts)
    target_logits: torch.Tensor  # [γ+1, V] float32
    target_hidden: torch.Tensor  # [γ+1, d_target]
    active_sets: tuple[ActiveSet, ...] | list[ActiveSet] = ()  # the active set of each draft step


class VocabPolicy:
    """Chooses the draft's active vocabulary before each draft step and learns from each cycle.

    The loop calls ``prefill`` once, then per cycle ``active_ids(j, hidden, token)`` for each draft step and
    ``observe`` after verification. The head decides what it may reuse from each segment's key alone
    (:class:`~dynvocab.runtime.heads.active_set.SegmentKey`): a :class:`~dynvocab.runtime.heads.active_set.Prefix` of
    a ranking the policy keeps, or :class:`~dynvocab.runtime.heads.active_set.RowRanges` of a fixed order, copies no
    rows once packed; a bare id tensor (or a :class:`~dynvocab.runtime.heads.active_set.Gathered` one) is always a
    change, even the same tensor object, and its rows are brought up to date incrementally.
    """

    name = "base"
    prefill_logits = False  # set when prefill needs target logits at prompt positions
    prefill_logit_rows: int | None = None  # with prefill_logits: only the last this many positions' (None: all)
    draft_topk = 0  # >0 asks the loop to report the draft's top-k alternatives per step

    def prefill(self, prompt_ids: torch.Tensor, target_logits: torch.Tensor | None, target_hidden) -> None:
        """See the prompt [L] (and, if asked for, target logits [R, V] of the last R = min(L-1,
        ``prefill_logit_rows``) prompt positions before the last, and hidden states [L-1, d])."""

    def active_ids(self, step: int, hidden: torch.Tensor | None = None,
                   token: torch.Tensor | None = None) -> ActiveSet:
        """Token ids the draft may propose at draft position ``step`` (0-based).

        ``hidden`` [1, d] is the draft's final hidden state at this step (before its head) and ``token`` [1] the
        last token fed to the draft, a LongTensor on the draft's device (the loop does not read drafted tokens
        to the host: a policy that needs its value reads it with :func:`~dynvocab.runtime.host.to_host`, one
        device wait per step); context-routed policies (DynaSpec, the hybrid's successors) use them, others
        ignore them.
        Returns an :class:`~dynvocab.runtime.heads.active_set.ActiveSet`: the full vocabulary or disjoint segments.
        """
        raise NotImplementedError

    def node_sets(self, step: int, hidden: torch.Tensor, tokens: torch.Tensor) -> NodeSets | None:
        """Each node of a tree depth its own set: ``hidden`` [K, d] the nodes' head inputs, ``tokens`` [K] the tokens
        they were fed, at draft position ``step``; None (the default) where every node has the set that
        :meth:`active_ids` names for the depth's best node."""
        return None

    def observe(self, cycle: CycleReport) -> None:
        """Update state after a verified cycle."""

    def close(self) -> None:
        """Undo what the policy changed outside itself (EvoSpec's LoRA on the shared draft); nothing by default."""


class FullPolicy(VocabPolicy):
    """Every draft step uses the whole (shared) vocabulary: speculative decoding without vocabulary pruning."""

    name = "full"

    def __init__(self, vocab_size: int):
        self.all = ActiveSet.full(vocab_size)

    def active_ids(self, step: int, hidden=None, token=None) -> ActiveSet:
        """Always the full vocabulary."""
        return self.all


class SelectorPolicy(VocabPolicy):
    """A strategy whose set reads the draft step alone (its position, the draft's hidden state, the fed token), run in
    the loop by its one selector, the one a batched host runs: a chain's step is one row (the selector's
    ``row_set``: segments the draft's packed head reuses), a tree depth its K frontier nodes (:meth:`node_sets`).

    ``embedding`` [V, d_e]: the draft's input embedding, for a selector that reads the fed token's (DynaSpec's
    router); rows are read as float32 on ``device``."""

    def __init__(self, selector, embedding: torch.Tensor | None = None, device: torch.device | str = "cpu"):
        self.selector = selector
        self.name = selector.name
        self.embedding, self.device = embedding, torch.device(device)

    def active_ids(self, step: int, hidden: torch.Tensor | None = None,
                   token: torch.Tensor | None = None) -> ActiveSet:
        """The selector's set for one row."""
        return self.selector.row_set(hidden, self._context(step, token))

    def node_sets(self, step: int, hidden: torch.Tensor, tokens: torch.Tensor) -> NodeSets | None:
        """Each node its own set, one head call over their union (the selector's ``node_sets``); None where every
        node has the same set."""
        return self.selector.node_sets(hidden, self._context(step, tokens))

    def _context(self, step: int, fed: torch.Tensor | None) -> StepContext:
        return StepContext(step, fed, embed=None if self.embedding is None else self._embed)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The draft's input embeddings [n, d_e] of ``ids`` [n], float32 on the policy's device."""
        return self.embedding.index_select(0, ids.to(self.embedding.device)).to(self.device, torch.float32)
