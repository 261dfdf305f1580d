"""The speculative decoding loop: the one loop every strategy, `generate` and `bench` run.

Each cycle (:func:`~dynvocab.runtime.decoding.cycle.run_cycle`): for each of up to γ draft steps the draft runs its
body over the new token, the policy names the active ids (an :class:`~dynvocab.runtime.heads.active_set.ActiveSet`),
and the draft's own head computes logits only over them; the target scores the draft in one pass over its full
vocabulary,
:func:`~dynvocab.runtime.trees.verify.verify` accepts tokens (greedy or exact rejection sampling), both KV caches roll
back to the accepted prefix, and the policy observes the cycle. The host reads the device once per draft step and
once per cycle (:func:`~dynvocab.runtime.host.to_host`). The loop only decodes: counters go to a
:class:`~dynvocab.runtime.decoding.metrics.Tally`, and section times are opt-in and read once per cycle
(:mod:`dynvocab.runtime.decoding.timing`).
``gamma = 0`` with no draft is plain autoregressive decoding by the target.

The loop is an iterator, :class:`Decoding`, as transformers' streamers and vLLM's engine iterate: each ``next`` runs
one cycle and returns the tokens it committed, so streaming needs no thread; closing it runs no further cycle.
:func:`speculative_generate` runs it to the end.

Cache invariant: before a cycle the target's cache holds every committed token but the last one; the draft's
cache holds some prefix of the committed tokens and catches up at its first draft step. The draft is either kind
behind :class:`~dynvocab.runtime.drafts.draft.Proposer` (a draft model, an EAGLE head): after each target pass the
loop hands it the committed rows (``observe``), which an EAGLE head reads its features from and a draft model ignores.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from dynvocab.errors import DynvocabError
from dynvocab.runtime.decoding.cycle import CycleResult, CycleSetup, TargetVerifier, run_cycle
from dynvocab.runtime.decoding.metrics import Metrics, Tally
from dynvocab.runtime.decoding.ngram import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, NgramLookup
from dynvocab.runtime.decoding.timing import SectionTimer
from dynvocab.runtime.drafts.draft import Proposer
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.selection.base import FullPolicy, VocabPolicy
from dynvocab.runtime.trees.budget import budget_for
from dynvocab.runtime.trees.mode import TreeMemory
from dynvocab.runtime.trees.shape import TREE_AUTO, TREE_OFF, TreeShape, chains_only, parse_tree
from dynvocab.runtime.trees.verify import SamplingConfig


DEFAULT_GAMMA = 6  # the longest draft: EvoSpec's speculation horizon
DEFAULT_STOP_BELOW = 0.4  # transformers' ``assistant_confidence_threshold`` default
# Leaves where the draft is unsure: chosen on the demo pair (a run with early stops and tree leaves, commit bbadcc4).
DEFAULT_BRANCH_BELOW = 0.8
TREE_SETS = ("depth", "node")  # --tree-sets: the depth's best node's set for all its nodes, or each node its own


@dataclass(frozen=True)
class DecodeConfig:
    """Decoding settings shared by every strategy.

    ``gamma`` is the longest draft. The draft stops early after a token it gave a probability below
    ``stop_below`` (0 never stops early). Greedy decoding also verifies the draft's runner-up at every step where
    its chosen token's probability is below ``branch_below`` (a leaf of a small draft tree, see
    :mod:`dynvocab.runtime.trees.tree`; 0 verifies the chain alone). ``ngram``: each cycle first looks up the
    committed tokens' longest suffix of ``ngram_min`` to ``ngram_max`` tokens earlier in the request and drafts what
    followed it (:mod:`dynvocab.runtime.decoding.ngram`); the draft runs only where nothing is found, and with no
    draft at all the lookup alone speculates. ``tree``: ``off`` (chains), ``DEPTHxTOPKxTOKENS`` (an EAGLE-2 tree each
    cycle,
    :mod:`dynvocab.runtime.trees.growth`; EAGLE heads only) or ``auto`` (a tree fitted to the target's measured
    verification cost, :mod:`dynvocab.runtime.trees.budget`). ``tree_sets``: ``depth`` scores every node of a tree
    depth over the set chosen for its best node; ``node`` gives each node its own set where the strategy reads the
    node (``dynaspec``, ``lowrank``, ``centroids``, ``hybrid``'s per-step search), in one head call over their union.
    None of these changes the output, only its speed.
    """

    gamma: int = DEFAULT_GAMMA
    max_new_tokens: int = 128
    stop_below: float = DEFAULT_STOP_BELOW
    branch_below: float = DEFAULT_BRANCH_BELOW
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ngram: bool = False
    ngram_max: int = DEFAULT_NGRAM_MAX
    ngram_min: int = DEFAULT_NGRAM_MIN
    tree: str = TREE_OFF
    tree_sets: str = TREE_SETS[0]

    def __post_init__(self):
        NgramLookup(self.ngram_max, self.ngram_min)  # refuses sizes out of order
        if self.tree_sets not in TREE_SETS:
            raise DynvocabError(f"--tree-sets takes {' or '.join(TREE_SETS)} (got {self.tree_sets!r})")
        object.__setattr__(self, "tree", str(parse_tree(self.tree) or TREE_OFF))  # refuses a bad shape

    @property
    def tree_shape(self) -> TreeShape | str | None:
        """The EAGLE-2 tree each cycle drafts (:class:`TreeShape`), ``"auto"``, or None (chains)."""
        return parse_tree(self.tree)

    @property
    def lookup(self) -> NgramLookup | None:
        """The n-gram lookup each cycle tries first, or None."""
        return NgramLookup(self.ngram_max, self.ngram_min) if self.ngram else None

    @property
    def sampling(self) -> SamplingConfig:
        """The sampling part of the config."""
        return SamplingConfig(self.temperature, self.top_p)


@dataclass
class Generation:
    """The result of one generation: new token ids and metrics."""

    token_ids: list[int]
    metrics: Metrics
    stopped_by_eos: bool = False
    cycle_lengths: list[int] = field(default_factory=list)


def _prefill(target: CausalLM, prompt_ids: list[int], draft: Proposer | None, policy: VocabPolicy | None) -> None:
    """Run the target (and the draft) over the prompt but its last token; show the policy the prompt."""
    prompt = torch.tensor(prompt_ids, dtype=torch.long, device=target.device)
    target.reset()
    prefix_hidden = target.step(prompt[:-1]) if prompt.numel() > 1 else None  # [L-1, d]
    if draft is not None:
        draft.reset()
        draft.observe(0, prefix_hidden, None)
    if policy is not None:
        wants_logits = policy.prefill_logits and prefix_hidden is not None
        rows = policy.prefill_logit_rows
        tail = prefix_hidden[-rows:] if wants_logits and rows else prefix_hidden  # [R, d]: the positions it reads
        prompt_logits = target.logits(tail) if wants_logits else None  # [R, V]
        policy.prefill(prompt, prompt_logits, prefix_hidden)
    if draft is not None and prompt.numel() > 1:
        draft.step(prompt[:-1])


class Decoding:
    """One generation that runs as it is iterated: each ``next`` runs one draft-verify cycle and returns the token
    ids it committed (``list[int]``); nothing runs before the first ``next``.

    :attr:`generation` holds the :class:`Generation` once the iterator is exhausted or closed: the tokens so far,
    their metrics finished either way. ``close()`` stops after the cycle in flight (the one the last ``next`` ran)
    and calls ``on_end`` once, as does the end of the iteration, a failure inside it, or the decoding being dropped
    unclosed (garbage-collected). ``memory``: ``--tree auto``'s across generations (see :func:`speculative_generate`).
    """

    def __init__(
        self,
        target: CausalLM,
        prompt_ids: list[int],
        cfg: DecodeConfig,
        eos_ids: set[int],
        draft: Proposer | None = None,
        policy: VocabPolicy | None = None,
        timing: bool = False,
        on_end: Callable[[], None] | None = None,
        memory: TreeMemory | None = None,
    ):
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        self.generation: Generation | None = None
        self._end = None if on_end is None else weakref.finalize(self, on_end)  # calls on_end at most once
        self._cycles = self._run(target, prompt_ids, cfg, eos_ids, draft, policy, timing, memory)

    def __iter__(self) -> Decoding:
        return self

    def __next__(self) -> list[int]:
        try:
            return next(self._cycles)
        except BaseException:  # StopIteration (the end) included: a generation that ended is closed
            self.close()
            raise

    def close(self) -> None:
        """Run no further cycle; finish the metrics of the tokens so far and call ``on_end`` (idempotent)."""
        self._cycles.close()
        if self.generation is None:  # closed before its first cycle: nothing ran
            self.generation = Generation([], Metrics())
        if self._end is not None:
            self._end()

    def run(self) -> Generation:
        """Run the remaining cycles; the whole generation."""
        for _ in self:
            pass
        return self.generation

    @torch.inference_mode()  # torch enters the mode on each resumption: the consumer's code runs outside it
    def _run(self, target: CausalLM, prompt_ids: list[int], cfg: DecodeConfig, eos_ids: set[int],
             draft: Proposer | None, policy: VocabPolicy | None, timing: bool,
             memory: TreeMemory | None) -> Iterator[list[int]]:
        """The loop: prefill, then one cycle per ``next`` until ``max_new_tokens`` or an EOS."""
        start = time.perf_counter()
        speculative = (draft is not None or cfg.ngram) and cfg.gamma > 0
        draft = draft if speculative else None
        policy = FullPolicy(draft.info.vocab_size) if draft is not None and policy is None else policy
        setup = _setup(target, cfg, eos_ids, draft, policy, SectionTimer(target.device, timing), memory)
        tally = Tally(cfg.gamma if speculative else 0)
        tokens, out, lengths, stopped = list(prompt_ids), [], [], False  # tokens: the prompt and what followed
        try:
            t0 = setup.timer.mark()
            _prefill(target, prompt_ids, draft, policy)
            setup.timer.add("prefill_s", t0)
            while len(out) < cfg.max_new_tokens and not stopped:
                left = cfg.max_new_tokens - len(out)
                result = run_cycle(setup, tokens, min(cfg.gamma, left - 1) if speculative else 0, left)
                _count(tally, result)
                setup.timer.flush(tally.m)
                stopped = result.eos
                lengths.append(len(result.emitted))
                tokens += result.emitted
                out += result.emitted
                yield result.emitted
        finally:
            metrics = tally.finish(time.perf_counter() - start, speculative, draft.rows_copied if draft else 0)
            if setup.tree is not None:
                metrics.tree = str(setup.tree) if setup.budget is None else TREE_AUTO
                metrics.tree_auto = None if setup.budget is None else {
                    "why": setup.budget.describe(), **setup.budget.summary()}
            self.generation = Generation(out, metrics, stopped, lengths)


def speculative_generate(
    target: CausalLM,
    prompt_ids: list[int],
    cfg: DecodeConfig,
    eos_ids: set[int],
    draft: Proposer | None = None,
    policy: VocabPolicy | None = None,
    timing: bool = False,
    memory: TreeMemory | None = None,
) -> Generation:
    """Generate up to ``cfg.max_new_tokens`` tokens after ``prompt_ids``; returns exactly the target's output.

    With ``draft=None`` (or ``cfg.gamma == 0``) this is autoregressive decoding by the target alone (speculative by
    n-gram lookup alone with ``cfg.ngram``); a draft with no ``policy`` drafts over its full vocabulary. ``timing``
    fills the sections of :class:`Metrics` (prefill, draft, head, policy, verify); wall time and tokens/s are
    measured either way. ``memory``: what ``--tree auto`` learned in earlier generations on this draft, and learns
    in this one (:class:`~dynvocab.runtime.trees.mode.TreeMemory`; None: this generation starts afresh).
    :class:`Decoding` runs the same loop a cycle at a time.
    """
    return Decoding(target, prompt_ids, cfg, eos_ids, draft, policy, timing, memory=memory).run()


def _setup(target: CausalLM, cfg: DecodeConfig, eos_ids: set[int], draft: Proposer | None, policy: VocabPolicy | None,
           timer: SectionTimer, memory: TreeMemory | None = None) -> CycleSetup:
    """The generation's fixed parts: the draft, the target as verifier, the policy, the sampling state, and with
    ``--tree auto`` its budget (going on from ``memory``)."""
    generator = torch.Generator(device=target.device).manual_seed(cfg.seed)
    verifier = TargetVerifier(target, cfg.sampling, generator)
    shape, budget = cfg.tree_shape, None
    if shape is not None and draft is not None:
        check_tree_draft(draft)
        if shape == TREE_AUTO:
            key = (getattr(policy, "name", ""), cfg.sampling.greedy, cfg.ngram)
            budget = budget_for(target, key, memory, cfg.sampling.greedy)
            shape = budget.shape
    return CycleSetup(draft, verifier, policy, cfg.sampling, generator, timer, cfg.stop_below, cfg.branch_below,
                      frozenset(eos_ids), ngram=cfg.lookup, tree=shape if draft is not None else None, budget=budget,
                      node_sets=cfg.tree_sets == "node")


def drafts_trees(draft: Proposer) -> bool:
    """Whether ``draft`` grows EAGLE-2 trees (it has ``tree_root`` and ``branch``: the EAGLE heads)."""
    return hasattr(draft, "branch")


def check_tree_draft(draft: Proposer) -> None:
    """Refuse ``--tree`` for a draft that drafts chains only (a draft model), in one line."""
    if not drafts_trees(draft):
        raise chains_only(draft.info.label)


def _count(tally: Tally, result: CycleResult) -> None:
    """Feed one cycle's host values to the tally."""
    verdict, drafted, tree = result.verdict, result.draft, result.grown is not None
    if tree:  # its depths are the draft's steps, accepted by depth
        tally.tree(result.grown, verdict)
    by_depth = verdict.accepted if tree else verdict.on_main  # a chain's accepted leaf counts apart
    tally.cycle(len(drafted.sets) if tree else len(drafted.steps), by_depth, verdict.accepted, result.emitted,
                drafted.sets, len(drafted.leaves), verdict.accepted > by_depth, drafted.looked_up)
