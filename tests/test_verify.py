"""Verification: greedy on hand-built logits; rejection sampling reproduces the target distribution."""

from __future__ import annotations

import random

import pytest
import torch

from dynvocab.runtime.trees.tree import DraftTree
from dynvocab.runtime.trees.verify import DraftStep, SamplingConfig, probs_from_logits, verify_greedy, verify_sampled


def onehot_logits(choices: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


@pytest.mark.parametrize(
    "draft, target, expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted, bonus from the last position
        ([1, 2, 3], [1, 5, 3, 4], (1, 5)),  # first mismatch at position 1: correction 5
        ([1, 2, 3], [0, 2, 3, 4], (0, 0)),  # nothing accepted
        ([], [7], (0, 7)),  # no draft: plain autoregressive step
    ],
)
def test_verify_greedy(draft, target, expected):
    verdict = verify_greedy(DraftTree.of_chain(draft), onehot_logits(target))
    assert (len(verdict.path), verdict.next_token) == expected
    assert verdict.path == draft[: expected[0]] and verdict.on_main == expected[0]
    assert verdict.tokens == (-1, *draft)  # the drafted tokens come back with the verdict


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    assert probs[2] == 0 and probs[3] == 0
    torch.testing.assert_close(probs[:2], torch.tensor([0.625, 0.375]))


def step_of(token: int, support, q) -> DraftStep:
    """A drafted ``token`` as the loop keeps it: a [1] tensor on the device."""
    return DraftStep(torch.tensor([token]), support, q)


def verify_chain(steps: list[DraftStep], target_logits, cfg: SamplingConfig, gen: torch.Generator):
    """The sampled verdict over a chain of drafted ``steps``, as the loop verifies one (a tree of one path)."""
    tree = DraftTree.chain([step.token for step in steps])
    return verify_sampled(tree, target_logits, cfg, gen, lambda row: (steps[row].q, steps[row].support))


def _sample_first_token(p_logits, q_support, q_probs, draws, seed):
    """Draw the first emitted token many times: draft samples from q on its support, target verifies."""
    gen = torch.Generator().manual_seed(seed)
    cfg = SamplingConfig(temperature=1.0)
    counts = torch.zeros(p_logits.shape[-1])
    for _ in range(draws):
        x = int(q_support[torch.multinomial(q_probs, 1, generator=gen)])
        verdict = verify_chain([step_of(x, q_support, q_probs)], p_logits, cfg, gen)
        k, nxt = verdict.accepted, verdict.next_token
        counts[x if k == 1 else nxt] += 1
    return counts / draws


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampling_reproduces_target_with_restricted_q(seed):
    """q lives on a random subset of the vocabulary; the output must still follow p (chi-square test)."""
    vocab, draws = 12, 6000
    gen = torch.Generator().manual_seed(100 + seed)
    p_logits = torch.randn(2, vocab, generator=gen) * 1.5  # [γ+1, V]
    support = torch.randperm(vocab, generator=gen)[:5]
    q = torch.softmax(torch.randn(5, generator=gen) * 2, dim=0)
    freq = _sample_first_token(p_logits, support, q, draws, seed)
    p = torch.softmax(p_logits[0], dim=0)
    chi2 = float(((freq - p) ** 2 / p).sum() * draws)
    # 11 degrees of freedom: the 99.9% quantile is 31.3.
    assert chi2 < 31.3, (chi2, freq, p)
    # And the test can fail: the draft's own distribution is far from p.
    q_dense = torch.zeros(vocab).index_put_((support,), q)
    assert float(((q_dense - p) ** 2 / p).sum() * draws) > 31.3


def test_rejection_sampling_with_top_p_matches_filtered_target():
    vocab, draws = 10, 6000
    gen = torch.Generator().manual_seed(7)
    p_logits = torch.randn(2, vocab, generator=gen) * 2
    cfg = SamplingConfig(temperature=0.8, top_p=0.8)
    support = torch.arange(vocab)
    q = probs_from_logits(p_logits[0] + torch.randn(vocab, generator=gen), cfg)
    counts = torch.zeros(vocab)
    for _ in range(draws):
        x = int(torch.multinomial(q, 1, generator=gen))
        verdict = verify_chain([step_of(x, support, q)], p_logits, cfg, gen)
        k, nxt = verdict.accepted, verdict.next_token
        counts[x if k == 1 else nxt] += 1
    p = probs_from_logits(p_logits[0], cfg)
    keep = p > 0
    assert counts[~keep].sum() == 0  # nothing outside the target's nucleus is ever emitted
    chi2 = float(((counts[keep] / draws - p[keep]) ** 2 / p[keep]).sum() * draws)
    assert chi2 < 30.0, chi2


def test_all_accepted_takes_bonus_from_last_position():
    p_logits = torch.full((2, 4), -30.0)
    p_logits[0, 1] = 10.0
    p_logits[1, 3] = 10.0
    step = step_of(1, torch.tensor([1, 2]), torch.tensor([1.0, 0.0]))
    verdict = verify_chain([step], p_logits, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert (verdict.path, verdict.next_token, verdict.tokens) == ([1], 3, (-1, 1))


# Chains of γ = 4 drafted tokens on an 8-token vocabulary: the emitted sequence must follow the target exactly.
VOCAB, GAMMA, BOS = 8, 4, 8  # row BOS of the tables is the distribution of the first token
CHAIN_DRAWS = 15_000  # the tables below need 14,341 for the power check (``detects_shift``)
SHIFT = 0.02  # the smallest absolute change of one cell's probability the test must detect
# Chi-square critical values at α = 1e-4 and the non-centrality a shift needs for power 0.99 there, both from
# scipy (not a dependency): chi2.ppf(1 - 1e-4, df) and the λ with ncx2.sf(critical, df, λ) = 0.99.
CRITICAL = {7: 29.88, 56: 104.13, 63: 113.50}
LAMBDA_FOR_POWER = {7: 53.5, 63: 99.7}


def chain_tables(seed: int = 3):
    """Target rows p(y | previous token) [9, V], and the draft's rows on their supports (some cut to 5 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(VOCAB + 1, VOCAB, generator=gen) * 1.2, dim=-1)  # [9, V]
    draft = torch.softmax(target.log() + 1.5 * torch.randn(VOCAB + 1, VOCAB, generator=gen), dim=-1)  # partly wrong
    rows = []
    for prev in range(VOCAB + 1):
        if prev % 3 == 0:  # full vocabulary (support None)
            rows.append((None, draft[prev]))
        else:  # an active set of 5 tokens: q = 0 on the other 3, whose mass only the residual can emit
            support = torch.randperm(VOCAB, generator=gen)[:5]
            q = draft[prev, support]
            rows.append((support, q / q.sum()))
    return target, rows


def sample_chain(target, rows, n_tokens: int, gen: torch.Generator, rng: random.Random,
                 bonus: torch.Tensor | None = None) -> list[int]:
    """Draft γ tokens from the draft rows (``rng``: faster than torch on 8 tokens), verify them against the target
    rows (``gen``); repeat until ``n_tokens`` are emitted. ``bonus`` [V, V] counts (last drafted, bonus token) of
    every cycle that accepted all γ."""
    cfg = SamplingConfig(temperature=1.0)
    emitted: list[int] = []
    while len(emitted) < n_tokens:
        prev = emitted[-1] if emitted else BOS
        steps, contexts = [], [prev]
        for _ in range(GAMMA):
            support, q = rows[contexts[-1]]
            ids = range(VOCAB) if support is None else support.tolist()
            token = rng.choices(ids, weights=q.tolist())[0]
            steps.append(step_of(token, support, q))
            contexts.append(token)
        target_logits = target[contexts].log()  # [γ+1, V]: row j conditions on the token before position j
        verdict = verify_chain(steps, target_logits, cfg, gen)
        k, nxt = verdict.accepted, verdict.next_token
        if bonus is not None and k == GAMMA:
            bonus[contexts[-1], nxt] += 1
        emitted += verdict.path + [nxt]
    return emitted[:n_tokens]


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's statistic of ``counts`` against the probabilities ``expected`` (same shape, all > 0)."""
    draws = float(counts.sum())
    return float(((counts - draws * expected) ** 2 / (draws * expected)).sum())


def detects_shift(expected: torch.Tensor, df: int) -> bool:
    """Power check: moving SHIFT of mass between the two likeliest cells (the hardest shift to see) gives
    non-centrality λ = N·SHIFT²·(1/p₁ + 1/p₂); λ ≥ LAMBDA_FOR_POWER[df] means it is caught with probability 0.99."""
    top = expected.flatten().topk(2).values
    return CHAIN_DRAWS * SHIFT**2 * float(1 / top[0] + 1 / top[1]) >= LAMBDA_FOR_POWER[df]


def test_rejection_sampling_chains_follow_the_target_joint_distribution(one_thread):
    """γ = 4 with a partly wrong draft on partial active sets: accept chains, residual resamples and bonus tokens
    together must emit (x₁, x₂) with probability p(x₁)·p(x₂ | x₁), x₄ with the target's 4-step marginal, and
    (x₅, x₆) (bonus tokens land at x₅) with p(x₅)·p(x₆ | x₅)."""
    target, rows = chain_tables()
    gen, rng = torch.Generator().manual_seed(11), random.Random(11)
    pairs = torch.zeros(VOCAB, VOCAB)
    fourth = torch.zeros(VOCAB)
    late_pairs = torch.zeros(VOCAB, VOCAB)  # (x₅, x₆): x₅ is the bonus token whenever the first cycle accepts all γ
    bonus = torch.zeros(VOCAB, VOCAB)  # (x_γ, bonus) over every fully accepted cycle
    for _ in range(CHAIN_DRAWS):
        x1, x2, _, x4, x5, x6 = sample_chain(target, rows, 6, gen, rng, bonus)
        pairs[x1, x2] += 1
        fourth[x4] += 1
        late_pairs[x5, x6] += 1
    first = target[BOS]  # [V]
    step = target[:VOCAB]  # [V, V] p(next | previous)
    fourth_marginal = first @ torch.linalg.matrix_power(step, 3)  # [V]
    fifth_marginal = fourth_marginal @ step  # [V]
    checks = {
        "first": (pairs.sum(1), first, 7),
        "pair": (pairs, first[:, None] * step, 63),  # p(x₁)·p(x₂ | x₁)
        "fourth": (fourth, fourth_marginal, 7),
        "late pair": (late_pairs, fifth_marginal[:, None] * step, 63),  # p(x₅)·p(x₆ | x₅)
    }
    for name, (counts, expected, df) in checks.items():
        assert detects_shift(expected, df), name
        stat = chi_square(counts, expected)
        assert stat < CRITICAL[df], f"{name}: chi-square {stat:.1f} >= {CRITICAL[df]} (df {df})"
    # The bonus after a fully accepted chain is drawn from the row after the last drafted token: p(· | x_γ).
    # Few cycles accept all γ here (about 6%, some 2,700 draws over 8 rows), so this conditional check is not sized
    # for a 2% shift; it catches a bonus drawn from the wrong row, which the unconditioned checks above dilute.
    seen = bonus.sum(1) > 0  # [V] rows with at least one bonus
    expected = bonus.sum(1, keepdim=True) * step  # [V, V] counts the target's rows predict
    stat = float(((bonus - expected)[seen] ** 2 / expected[seen]).sum())
    df = 7 * int(seen.sum())
    assert df == 56 and stat < CRITICAL[df], f"bonus: chi-square {stat:.1f} >= {CRITICAL[df]} (df {df})"
