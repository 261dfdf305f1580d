"""The speculative decoding loop: the one loop every strategy, `generate` and `bench` run.

Each cycle: the policy names the active ids, the draft proposes γ tokens computing logits only over them,
the target scores γ+1 positions over its full vocabulary in one pass, tokens are accepted (greedy or exact
rejection sampling), both KV caches roll back to the accepted prefix, and the policy observes the cycle.
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

from dynvocab.runtime.draft import Draft
from dynvocab.runtime.head import DraftHead, active_contains, active_size
from dynvocab.runtime.lm import CausalLM
from dynvocab.runtime.metrics import Metrics
from dynvocab.runtime.policies.base import CycleReport, VocabPolicy
from dynvocab.runtime.tree import DraftTree, TreeVerdict, verify_tree_greedy
from dynvocab.runtime.verify import DraftStep, SamplingConfig, probs_from_logits, verify_sampling


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


class _Clock:
    """Wall-clock timer that waits for the GPU before reading, so each section is charged its own work."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


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
    draft: Draft | None = None,
    head: DraftHead | None = None,
    policy: VocabPolicy | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> Generation:
    """Generate up to ``cfg.max_new_tokens`` tokens after ``prompt_ids``; returns exactly the target's output.

    With ``draft=None`` (or ``cfg.gamma == 0``) this is autoregressive decoding by the target alone.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    device = target.device
    clock = _Clock(device)
    sampling = cfg.sampling
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    speculative = draft is not None and cfg.gamma > 0
    m = Metrics()
    accepted_at = [0] * (cfg.gamma if speculative else 0)
    drafted_at = [0] * (cfg.gamma if speculative else 0)
    active_total = covered = counted = 0

    start = clock()
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
    m.prefill_s = clock() - start

    branch = sampling.greedy and cfg.branch_below > 0  # tree leaves: greedy verification only
    ranked = branch or cfg.stop_below > 0
    tokens = list(prompt_ids)
    out: list[int] = []
    stopped = False
    lengths = []
    while len(out) < cfg.max_new_tokens and not stopped:
        n = len(tokens)
        gamma = min(cfg.gamma, cfg.max_new_tokens - len(out) - 1) if speculative else 0

        t_draft = clock()
        steps: list[DraftStep] = []
        actives: list = []  # the active set of each draft step
        tops: list[torch.Tensor] = []
        leaves: dict[int, int] = {}
        feed = torch.tensor(tokens[draft.length:] if gamma else [], dtype=torch.long, device=device)
        for j in range(gamma):
            hidden = draft.step(feed)[-1:]  # [1, d]
            t_policy = clock()
            ids = policy.active_ids(j, hidden, int(feed[-1])) if policy is not None else None
            t_head = clock()
            m.policy_s += t_head - t_policy
            logits, cols = head.logits(hidden, ids)  # [1, n_active], [n_active] or None
            m.head_s += clock() - t_head
            actives.append(ids)
            active_total += active_size(ids, head.weight.shape[0])
            row = logits[0]
            col, runner_up, confidence, q = _draft_choice(row, sampling, generator, ranked)
            token = col if cols is None else int(cols[col])
            steps.append(DraftStep(token, cols, q))
            if branch and runner_up is not None and confidence < cfg.branch_below:
                leaves[j] = runner_up if cols is None else int(cols[runner_up])
            if policy is not None and policy.draft_topk:
                top = row.topk(min(policy.draft_topk, row.numel())).indices
                tops.append(top if cols is None else cols[top])
            if confidence < cfg.stop_below:
                break
            feed = torch.tensor([token], dtype=torch.long, device=device)
        m.draft_s += clock() - t_draft
        m.draft_steps += len(steps)

        t_verify = clock()
        tree = DraftTree([s.token for s in steps], leaves)
        pass_ids = torch.tensor(tree.inputs(tokens[-1]), dtype=torch.long, device=device)
        hidden = target.step(pass_ids, tree if leaves else None)  # [1 + drafted + leaves, d]
        logits = target.logits(hidden)  # [1 + drafted + leaves, V]
        if sampling.greedy:
            verdict = verify_tree_greedy(tree, logits)
        else:
            k, nxt = verify_sampling(steps, logits, sampling, generator)
            verdict = TreeVerdict(tree.chain[:k], nxt, k)
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
        m.verify_s += clock() - t_verify
        m.leaves += len(leaves)
        m.leaf_hits += verdict.leaf_row is not None

        drafted = tree.chain
        for j in range(len(drafted)):
            drafted_at[j] += 1
            accepted_at[j] += j < verdict.chain_accepted  # an accepted leaf counts in leaf_hits, not here
        # Coverage: accepted tokens were drafted from the active set; the correction at position k < γ is
        # covered when it was inside the active set of draft step k. A bonus after full acceptance had no step.
        in_steps = min(k + 1, len(drafted), len(emitted))
        counted += in_steps
        covered += min(k, in_steps)
        if k < in_steps:
            covered += active_contains(actives[k], emitted[k])
        m.cycles += 1
        lengths.append(len(emitted))
        tokens.extend(emitted)
        out.extend(emitted)
        if policy is not None:
            t_policy = clock()
            rows = slice(0, len(drafted) + 1)  # the chain's rows; an accepted leaf's row replaces its sibling's
            if verdict.leaf_row is not None:
                rows = verdict.rows + list(range(k + 1, len(drafted) + 1))
            report = CycleReport(n, verdict.path + drafted[k:], tops, k, emitted, logits[rows], hidden[rows], leaf=verdict.leaf_row is not None)
            policy.observe(report)
            m.policy_s += clock() - t_policy
        if on_tokens is not None:
            on_tokens(emitted)

    m.wall_s = clock() - start
    m.new_tokens = len(out)
    m.mean_accepted_length = m.new_tokens / m.cycles if m.cycles else 0.0
    m.tokens_per_s = m.new_tokens / m.wall_s if m.wall_s > 0 else 0.0
    m.accept_by_position = [a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at)]
    if speculative:
        m.mean_active_vocab = active_total / m.draft_steps if m.draft_steps else None
        m.active_hit_rate = covered / counted if counted else None
        m.head_rows_copied = head.rows_copied
    return Generation(out, m, stopped, lengths)
