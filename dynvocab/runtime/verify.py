"""Verification of a drafted chain against the target by exact rejection sampling (greedy: :mod:`.tree`).

Notation follows Leviathan et al. (2023): ``p`` is the target distribution, ``q`` the draft's. The draft's
``q`` is only supported on its active vocabulary; tokens outside it have q = 0, so the residual
``norm(max(0, p - q))`` puts their full target mass back and the output distribution stays exactly ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen: ``temperature == 0`` is greedy; ``top_p < 1`` keeps the nucleus only."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        """True at temperature 0."""
        return self.temperature <= 0.0


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Softmax at ``cfg.temperature`` with top-p filtering, over the last dim; float32."""
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly ahead of each token
        sorted_p = sorted_p.masked_fill(before >= cfg.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


@dataclass
class DraftStep:
    """One drafted token with the draft distribution it was sampled from (sparse: ``support`` ids)."""

    token: int
    support: torch.Tensor | None  # [n] token ids where q may be non-zero; None = full vocabulary
    q: torch.Tensor | None  # [n] (or [V]) draft probabilities; None when greedy


def verify_sampling(
    steps: list[DraftStep], target_logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator
) -> tuple[int, int]:
    """Exact rejection sampling: accept x_j with prob min(1, p(x_j)/q(x_j)); on rejection resample.

    Args:
        steps: the γ drafted tokens with their draft distributions.
        target_logits: [γ+1, V] target logits.
    Returns:
        (number accepted k, the token emitted at position k: a resample from the residual, or a bonus from p).
    """
    p = probs_from_logits(target_logits, cfg)  # [γ+1, V]
    device = p.device
    uniforms = torch.rand(len(steps), generator=generator, device=device).tolist() if steps else []
    for j, step in enumerate(steps):
        q_all = _dense_q(step, p.shape[-1], device)  # [V]
        x = step.token
        px, qx = float(p[j, x]), float(q_all[x])
        if qx > 0 and uniforms[j] * qx < px:
            continue
        residual = (p[j] - q_all).clamp_(min=0.0)
        total = residual.sum()
        dist = residual / total if total > 0 else p[j]
        return j, int(torch.multinomial(dist, 1, generator=generator))
    return len(steps), int(torch.multinomial(p[len(steps)], 1, generator=generator))


def _dense_q(step: DraftStep, vocab: int, device) -> torch.Tensor:
    q = torch.zeros(vocab, device=device)
    if step.support is None:
        n = min(step.q.numel(), vocab)
        q[:n] = step.q[:n]
    else:
        keep = step.support < vocab
        q[step.support[keep]] = step.q[keep]
    return q
