"""The exactness check of sampled decoding shared by the loop tests: the first token sampled over many seeds against
the target's own distribution (Pearson's chi-square).

Import it into a test module with ``from sampling_checks import first_tokens_follow_the_target``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from dynvocab.runtime.lm import CausalLM
from dynvocab.runtime.loop import DecodeConfig, Generation, speculative_generate
from dynvocab.runtime.policies.base import VocabPolicy
from dynvocab.runtime.verify import probs_from_logits


def pooled_chi_square(counts: torch.Tensor, p: torch.Tensor, draws: int) -> tuple[float, int]:
    """Pearson's chi-square of ``counts`` [V] against ``draws`` × ``p`` [V], the tail pooled into one bin so every
    expected count is >= 5: (statistic, degrees of freedom)."""
    order = p.argsort(descending=True)
    big = order[p[order] * draws >= 5]
    rest = ~torch.isin(torch.arange(p.numel()), big)
    observed = torch.cat([counts[big], counts[rest].sum(0, keepdim=True)])
    expected = torch.cat([p[big], p[rest].sum(0, keepdim=True)]) * draws
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
    with torch.no_grad():
        p = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1].float(), cfg.sampling)
    counts = torch.zeros(p.numel())
    generations = []
    for seed in range(draws):
        g = speculative_generate(target, prompt, replace(cfg, seed=seed), set(), draft, policy and policy())
        counts[g.token_ids[0]] += 1
        generations.append(g)
    chi2, dof = pooled_chi_square(counts, p, draws)
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)
    return generations
