"""Verification of a draft tree (:class:`~dynvocab.runtime.trees.tree.DraftTree`, a chain being a tree of one path)
against the target: :func:`verify_greedy` at temperature 0, :func:`verify_sampled` (exact rejection sampling)
otherwise, one :class:`Verdict` either way. The drafted tokens stay on the device until here: each verifier reads
them back together with its decision, in the cycle's one read (:func:`~dynvocab.runtime.host.to_host`).

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
from dynvocab.runtime.trees.tree import DraftTree


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


Proposals = Callable[[int], tuple[torch.Tensor, torch.Tensor | None]]  # row -> the draft's q [n] over ids [n]


@dataclass(frozen=True)
class Verdict:
    """What verification kept of a :class:`~dynvocab.runtime.trees.tree.DraftTree`: the accepted path and the target's
    token after it (recovered after a rejection, or bonus), with the drafted tokens read back in the same read."""

    path: list[int]  # the accepted draft tokens, from the root's child down
    next_token: int  # the target's token after the path: recovered (after a rejection) or bonus
    path_rows: tuple[int, ...]  # the pass row of each accepted token
    tokens: tuple[int, ...]  # every row's token, read back with the verdict (the root's: -1)
    on_main: int  # how many accepted tokens lie on the tree's main path (a chain draft's own tokens)

    @property
    def accepted(self) -> int:
        """How many draft tokens the target kept."""
        return len(self.path)

    @property
    def rows(self) -> list[int]:
        """Logit rows along the path, the root's first: row i predicts ``path[i]``; the last one predicts
        ``next_token``."""
        return [0, *self.path_rows]


@dataclass
class DraftStep:
    """One drafted token, on the device, with the draft distribution it was sampled from (sparse: ``support``
    ids)."""

    token: torch.Tensor  # [1] the drafted target id
    support: torch.Tensor | None  # [n] token ids where q may be non-zero; None = full vocabulary
    q: torch.Tensor | None  # [n] (or [V]) draft probabilities; None when greedy


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    """Walk ``tree`` from the root: the child whose token is the target's argmax at its parent's row is accepted
    (siblings in drafting order); ``target_logits`` [n, V] are the rows of one pass over its inputs. One host read
    brings back the target's argmax rows and the drafted tokens together."""
    n = tree.size
    values = to_host(torch.cat([target_logits.argmax(dim=-1), tree.tokens.to(target_logits.device)]))
    choice, tokens = values[:n], (-1, *values[n:])
    row, rows = 0, []
    while (child := next((c for c in tree.children[row] if tokens[c] == choice[row]), None)) is not None:
        rows.append(child)
        row = child
    return _verdict(tree, rows, choice[row], tokens)


def verify_sampled(
    tree: DraftTree, target_logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator,
    proposals: Proposals,
) -> Verdict:
    """Exact sampling from the target over ``tree`` (Leviathan et al. 2023 for a chain; recursive rejection
    sampling, Jeon et al. 2024, for siblings): at each row its children are tried in the order they were drawn,
    without replacement, from the draft's ``q`` there (``proposals(row)``: probabilities [n] over ids [n], None: all
    ids). Child x is accepted with probability min(1, p(x)/q(x)); on rejection ``p <- norm(max(0, p - q))`` and x
    leaves ``q`` (``q <- norm(q with q(x) = 0)``); with no child left, the token is drawn from ``p``. Exact for the
    target's distribution as long as which children a row keeps does not depend on the drawn tokens (a sampled
    tree's shape is fixed by rank, :mod:`dynvocab.runtime.trees.growth`).

    Every row's first child is decided at once on the device, with the draw where the walk down first children
    would end: a chain reads the host once, with its tokens. A row whose first child was rejected tries its other
    children one read each; a walk that left the first children draws its last token with one more read."""
    p = probs_from_logits(target_logits, cfg)  # [n, V]
    n, device = tree.size, p.device
    inner = [row for row in range(n) if tree.children[row]]  # rows with children
    slot = {row: i for i, row in enumerate(inner)}
    firsts = [0]  # the walk down first children
    while tree.children[firsts[-1]]:
        firsts.append(tree.children[firsts[-1]][0])
    tokens = tree.tokens.to(device)
    kept = torch.zeros(0, dtype=torch.long, device=device)
    end = p[firsts[-1]].unsqueeze(0)  # [1, V]: no child rejected down first children
    if inner:
        q = torch.stack([_dense_q(*proposals(row), p.shape[-1], device) for row in inner])  # [m, V]
        x = tokens[torch.tensor([tree.children[row][0] - 1 for row in inner], device=device)]  # [m] first children
        px, qx = p[torch.tensor(inner, device=device), x], q[torch.arange(len(inner), device=device), x]
        u = torch.rand(len(inner), generator=generator, device=device)
        kept = ((qx > 0) & (u * qx < px)).long()  # [m]
        down = torch.tensor([slot[row] for row in firsts[:-1]] + [0], device=device)  # slots down first children
        stop = kept.index_select(0, down[:-1]).cumprod(0).sum().view(1)  # [1] the first rejection there
        p_stop = p.index_select(0, torch.tensor(firsts, device=device).index_select(0, stop))  # [1, V]
        q_stop = q.index_select(0, down.index_select(0, stop)) * (stop < len(firsts) - 1)  # [1, V]; 0 at the end
        end = _residual(p_stop, q_stop)
    draw = torch.multinomial(end, 1, generator=generator)[0]  # [1]
    values = to_host(torch.cat([kept, draw, tokens]))
    m = len(inner)
    first_kept, drawn, tokens_host = values[:m], values[m], (-1, *values[m + 1 :])
    row, rows, down_firsts = 0, [], True
    while True:
        kids = tree.children[row]
        if kids and first_kept[slot[row]]:
            child = kids[0]
        elif len(kids) > 1:
            i = slot[row]
            child, token = _later_siblings(kids[1:], tokens_host, _residual(p[row], q[i]), q[i], x[i], generator)
            if child is None:
                return _verdict(tree, rows, token, tokens_host)
            down_firsts = False
        else:
            if not down_firsts:
                last = _residual(p[row], q[slot[row]]) if kids else p[row]
                drawn = to_host(torch.multinomial(last, 1, generator=generator))[0]
            return _verdict(tree, rows, drawn, tokens_host)
        rows.append(child)
        row = child


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` over the last dim, or ``p`` where nothing is left."""
    residual = (p - q).clamp_(min=0.0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=1e-30), p)


def _later_siblings(kids, tokens: tuple[int, ...], p: torch.Tensor, q: torch.Tensor, first: torch.Tensor,
                    generator: torch.Generator) -> tuple[int | None, int | None]:
    """Recursive rejection sampling past a rejected first child ``first`` [], from the residual ``p`` [V] it left:
    (the accepted child's row, None), or (None, the token drawn once every child was rejected). One read a child."""
    q = q.index_fill(0, first.view(1), 0.0)
    q = q / q.sum().clamp(min=1e-30)
    for child in kids:
        x = tokens[child]
        u = torch.rand(1, generator=generator, device=p.device)
        px, qx, ux = to_host(torch.cat([p[x : x + 1].double(), q[x : x + 1].double(), u.double()]))
        if qx > 0 and ux * qx < px:
            return child, None
        p = _residual(p, q)
        q[x] = 0.0
        q = q / q.sum().clamp(min=1e-30)
    return None, to_host(torch.multinomial(p, 1, generator=generator))[0]


def _verdict(tree: DraftTree, rows: list[int], token: int, tokens: tuple[int, ...]) -> Verdict:
    """The verdict of a walk that accepted ``rows`` and ended with ``token``."""
    return Verdict([tokens[r] for r in rows], token, tuple(rows), tokens, tree.on_main(rows))


def _dense_q(probs: torch.Tensor, support: torch.Tensor | None, vocab: int, device) -> torch.Tensor:
    """The draft distribution ``probs`` over ``support`` ids (None: ids 0..) as a dense [V] over the target's
    ``vocab`` ids; support ids at or past ``vocab`` (a padded draft head) land in a spare slot that is dropped, so
    nothing waits on the device."""
    q = torch.zeros(vocab + 1, device=device)
    if support is None:
        n = min(probs.numel(), vocab)
        q[:n] = probs[:n]
    else:
        q[support.to(device).clamp(max=vocab)] = probs.to(device, q.dtype)
    return q[:vocab]


def verify(tree: DraftTree, target_logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator,
           proposals: Proposals | None = None) -> Verdict:
    """Verify one cycle's draft against ``target_logits`` [n, V], the rows of one target pass over its inputs:
    :func:`verify_greedy` at temperature 0, else :func:`verify_sampled` with the draft's ``proposals``."""
    if cfg.greedy:
        return verify_greedy(tree, target_logits)
    return verify_sampled(tree, target_logits, cfg, generator, proposals)
