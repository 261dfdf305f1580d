"""Verification of a draft against the target: :func:`verify` for greedy decoding (a draft tree, :mod:`.tree`)
and exact rejection sampling (a chain), one :class:`Verdict` either way.

Notation follows Leviathan et al. (2023): ``p`` is the target distribution, ``q`` the draft's. The draft's
``q`` is only supported on its active vocabulary; tokens outside it have q = 0, so the residual
``norm(max(0, p - q))`` puts their full target mass back and the output distribution stays exactly ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvocab.runtime.tree import DraftTree


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


@dataclass(frozen=True)
class Verdict:
    """What verification kept: the accepted path, the next token and where they came from (greedy or sampling)."""

    path: list[int]  # accepted draft tokens: a chain prefix, possibly ending in a leaf
    next_token: int  # the target's token after the path (correction or bonus)
    chain_accepted: int  # chain tokens in ``path``
    leaf_row: int | None = None  # the accepted leaf's row in the pass, or None

    @property
    def rows(self) -> list[int]:
        """Logit rows along the path: row i predicts ``path[i]``; the last one predicts ``next_token``."""
        rows = list(range(self.chain_accepted + 1))
        return rows if self.leaf_row is None else rows + [self.leaf_row]


def verify_tree_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    """Accept the longest chain prefix matching the target's argmax, then the leaf at the stopping depth if it
    matches; ``target_logits`` [n, V] are the rows of one pass over :meth:`DraftTree.inputs`."""
    choice = target_logits.argmax(dim=-1).tolist()
    k = 0
    while k < len(tree.chain) and tree.chain[k] == choice[k]:
        k += 1
    leaf = tree.leaves.get(k) if k < len(tree.chain) else None
    if leaf is not None and leaf == choice[k]:
        row = tree.leaf_row(k)
        return Verdict(tree.chain[:k] + [leaf], choice[row], k, row)
    return Verdict(tree.chain[:k], choice[k], k)


def verify(
    tree: DraftTree, steps: list[DraftStep], target_logits: torch.Tensor, cfg: SamplingConfig,
    generator: torch.Generator,
) -> Verdict:
    """Verify one cycle's draft against ``target_logits`` [1 + chain + leaves, V] of one target pass: greedy walks
    the tree (:func:`verify_tree_greedy`), sampling runs exact rejection sampling over the chain's ``steps``."""
    if cfg.greedy:
        return verify_tree_greedy(tree, target_logits)
    k, token = verify_sampling(steps, target_logits, cfg, generator)
    return Verdict(tree.chain[:k], token, k)
