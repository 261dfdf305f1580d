"""Verification of a draft against the target: :func:`verify` for greedy decoding (a draft tree, :mod:`.tree`)
and exact rejection sampling (a chain), one :class:`Verdict` either way. The drafted tokens stay on the device until
here: each verifier reads them back together with its decision, in the cycle's one read
(:func:`~dynvocab.runtime.host.to_host`).

Glossary (vLLM's rejection sampler): **accepted** tokens are the draft tokens the target kept; at the first
rejection the target's own token there is the **recovered** token; after a fully accepted draft the target's token
at the next position is the **bonus** token. Each cycle emits the accepted tokens plus one recovered or bonus token.

Notation follows Leviathan et al. (2023): ``p`` is the target distribution, ``q`` the draft's. The draft's
``q`` is only supported on its active vocabulary; tokens outside it have q = 0, so the residual
``norm(max(0, p - q))`` puts their full target mass back and the output distribution stays exactly ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dynvocab.runtime.host import to_host
from dynvocab.runtime.tree import DraftTree, TokenTree


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


@dataclass(frozen=True)
class Verdict:
    """What verification kept: the accepted draft tokens and the target's token after them (greedy or sampling)."""

    path: list[int]  # the accepted draft tokens: a chain prefix, possibly ending in a leaf
    next_token: int  # the target's token after the path: recovered (after a rejection) or bonus
    chain: list[int]  # the drafted chain, read back with the verdict
    leaf_row: int | None = None  # the accepted leaf's row in the pass, or None
    path_rows: tuple[int, ...] | None = None  # a TokenTree's verdict: the pass row of each accepted token

    @property
    def accepted(self) -> int:
        """How many draft tokens the target kept (an accepted leaf included)."""
        return len(self.path)

    @property
    def accepted_chain(self) -> int:
        """How many of the accepted tokens are chain tokens (``accepted`` less an accepted leaf; a
        :class:`~dynvocab.runtime.tree.TokenTree`'s whole path)."""
        return self.accepted - (self.leaf_row is not None)

    @property
    def rows(self) -> list[int]:
        """Logit rows along the path, the root's first: row i predicts ``path[i]``; the last one predicts
        ``next_token``."""
        if self.path_rows is not None:
            return [0, *self.path_rows]
        rows = list(range(self.accepted_chain + 1))
        return rows if self.leaf_row is None else rows + [self.leaf_row]


@dataclass
class DraftStep:
    """One drafted token, on the device, with the draft distribution it was sampled from (sparse: ``support``
    ids)."""

    token: torch.Tensor  # [1] the drafted target id
    support: torch.Tensor | None  # [n] token ids where q may be non-zero; None = full vocabulary
    q: torch.Tensor | None  # [n] (or [V]) draft probabilities; None when greedy


def verify_sampling(
    steps: list[DraftStep], target_logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator
) -> Verdict:
    """Exact rejection sampling: accept x_j with prob min(1, p(x_j)/q(x_j)); at the first rejection draw the
    recovered token from the residual ``norm(max(0, p - q))``, after full acceptance the bonus token from p.

    Computed on the device for every step at once and read to the host in one conversion, with the drafted
    tokens.

    Args:
        steps: the γ drafted tokens with their draft distributions.
        target_logits: [γ+1, V] target logits.
    Returns:
        the verdict: the accepted prefix of the chain and the recovered or bonus token after it.
    """
    p = probs_from_logits(target_logits, cfg)  # [γ+1, V]
    gamma, device = len(steps), p.device
    if gamma:
        q = torch.stack([_dense_q(step, p.shape[-1], device) for step in steps])  # [γ, V]
        rows = torch.arange(gamma, device=device)
        x = torch.cat([step.token for step in steps]).to(device)  # [γ]
        px, qx = p[rows, x], q[rows, x]  # [γ] each
        uniforms = torch.rand(gamma, generator=generator, device=device)
        kept = (qx > 0) & (uniforms * qx < px)  # [γ]
        accepted = kept.long().cumprod(0).sum().view(1)  # [1] the first rejection, or γ
        residual = (p[:gamma] - q).clamp_(min=0.0)  # [γ, V]
        total = residual.sum(dim=-1, keepdim=True)
        p = torch.cat([torch.where(total > 0, residual / total, p[:gamma]), p[gamma:]])  # [γ+1, V]: where to draw
    else:
        accepted = torch.zeros(1, dtype=torch.long, device=device)
    token = torch.multinomial(p.index_select(0, accepted), 1, generator=generator)[0]  # [1], no host index
    n, token, *chain = to_host(torch.cat([accepted, token, *(step.token.to(device) for step in steps)]))
    return Verdict(chain[:n], token, chain)


def _dense_q(step: DraftStep, vocab: int, device) -> torch.Tensor:
    """The draft distribution over the target's ``vocab`` ids [V]; support ids at or past ``vocab`` (a padded draft
    head) land in a spare slot that is dropped, so nothing waits on the device."""
    q = torch.zeros(vocab + 1, device=device)
    if step.support is None:
        n = min(step.q.numel(), vocab)
        q[:n] = step.q[:n]
    else:
        q[step.support.clamp(max=vocab)] = step.q.to(q.dtype)
    return q[:vocab]


def verify_tree_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    """Accept the longest chain prefix matching the target's argmax, then the leaf at the stopping depth if it
    matches; ``target_logits`` [n, V] are the rows of one pass over :meth:`DraftTree.inputs`. One host read
    brings back the target's argmax rows [n] and the drafted tokens (chain, leaves) together."""
    argmax, drafted = target_logits.argmax(dim=-1), tree.drafted()  # [n], chain + leaves × [1]
    values = to_host(torch.cat([argmax, *(t.to(argmax.device) for t in drafted)]) if drafted else argmax)
    n, gamma = target_logits.shape[0], len(tree.chain)
    choice, chain = values[:n], values[n : n + gamma]
    leaves = dict(zip(tree.depths, values[n + gamma :]))
    k = 0
    while k < gamma and chain[k] == choice[k]:
        k += 1
    leaf = leaves.get(k) if k < gamma else None
    if leaf is not None and leaf == choice[k]:
        row = tree.leaf_row(k)
        return Verdict(chain[:k] + [leaf], choice[row], chain, row)
    return Verdict(chain[:k], choice[k], chain)


def verify_token_tree(
    tree: TokenTree, target_logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator,
    proposals: Callable[[int], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
) -> Verdict:
    """Verify an EAGLE-2 tree against ``target_logits`` [n, V], the rows of one pass over its inputs, walking from
    the root child by child.

    Greedy: the child whose token is the target's argmax at its parent's row is accepted (one host read: the
    argmax of every row). Sampling: at each row, its children are tried in the order they were drawn, without
    replacement, from the draft's distribution ``q`` there (``proposals(row)``: probabilities [n] over ids [n],
    None: all ids), by recursive rejection sampling (Jeon et al. 2024, "Recursive Speculative Decoding"): child x
    is accepted with probability min(1, p(x)/q(x)); on rejection ``p <- norm(max(0, p - q))`` and x leaves ``q``
    (``q <- norm(q with q(x) = 0)``); with no child left, the token is drawn from ``p``. Exact for the target's
    distribution as long as which children a row keeps does not depend on the drawn tokens (the tree's shape under
    sampling is fixed by rank, :mod:`dynvocab.runtime.tree_draft`). One host read per child tried.
    """
    if cfg.greedy:
        choice = to_host(target_logits.argmax(dim=-1))
        row, rows = 0, []
        while True:
            child = next((c for c in tree.children[row] if tree.tokens[c] == choice[row]), None)
            if child is None:
                break
            rows.append(child)
            row = child
        return Verdict([tree.tokens[r] for r in rows], choice[row], _main_tokens(tree), path_rows=tuple(rows))
    row, rows = 0, []
    while True:
        p = probs_from_logits(target_logits[row], cfg)  # [V]
        accepted = None
        if tree.children[row]:
            probs, ids = proposals(row)
            q = _dense_q(DraftStep(None, ids, probs), p.shape[-1], p.device)  # [V]
            for child in tree.children[row]:
                x = tree.tokens[child]
                u = torch.rand(1, generator=generator, device=p.device)
                px, qx, ux = to_host(torch.cat([p[x : x + 1].double(), q[x : x + 1].double(), u.double()]))
                if qx > 0 and ux * qx < px:
                    accepted = child
                    break
                residual = (p - q).clamp_(min=0.0)
                total = residual.sum()
                p = torch.where(total > 0, residual / total.clamp(min=1e-30), p)
                q[x] = 0.0
                q = q / q.sum().clamp(min=1e-30)
        if accepted is None:
            token = to_host(torch.multinomial(p, 1, generator=generator))[0]
            return Verdict([tree.tokens[r] for r in rows], token, _main_tokens(tree), path_rows=tuple(rows))
        rows.append(accepted)
        row = accepted


def _main_tokens(tree: TokenTree) -> list[int]:
    """The tokens of the tree's main path (the draft's best child at each depth)."""
    return [tree.tokens[r] for r in tree.main]


def verify(
    tree: DraftTree, steps: list[DraftStep], target_logits: torch.Tensor, cfg: SamplingConfig,
    generator: torch.Generator,
) -> Verdict:
    """Verify one cycle's draft against ``target_logits`` [1 + chain + leaves, V] of one target pass: greedy walks
    the tree (:func:`verify_tree_greedy`), sampling runs exact rejection sampling over the chain's ``steps``. An
    EAGLE-2 :class:`~dynvocab.runtime.tree.TokenTree` is verified by :func:`verify_token_tree`."""
    if cfg.greedy:
        return verify_tree_greedy(tree, target_logits)
    return verify_sampling(steps, target_logits, cfg, generator)
