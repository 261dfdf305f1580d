"""Verification: greedy on hand-built logits; rejection sampling reproduces the target distribution."""

from __future__ import annotations

import pytest
import torch

from dynvocab.runtime.tree import DraftTree, verify_tree_greedy
from dynvocab.runtime.verify import DraftStep, SamplingConfig, probs_from_logits, verify_sampling


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
    verdict = verify_tree_greedy(DraftTree(draft, {}), onehot_logits(target))
    assert (len(verdict.path), verdict.next_token) == expected
    assert verdict.path == draft[: expected[0]] and verdict.leaf_row is None


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    assert probs[2] == 0 and probs[3] == 0
    torch.testing.assert_close(probs[:2], torch.tensor([0.625, 0.375]))


def _sample_first_token(p_logits, q_support, q_probs, draws, seed):
    """Draw the first emitted token many times: draft samples from q on its support, target verifies."""
    gen = torch.Generator().manual_seed(seed)
    cfg = SamplingConfig(temperature=1.0)
    counts = torch.zeros(p_logits.shape[-1])
    for _ in range(draws):
        x = int(q_support[torch.multinomial(q_probs, 1, generator=gen)])
        step = DraftStep(x, q_support, q_probs)
        k, nxt = verify_sampling([step], p_logits, cfg, gen)
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
        k, nxt = verify_sampling([DraftStep(x, support, q)], p_logits, cfg, gen)
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
    step = DraftStep(1, torch.tensor([1, 2]), torch.tensor([1.0, 0.0]))
    k, nxt = verify_sampling([step], p_logits, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert (k, nxt) == (1, 3)


def _chi2(freq: torch.Tensor, p: torch.Tensor, n: int) -> float:
    return float(((freq - p) ** 2 / p).sum() * n)


def test_rejection_sampling_follows_the_target_at_every_position_of_a_long_draft():
    """γ = 3 on a 5-token vocabulary: every emitted position follows the target, and a 2% shift would show.

    The target is context-free (row j of ``p_logits`` at position j), so the token emitted at position j, given
    that the cycle reached j, must follow softmax(row j). Each draft step samples from its own q, one of which
    misses target tokens entirely, so both the accept test and the residual ``norm(max(0, p − q))`` are used.
    """
    vocab, gamma, draws = 5, 3, 20000
    gen = torch.Generator().manual_seed(7)
    cfg = SamplingConfig(temperature=1.0)
    p_logits = torch.randn(gamma + 1, vocab, generator=gen)  # [γ+1, V]
    p = torch.softmax(p_logits, dim=-1)  # [γ+1, V]
    qs = torch.softmax(torch.randn(gamma, vocab, generator=gen) * 1.5, dim=-1)  # [γ, V]
    supports = [torch.arange(vocab), torch.tensor([0, 2, 4]), torch.arange(vocab)]
    qs = [qs[j, s] / qs[j, s].sum() for j, s in enumerate(supports)]
    counts = torch.zeros(gamma + 1, vocab)
    drafted = torch.stack(
        [supports[j][torch.multinomial(qs[j], draws, replacement=True, generator=gen)] for j in range(gamma)], dim=1
    ).tolist()  # [draws, γ]
    for tokens in drafted:
        steps = [DraftStep(x, supports[j], qs[j]) for j, x in enumerate(tokens)]
        k, nxt = verify_sampling(steps, p_logits, cfg, gen)
        for j in range(k):
            counts[j, steps[j].token] += 1
        counts[k, nxt] += 1
    crit = 18.47  # chi-square, 4 degrees of freedom, 99.9% quantile
    for j in range(gamma + 1):
        n = int(counts[j].sum())
        freq = counts[j] / n
        assert _chi2(freq, p[j], n) < crit, (j, n, freq, p[j])
        if j == 0:  # every cycle reaches position 0: enough draws to see a 2% shift of any token
            for t in range(vocab):
                shifted = p[j] * (1 - 0.02 / (1 - p[j, t]))
                shifted[t] = p[j, t] + 0.02
                assert _chi2(freq, shifted, n) > crit, (t, freq, shifted)
