"""The speculative decoding loop: the one loop every strategy, `generate` and `bench` run.

Each cycle: for each of up to γ draft steps the draft runs its body over the new token, the policy names the
active ids (an :class:`~dynvocab.runtime.active_set.ActiveSet`), and the draft's own head computes logits only
over them; the target scores the draft in one pass over its full vocabulary, :func:`~dynvocab.runtime.verify.verify`
accepts tokens (greedy or exact rejection sampling), both KV caches roll back to the accepted prefix, and the
policy observes the cycle. The loop only decodes: counters go to a :class:`~dynvocab.runtime.metrics.Tally`, and
section times are opt-in and read once per cycle (:mod:`dynvocab.runtime.timing`).
``gamma = 0`` with no draft is plain autoregressive decoding by the target.

Cache invariant: before a cycle the target's cache holds every committed token but the last one; the draft's
cache holds some prefix of the committed tokens and catches up at its first draft step. The draft is either kind
behind :class:`~dynvocab.runtime.draft.Draft` (a draft model, an EAGLE head): after each target pass the loop
hands it the committed rows (``observe``), which an EAGLE head reads its features from and a draft model ignores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dynvocab.runtime.active_set import ActiveSet
from dynvocab.runtime.draft import Proposer
from dynvocab.runtime.lm import CausalLM
from dynvocab.runtime.metrics import Metrics, Tally
from dynvocab.runtime.policies.base import CycleReport, VocabPolicy
from dynvocab.runtime.policies.full import FullPolicy
from dynvocab.runtime.timing import SectionTimer
from dynvocab.runtime.tree import DraftTree
from dynvocab.runtime.verify import DraftStep, SamplingConfig, probs_from_logits, verify


DEFAULT_GAMMA = 6  # the longest draft: EvoSpec's speculation horizon
DEFAULT_STOP_BELOW = 0.4  # transformers' ``assistant_confidence_threshold`` default
DEFAULT_BRANCH_BELOW = 0.8  # chosen on the demo pair here (docs/bench.md): leaves where the draft is unsure


@dataclass(frozen=True)
class DecodeConfig:
    """Decoding settings shared by every strategy.

    ``gamma`` is the longest draft. The draft stops early after a token it gave a probability below
    ``stop_below`` (0 never stops early). Greedy decoding also verifies the draft's runner-up at every step where
    its chosen token's probability is below ``branch_below`` (a leaf of a small draft tree, see
    :mod:`dynvocab.runtime.tree`; 0 verifies the chain alone). Neither changes the output, only its speed.
    """

    gamma: int = DEFAULT_GAMMA
    max_new_tokens: int = 128
    stop_below: float = DEFAULT_STOP_BELOW
    branch_below: float = DEFAULT_BRANCH_BELOW
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

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


def _draft_choice(
    row: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator, ranked: bool
) -> tuple[int, int | None, float, torch.Tensor | None]:
    """The draft's pick from its logits ``row`` [n]: (column, runner-up column, its probability, q).

    Greedy picks the argmax and ``q`` is None; sampling draws from ``q``. The runner-up (greedy only) and the
    probability are computed only when ``ranked`` (early stop or branching needs them); else they are None and 1.
    """
    if not sampling.greedy:
        q = probs_from_logits(row, sampling)  # [n]
        col = int(torch.multinomial(q, 1, generator=generator))
        return col, None, float(q[col]), q
    if not ranked:
        return int(row.argmax()), None, 1.0, None
    top = torch.softmax(row, dim=-1).topk(min(2, row.numel()))
    runner_up = int(top.indices[1]) if row.numel() > 1 else None
    return int(top.indices[0]), runner_up, float(top.values[0]), None


@torch.inference_mode()
def speculative_generate(
    target: CausalLM,
    prompt_ids: list[int],
    cfg: DecodeConfig,
    eos_ids: set[int],
    draft: Proposer | None = None,
    policy: VocabPolicy | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    timing: bool = False,
) -> Generation:
    """Generate up to ``cfg.max_new_tokens`` tokens after ``prompt_ids``; returns exactly the target's output.

    With ``draft=None`` (or ``cfg.gamma == 0``) this is autoregressive decoding by the target alone; a draft with
    no ``policy`` drafts over its full vocabulary. ``timing`` fills the sections of :class:`Metrics` (prefill,
    draft, head, policy, verify); wall time and tokens/s are measured either way.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    device = target.device
    sampling = cfg.sampling
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    speculative = draft is not None and cfg.gamma > 0
    if speculative and policy is None:
        policy = FullPolicy(draft.info.vocab_size)
    timer = SectionTimer(device, timing)
    tally = Tally(cfg.gamma if speculative else 0)
    m = tally.m

    start = time.perf_counter()
    t0 = timer.mark()
    prompt = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    target.reset()
    prefix_hidden = target.step(prompt[:-1]) if prompt.numel() > 1 else None  # [L-1, d]
    if speculative:
        draft.reset()
        draft.observe(0, prefix_hidden, None)
    if policy is not None:
        prefill_logits = None
        if policy.prefill_logits and prefix_hidden is not None:
            prefill_logits = target.logits(prefix_hidden)
        policy.prefill(prompt, prefill_logits, prefix_hidden)
    if speculative and prompt.numel() > 1:
        draft.step(prompt[:-1])
    timer.add("prefill_s", t0)

    branch = sampling.greedy and cfg.branch_below > 0  # tree leaves: greedy verification only
    ranked = branch or cfg.stop_below > 0
    tokens = list(prompt_ids)
    out: list[int] = []
    stopped = False
    lengths = []
    while len(out) < cfg.max_new_tokens and not stopped:
        n = len(tokens)
        gamma = min(cfg.gamma, cfg.max_new_tokens - len(out) - 1) if speculative else 0

        t_draft = timer.mark()
        steps: list[DraftStep] = []
        sets: list[ActiveSet] = []  # the active set of each draft step
        tops: list[torch.Tensor] = []
        leaves: dict[int, int] = {}
        feed = torch.tensor(tokens[draft.length:] if gamma else [], dtype=torch.long, device=device)
        for j in range(gamma):
            hidden = draft.step(feed)[-1:]  # [1, d]
            t_policy = timer.mark()
            active = policy.active_ids(j, hidden, int(feed[-1]))
            t_head = timer.mark()
            logits, cols = draft.head_logits(hidden, active)  # [1, n_active], [n_active] or None
            timer.add("policy_s", t_policy, t_head)
            timer.add("head_s", t_head)
            sets.append(active)
            tally.step(active.size)
            row = logits[0]
            col, runner_up, confidence, q = _draft_choice(row, sampling, generator, ranked)
            token = col if cols is None else int(cols[col])
            steps.append(DraftStep(token, cols, q))
            if branch and runner_up is not None and confidence < cfg.branch_below:
                leaves[j] = runner_up if cols is None else int(cols[runner_up])
            if policy.draft_topk:
                top = row.topk(min(policy.draft_topk, row.numel())).indices
                tops.append(top if cols is None else cols[top])
            if confidence < cfg.stop_below:
                break
            feed = torch.tensor([token], dtype=torch.long, device=device)
        timer.add("draft_s", t_draft)

        t_verify = timer.mark()
        tree = DraftTree([s.token for s in steps], leaves)
        pass_ids = torch.tensor(tree.inputs(tokens[-1]), dtype=torch.long, device=device)
        hidden = target.step(pass_ids, tree if leaves else None)  # [1 + drafted + leaves, d]
        logits = target.logits(hidden)  # [1 + drafted + leaves, V]
        verdict = verify(tree, steps, logits, sampling, generator)
        k = len(verdict.path)
        emitted = verdict.path + [verdict.next_token]
        emitted = emitted[: cfg.max_new_tokens - len(out)]
        for i, tok in enumerate(emitted):
            if tok in eos_ids:
                emitted, stopped = emitted[: i + 1], True
                break
        kept = None if verdict.leaf_row is None else n - 1 + verdict.leaf_row
        target.rollback(n + verdict.chain_accepted, keep=kept)
        if speculative:
            draft.rollback(min(draft.length, n + verdict.chain_accepted))
            draft.observe(n - 1, hidden, verdict.rows)  # the committed rows: root, accepted path
        timer.add("verify_s", t_verify)

        drafted = tree.chain
        tally.cycle(len(drafted), verdict.chain_accepted, k, emitted, sets, len(leaves), verdict.leaf_row is not None)
        lengths.append(len(emitted))
        tokens.extend(emitted)
        out.extend(emitted)
        if policy is not None:
            t_policy = timer.mark()
            rows = slice(0, len(drafted) + 1)  # the chain's rows; an accepted leaf's row replaces its sibling's
            if verdict.leaf_row is not None:
                rows = verdict.rows + list(range(k + 1, len(drafted) + 1))
            policy.observe(CycleReport(
                n, verdict.path + drafted[k:], tops, k, emitted, logits[rows], hidden[rows], sets,
                leaf=verdict.leaf_row is not None,
            ))
            timer.add("policy_s", t_policy)
        timer.flush(m)
        if on_tokens is not None:
            on_tokens(emitted)

    metrics = tally.finish(time.perf_counter() - start, speculative, draft.rows_copied if speculative else 0)
    return Generation(out, metrics, stopped, lengths)
