"""The exactness checks of sampled decoding shared by the loop tests: the first token sampled over many seeds against
the target's own distribution (Pearson's chi-square), and the first two, whose second a tree of depth 2 or more
drafts (the second against the target's distribution after the first).

Import them into a test module with ``from sampling_checks import first_tokens_follow_the_target``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from dynvocab.runtime.decoding.loop import DecodeConfig, Generation, speculative_generate
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.selection.base import VocabPolicy
from dynvocab.runtime.trees.verify import probs_from_logits


def pooled_chi_square(counts: torch.Tensor, p: torch.Tensor, draws: int) -> tuple[float, int]:
    """Pearson's chi-square of ``counts`` [V] against ``draws`` × ``p`` [V], the tail pooled into one bin so every
    expected count is >= 5 (no tail bin where the tail is empty, expected and observed): (statistic, degrees of
    freedom)."""
    order = p.argsort(descending=True)
    big = order[p[order] * draws >= 5]
    rest = ~torch.isin(torch.arange(p.numel()), big)
    observed = torch.cat([counts[big], counts[rest].sum(0, keepdim=True)])
    expected = torch.cat([p[big], p[rest].sum(0, keepdim=True)]) * draws
    if observed[-1] == 0 and expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(((observed - expected) ** 2 / expected).sum()), observed.numel() - 1


def first_tokens_follow_the_target(
    target: CausalLM,
    prompt: list[int],
    cfg: DecodeConfig,
    draft=None,
    policy: Callable[[], VocabPolicy] | None = None,
    draws: int = 400,
) -> list[Generation]:
    """Decode ``prompt`` with ``cfg`` once for each seed 0 … ``draws`` - 1 (``policy``: makes each run's policy) and
    assert that the first tokens follow the target's distribution at ``cfg``'s sampling settings (chi-square within
    four standard deviations of its degrees of freedom); returns the generations, for checks of their own."""
    p, runs = _seeded_runs(target, prompt, cfg, draft, policy, draws)
    counts = torch.bincount(torch.tensor([g.token_ids[0] for g in runs]), minlength=p.numel()).float()
    chi2, dof = pooled_chi_square(counts, p, draws)
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)
    return runs


def _seeded_runs(target: CausalLM, prompt: list[int], cfg: DecodeConfig, draft, policy, draws: int,
                 **generate) -> tuple[torch.Tensor, list[Generation]]:
    """The target's next-token distribution after ``prompt`` at ``cfg``'s sampling settings, and one decoding per
    seed 0 … ``draws`` - 1 (``policy``: makes each run's policy; ``generate``: more keywords of
    ``speculative_generate``)."""
    with torch.no_grad():
        p = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1].float(), cfg.sampling)
    return p, [speculative_generate(target, prompt, replace(cfg, seed=seed), set(), draft, policy and policy(),
                                    **generate) for seed in range(draws)]


def first_pairs_follow_the_target(target: CausalLM, prompt: list[int], cfg: DecodeConfig, draft=None,
                                  policy: Callable[[], VocabPolicy] | None = None, draws: int = 400,
                                  **generate) -> list[Generation]:
    """Decode ``prompt`` with ``cfg`` (at least 2 new tokens) once for each seed 0 … ``draws`` - 1, as
    :func:`first_tokens_follow_the_target` does (``generate``: more keywords of ``speculative_generate``), and assert
    that the first tokens follow the target's distribution and the second ones its distribution after each first
    one (the chi-squares of the runs grouped by their first token, summed with their degrees of freedom, within four
    standard deviations); returns the generations."""
    p, runs = _seeded_runs(target, prompt, cfg, draft, policy, draws, **generate)
    firsts = torch.tensor([g.token_ids[0] for g in runs])
    chi2, dof = pooled_chi_square(torch.bincount(firsts, minlength=p.numel()).float(), p, draws)
    for first in firsts.unique().tolist():
        seconds = torch.tensor([g.token_ids[1] for g in runs if g.token_ids[0] == first])
        with torch.no_grad():
            after = target.model(torch.tensor([prompt + [first]])).logits[0, -1].float()
        stat, df = pooled_chi_square(torch.bincount(seconds, minlength=p.numel()).float(),
                                     probs_from_logits(after, cfg.sampling), seconds.numel())
        chi2, dof = chi2 + stat, dof + df
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)
    return runs
