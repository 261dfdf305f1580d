"""One draft-verify cycle, the sequence every driver shares: the loop (a real draft and target), ``dynvocab
microbench policy-steps`` and the policy tests (a scripted draft and verdicts, no models).

:func:`run_cycle`: for each draft step the proposer runs over the new token, the policy names the active ids, the
proposer's head scores them and :func:`choose` picks a token on the device. The drafted tokens stay there: each
feeds the next step and the policy as a [1] tensor, and the verifier concatenates them into its pass on the device.
The host reads the device (:func:`~dynvocab.runtime.host.to_host`) only where a decision needs a value: once per
draft step for the step's confidence where early stops or runner-up leaves need it (:attr:`CycleSetup.ranked`),
and once per cycle for the verdict, which brings back the drafted tokens with it. Then the proposer rolls back and
observes the committed rows, and the policy observes a :class:`~dynvocab.runtime.selection.base.CycleReport`. Terms
follow vLLM's rejection sampler: accepted, recovered, bonus (:mod:`dynvocab.runtime.trees.verify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from dynvocab.runtime.decoding.ngram import NgramLookup
from dynvocab.runtime.decoding.timing import SectionTimer
from dynvocab.runtime.drafts.draft import Proposer
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.heads.active_set import ActiveSet
from dynvocab.runtime.host import to_host
from dynvocab.runtime.selection.base import CycleReport, VocabPolicy
from dynvocab.runtime.trees.budget import TreeBudget
from dynvocab.runtime.trees.growth import GrownTree, grow_tree, tree_of
from dynvocab.runtime.trees.shape import TreeShape
from dynvocab.runtime.trees.tree import DraftTree
from dynvocab.runtime.trees.verify import DraftStep, Proposals, SamplingConfig, Verdict, probs_from_logits, verify


@dataclass(frozen=True)
class Checked:
    """A verified draft: the verdict and the pass it came from (logits [pass, V], hidden states [pass, d])."""

    verdict: Verdict
    logits: torch.Tensor
    hidden: torch.Tensor


# (tree, the draft's proposals by row, committed tokens) -> Checked; leaves the target's cache holding the committed
# tokens but the last one, the accepted path included.
Verifier = Callable[[DraftTree, Proposals, list[int]], Checked]


class TargetVerifier:
    """The real verifier: one target pass over the tree, :func:`~dynvocab.runtime.trees.verify.verify`, cache
    rollback."""

    def __init__(self, target: CausalLM, sampling: SamplingConfig, generator: torch.Generator):
        self.target, self.sampling, self.generator = target, sampling, generator

    def __call__(self, tree: DraftTree, proposals: Proposals, tokens: list[int]) -> Checked:
        """Score the tree in one pass (causal where it is one path, else its mask and depth positions), verify it
        walking from the root, and keep only the accepted path in the target's cache. The pass ids are
        concatenated on the device: only the root, a committed token, is uploaded."""
        n, target = len(tokens), self.target
        hidden = target.step(tree.inputs(torch.tensor(tokens[-1:], dtype=torch.long, device=target.device)),
                             None if tree.is_path else tree)  # [n, d]
        logits = target.logits(hidden)  # [n, V]
        verdict = verify(tree, logits, self.sampling, self.generator, proposals)
        target.rollback(n, keep=[n - 1 + row for row in verdict.path_rows])
        return Checked(verdict, logits, hidden)


@dataclass(frozen=True)
class Sections:
    """The :class:`~dynvocab.runtime.decoding.timing.SectionTimer` fields a cycle charges (defaults:
    :class:`Metrics`')."""

    draft: str = "draft_s"  # the whole draft chain
    head: str = "head_s"  # the proposer's head over the active set
    active: str = "policy_s"  # the policy's ``active_ids``
    observe: str = "policy_s"  # the policy's ``observe``
    verify: str = "verify_s"  # the verifier and the proposer's rollback


@dataclass
class CycleSetup:
    """What stays fixed across a generation's cycles. ``proposer`` None: no draft (autoregressive cycles);
    ``policy`` None: nobody observes. ``stop_below``/``branch_below``: see
    :class:`~dynvocab.runtime.decoding.loop.DecodeConfig`. ``ngram``: draft by lookup in the request's tokens first
    (:mod:`dynvocab.runtime.decoding.ngram`), the proposer only where nothing is found; None: the proposer alone."""

    proposer: Proposer | None
    verifier: Verifier
    policy: VocabPolicy | None
    sampling: SamplingConfig
    generator: torch.Generator
    timer: SectionTimer
    stop_below: float = 0.0
    branch_below: float = 0.0
    eos_ids: frozenset[int] = frozenset()
    sections: Sections = field(default_factory=Sections)
    ngram: NgramLookup | None = None
    tree: TreeShape | None = None  # EAGLE-2 trees of this shape (None: chains); see dynvocab.runtime.trees.growth
    budget: TreeBudget | None = None  # ``--tree auto``: per cycle tree or chain, the growth's depth and its tokens
    node_sets: bool = False  # a tree depth's nodes each their own set where the policy names them (else the best's)

    @property
    def branch(self) -> bool:
        """Whether unsure greedy steps add their runner-up as a tree leaf (greedy verification only)."""
        return self.sampling.greedy and self.branch_below > 0

    @property
    def ranked(self) -> bool:
        """Whether draft steps need their confidence on the host (one read per step): early stops or leaves."""
        return self.branch or self.stop_below > 0


@dataclass(frozen=True)
class Choice:
    """A draft step's pick, all on the device: the token's target id [1], the runner-up's [1] (greedy, ranked) and
    the token's draft probability [1] (ranked), and the draft distribution ``q`` [n] over ``support`` (sampling)."""

    token: torch.Tensor
    runner_up: torch.Tensor | None
    confidence: torch.Tensor | None
    q: torch.Tensor | None
    support: torch.Tensor | None


def choose(row: torch.Tensor, cols: torch.Tensor | None, sampling: SamplingConfig, generator: torch.Generator,
           ranked: bool) -> Choice:
    """The draft's pick from its logits ``row`` [n] whose columns are target ids ``cols`` [n] (None: the column is
    the id), without reading the device: greedy takes the argmax (and, ``ranked``, the runner-up and the top
    probability, from one log-sum-exp); sampling draws from ``q`` at the sampling temperature."""
    q = runner = confidence = None
    if not sampling.greedy:
        q = probs_from_logits(row, sampling)  # [n]
        col = torch.multinomial(q, 1, generator=generator)  # [1]
        confidence = q.index_select(0, col) if ranked else None
    elif ranked:
        top = row.topk(min(2, row.numel()))
        col = top.indices[:1]
        runner = top.indices[1:2] if row.numel() > 1 else None
        confidence = (top.values[:1] - torch.logsumexp(row, dim=-1)).exp()
    else:
        col = row.argmax().view(1)
    return Choice(_target_id(col, cols), _target_id(runner, cols), confidence, q, cols)


def _target_id(col: torch.Tensor | None, cols: torch.Tensor | None) -> torch.Tensor | None:
    """The target id [1] of head column ``col`` [1] (on the device)."""
    return col if col is None or cols is None else cols.index_select(0, col)


def read_confidence(choice: Choice) -> float:
    """A ranked draft step's one host read: the draft's probability of its token (1.0 when not ranked: no read)."""
    return 1.0 if choice.confidence is None else to_host(choice.confidence)[0]


@dataclass
class Drafted:
    """One cycle's draft: its chain's steps, each step's active set, its top alternatives and runner-up leaves
    (the runner-up [1] on the device by chain depth)."""

    steps: list[DraftStep] = field(default_factory=list)
    sets: list[ActiveSet] = field(default_factory=list)
    tops: list[torch.Tensor] = field(default_factory=list)
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)
    looked_up: bool = False  # the chain is an n-gram lookup's continuation: no draft step ran

    def tree(self, device) -> DraftTree:
        """The chain and its leaves as one draft tree, its tokens on ``device``."""
        return DraftTree.chain([s.token for s in self.steps], self.leaves, device)

    def proposals(self, row: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's distribution at chain row ``row`` (the step that drafted row ``row + 1``)."""
        step = self.steps[row]
        return step.q, step.support


def draft_chain(setup: CycleSetup, tokens: list[int], gamma: int) -> Drafted:
    """Draft up to ``gamma`` tokens after the committed ``tokens``, on the device: one host read per step where
    the setup is :attr:`~CycleSetup.ranked` (the step's confidence), none otherwise.

    The first step feeds the proposer the committed tokens it has not seen (one upload per cycle); each later step
    feeds the previous step's token straight from the device. The policy gets the last fed token as a [1] tensor on
    the device.

    With :attr:`CycleSetup.ngram`, a continuation found in ``tokens`` is the draft (host values, uploaded with the
    verification pass) and neither the proposer nor the policy runs; without a proposer, only such a draft is made.
    """
    draft, proposer, policy, timer, sec = Drafted(), setup.proposer, setup.policy, setup.timer, setup.sections
    if not gamma:
        return draft
    if setup.ngram is not None and (found := setup.ngram.continuation(tokens, gamma)):
        return _looked_up(found)
    if proposer is None:
        return draft
    feed = torch.tensor(tokens[proposer.length:], dtype=torch.long, device=proposer.info.device)  # once per cycle
    for j in range(gamma):
        hidden = proposer.step(feed)[-1:]  # [1, d]
        t_active = timer.mark()
        active = policy.active_ids(j, hidden, feed[-1:])
        t_head = timer.mark()
        logits, cols = proposer.head_logits(hidden, active)  # [1, n], [n] or None
        timer.add(sec.active, t_active, t_head)
        timer.add(sec.head, t_head)
        row = logits[0]
        choice = choose(row, cols, setup.sampling, setup.generator, setup.ranked)
        confidence = read_confidence(choice)
        draft.steps.append(DraftStep(choice.token, choice.support, choice.q))
        draft.sets.append(active)
        if setup.branch and choice.runner_up is not None and confidence < setup.branch_below:
            draft.leaves[j] = choice.runner_up
        if policy.draft_topk:
            top = row.topk(min(policy.draft_topk, row.numel())).indices
            draft.tops.append(top if cols is None else cols[top])
        if confidence < setup.stop_below:
            break
        feed = choice.token
    return draft


def _looked_up(found: list[int]) -> Drafted:
    """The chain of an n-gram continuation ``found``: each token with a one-hot draft distribution on itself, so
    exact rejection sampling accepts it with probability p(x)."""
    ids = torch.tensor(found, dtype=torch.long)
    one = torch.ones(1)
    steps = [DraftStep(ids[j : j + 1], ids[j : j + 1], one) for j in range(len(found))]
    return Drafted(steps, looked_up=True)


@dataclass(frozen=True)
class CycleResult:
    """What a cycle committed: ``emitted`` tokens (accepted + recovered/bonus, cut at EOS and the limit), whether
    an EOS ended the generation, the verdict, and the draft that was verified."""

    emitted: list[int]
    eos: bool
    verdict: Verdict
    draft: Drafted
    grown: GrownTree | None = None  # the EAGLE-2 tree verified, where the cycle drafted one


def _emitted(verdict: Verdict, limit: int, eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    """The accepted tokens and the recovered/bonus token, cut to ``limit`` and after the first EOS."""
    emitted = (verdict.path + [verdict.next_token])[:limit]
    for i, tok in enumerate(emitted):
        if tok in eos_ids:
            return emitted[: i + 1], True
    return emitted, False


def run_cycle(setup: CycleSetup, tokens: list[int], gamma: int, limit: int) -> CycleResult:
    """One draft-verify cycle after the committed ``tokens``: draft up to ``gamma`` tokens (a chain, or with
    :attr:`CycleSetup.tree` an EAGLE-2 tree), verify them, roll the proposer back to what was kept, and let the
    policy observe; emits at most ``limit`` tokens. Host reads: one for the verdict (with the drafted tokens), and
    one per draft step where the setup is ranked (a chain), or one after the tree's growth (a tree)."""
    budget = setup.budget
    if setup.tree is not None and gamma and setup.proposer is not None:
        found = setup.ngram.continuation(tokens, setup.tree.depth) if setup.ngram is not None else None
        if budget is None and (setup.sampling.greedy or not found):  # sampling: a continuation is the whole draft
            return _tree_cycle(setup, tokens, limit, found or [])
        if budget is not None and not found:  # auto: a found continuation drafts the cycle alone, as in a chain
            tree = budget.wants_tree()
            budget.start()
            result = _tree_cycle(setup, tokens, limit, []) if tree else _chain_cycle(setup, tokens, gamma, limit)
            budget.finish(tree, len(result.emitted), result.verdict.accepted)
            return result
    return _chain_cycle(setup, tokens, gamma, limit)


def _chain_cycle(setup: CycleSetup, tokens: list[int], gamma: int, limit: int) -> CycleResult:
    """One cycle drafting a chain (with its runner-up leaves), or an n-gram continuation."""
    t_draft = setup.timer.mark()
    draft = draft_chain(setup, tokens, gamma)
    setup.timer.add(setup.sections.draft, t_draft)
    device = setup.proposer.info.device if setup.proposer is not None else "cpu"
    verdict, emitted, eos = _check(setup, tokens, draft.tree(device), draft.proposals, limit, draft.sets, draft.tops)
    return CycleResult(emitted, eos, verdict, draft)


def _tree_cycle(setup: CycleSetup, tokens: list[int], limit: int, found: list[int]) -> CycleResult:
    """One cycle drafting an EAGLE-2 tree (:mod:`dynvocab.runtime.trees.growth`; an n-gram continuation ``found``
    joins it as a branch under the root)."""
    budget = setup.budget
    shape = setup.tree.within(limit - 1)
    if budget is not None:
        shape = budget.plan(shape)  # sampling: its depth and N fixed here, before the cycle's first draw
    t_draft = setup.timer.mark()
    growth, candidates = grow_tree(setup, tokens, shape, None if budget is None else budget.keep_growing)
    branch = found[: shape.depth]
    size = shape.tokens if budget is None else budget.tokens(candidates, len(branch))
    grown = tree_of(growth, candidates, size, branch, setup.proposer.info.device)
    setup.timer.add(setup.sections.draft, t_draft)
    verdict, emitted, eos = _check(setup, tokens, grown.tree, grown.proposals, limit, grown.sets, grown.tops)
    return CycleResult(emitted, eos, verdict, Drafted(sets=grown.sets), grown)


def _check(setup: CycleSetup, tokens: list[int], tree: DraftTree, proposals: Proposals, limit: int,
           sets: list[ActiveSet], tops: list[torch.Tensor]) -> tuple[Verdict, list[int], bool]:
    """Verify ``tree`` (drafted after the committed ``tokens`` with the draft's ``proposals``) in one pass, roll the
    proposer back to the committed tokens and the accepted ones it holds (those on the tree's main path), hand it
    the committed rows of the pass, and let the policy observe the cycle. Returns the verdict, the emitted tokens
    and whether an EOS ended the generation."""
    timer, sec, proposer, n = setup.timer, setup.sections, setup.proposer, len(tokens)
    t_verify = timer.mark()
    checked = setup.verifier(tree, proposals, tokens)
    verdict = checked.verdict
    if proposer is not None:
        proposer.rollback(min(proposer.length, n + verdict.on_main))
        proposer.observe(n - 1, checked.hidden, verdict.rows)  # the committed rows: root, accepted path
    timer.add(sec.verify, t_verify)
    emitted, eos = _emitted(verdict, limit, setup.eos_ids)
    if setup.policy is not None:
        t_observe = timer.mark()
        setup.policy.observe(_report(n, tree, checked, emitted, sets, tops))
        timer.add(sec.observe, t_observe)
    return verdict, emitted, eos


def _report(n: int, tree: DraftTree, checked: Checked, emitted: list[int], sets: list[ActiveSet],
            tops: list[torch.Tensor]) -> CycleReport:
    """The policy's view of a cycle: the accepted path, then the draft's best continuation below it (each row's
    first child: greedy, the draft's best), with their rows of the pass; the active set of each draft step or
    depth."""
    verdict = checked.verdict
    rows = verdict.rows
    while tree.children[rows[-1]]:
        rows.append(tree.children[rows[-1]][0])
    drafted = [verdict.tokens[r] for r in rows[1:]]
    take = slice(0, len(rows)) if rows == list(range(len(rows))) else rows  # a chain's rows: a view, not a copy
    return CycleReport(n, drafted, tops, verdict.accepted, emitted, checked.logits[take], checked.hidden[take], sets)
