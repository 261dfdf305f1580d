"""Fitting the candidate selectors (``lowrank``, ``centroids``) on the router's teacher-forced data.

Both are initialised from the draft head's rows ``W`` [V, d] and then trained on the draft's own predictions (the
top-L ids of its full head at each position, :class:`~dynvocab.builders.router.data.RouterData`) to score the
units (ids, or blocks) that hold those predictions first: a softmax over all units, cross-entropy towards each of
the top-L ids' units, weighted 1/rank (the top-1 counts most: it is what the draft proposes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dynvocab.artifacts.selectors import CENTROIDS, LOWRANK, CentroidScorer, LowRankScorer
from dynvocab.builders.router.data import RouterData
from dynvocab.builders.router.fit import run_epochs
from dynvocab.progress import Advance

RECALL_TARGET = 0.99  # a selector's default budget: the smallest whose held-out top-1 recall reaches this
LOWRANK_BUDGETS = (256, 512, 1024, 2048, 4096, 8192, 16384)  # candidate ids reported
CENTROID_BUDGETS = (2, 4, 8, 16, 32, 64, 128)  # candidate blocks reported


@dataclass(frozen=True)
class SelectorConfig:
    """How the candidate selectors are built and trained."""

    rank: int = 256  # lowrank: r (SpecVocab: hidden / 8); held-out top-1 recall of the demo draft (24 training
    # documents) at 2,048 ids: rank 64 89.7%, 128 94.7%, 256 98.4%; at 8,192: 97.9% (128), 99.6% (256)
    block_size: int = 128  # centroids: ids per block (Gemma-4: V / 2,048)
    cluster_iters: int = 4  # centroids: rounds of balanced assignment and centroid update
    epochs: int = 4
    batch_size: int = 256
    lr: float = 2e-3  # Adam (AdamW without decay), cosine decay to 0
    positives: int = 4  # the draft's top-P ids each position trains towards (weighted 1/rank)
    seed: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def svd_init(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best rank-r factors of the head ``W`` [V, d]: ``(P [r, d], R [V, r])`` with ``R @ P`` = W's rank-r SVD
    truncation (the singular values split evenly between them), from the eigenvectors of ``WᵀW`` [d, d]."""
    w = weight.float()
    evals, evecs = torch.linalg.eigh(w.T @ w)  # ascending
    top = evecs[:, -rank:].flip(1)  # [d, r] right singular vectors, largest first
    sing = evals[-rank:].flip(0).clamp_min(1e-12).sqrt()  # [r]
    proj = (top * sing.sqrt()).T  # [r, d] = S^(1/2) Vᵀ
    rows = (w @ top) * sing.rsqrt()  # [V, r] = U S / S^(1/2)
    return proj.contiguous(), rows.contiguous()


def balanced_blocks(
    weight: torch.Tensor, block_size: int, iters: int = 4, seed: int = 0, advance: Advance = lambda n: None,
    candidates: int = 8, chunk: int = 8192,
) -> torch.Tensor:
    """Order the ids into blocks of ``block_size`` (the last one may be shorter) by balanced spherical clustering of
    the head's rows: each round scores every row against the block centroids, assigns rows best-first to the best
    of their ``candidates`` nearest blocks that still has room (the rest fill the blocks left open) and moves each
    centroid to its members' mean direction. Returns ``order`` [V]: ids grouped by block."""
    x = F.normalize(weight.float(), dim=1)  # [V, d]
    n = x.shape[0]
    blocks = -(-n // block_size)
    room0 = np.full(blocks, block_size, dtype=np.int64)
    room0[-1] = n - block_size * (blocks - 1)
    gen = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(n, generator=gen)[:blocks]]  # [B, d]
    assign = torch.zeros(n, dtype=torch.long)
    for _ in range(max(1, iters)):
        best = torch.empty(n)
        near = torch.empty(n, min(candidates, blocks), dtype=torch.long)
        for s in range(0, n, chunk):
            top = (x[s : s + chunk] @ centroids.T).topk(near.shape[1], dim=1)
            best[s : s + chunk], near[s : s + chunk] = top.values[:, 0], top.indices
        assign = torch.from_numpy(_assign_greedy(best.numpy(), near.numpy(), room0.copy()))
        sums = torch.zeros(blocks, x.shape[1]).index_add_(0, assign, x)
        centroids = F.normalize(sums, dim=1)
        advance(1)
    return torch.argsort(assign, stable=True)


def _assign_greedy(best: np.ndarray, near: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Rows in order of their best similarity take the first of their nearest blocks with room; rows left over
    fill the blocks with room left, in block order."""
    out = np.full(best.shape[0], -1, dtype=np.int64)
    for i in np.argsort(-best, kind="stable"):
        for b in near[i]:
            if room[b] > 0:
                room[b] -= 1
                out[i] = b
                break
    left = np.flatnonzero(out < 0)
    if left.size:
        out[left] = np.repeat(np.arange(room.size), room)[: left.size]
    return out


def block_of(order: torch.Tensor, block_size: int) -> torch.Tensor:
    """The block of each id [V] for ``order`` (ids grouped in blocks of ``block_size``)."""
    out = torch.empty_like(order)
    out[order] = torch.arange(order.numel()) // block_size
    return out


def centroid_init(weight: torch.Tensor, order: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each block's mean head row [B, d]: its score is the block's mean logit before training."""
    blocks = block_of(order, block_size)
    n_blocks = int(blocks.max()) + 1
    sums = torch.zeros(n_blocks, weight.shape[1]).index_add_(0, blocks, weight.float())
    return sums / torch.bincount(blocks, minlength=n_blocks).clamp_min(1)[:, None].float()


def units_of(kind: str, top: torch.Tensor, unit: torch.Tensor | None) -> torch.Tensor:
    """The scored units holding ids ``top`` [n, L]: the ids themselves (lowrank) or their blocks (``unit`` [V])."""
    return top if kind == LOWRANK else unit[top]


def selector_loss(scores: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``-Σ_j w_j log softmax(scores)[positives_j]`` with ``w_j ∝ 1/(j+1)`` (sum 1)."""
    logp = scores.log_softmax(dim=-1)  # [n, U]
    w = 1.0 / torch.arange(1, positives.shape[1] + 1, dtype=torch.float32)
    return -(logp.gather(1, positives) * (w / w.sum())).sum(1).mean()


def fit(
    kind: str, scorer: LowRankScorer | CentroidScorer, cfg: SelectorConfig, data: RouterData,
    unit: torch.Tensor | None = None, advance: Advance = lambda n: None,
) -> list[float]:
    """Train ``scorer`` in place on ``data`` (``unit`` [V]: the block of each id, centroids only); returns the mean
    loss of each epoch and leaves the scorer in eval mode.

    The low-rank scorer trains its query projection only: its token factors (and bias) stay the SVD's. Trained
    too, the V × r factors fit the training documents and lost the tokens they never saw as positives — held-out
    content words: on the demo draft (24 training documents, rank 128) top-1 recall at 2,048 ids was 86.2% with
    every parameter trained, 94.7% with the projection alone, 84.3% untrained (training positions: 100% / 97.5%)."""
    torch.manual_seed(cfg.seed)
    if kind == LOWRANK:
        scorer.rows.requires_grad_(False)
        scorer.bias.requires_grad_(False)
    positives = min(cfg.positives, data.top.shape[1])

    def loss_of(rows: torch.Tensor) -> torch.Tensor:
        return selector_loss(scorer(data.hidden[rows]), units_of(kind, data.top[rows, :positives], unit))

    scorer.train()
    losses = run_epochs([p for p in scorer.parameters() if p.requires_grad], cfg.lr, 0.0, cfg.epochs,
                        cfg.batch_size, data.rows, cfg.seed, loss_of, advance)
    scorer.eval()
    return losses


@torch.no_grad()
def recall(
    kind: str, scorer: LowRankScorer | CentroidScorer, data: RouterData, budgets: tuple[int, ...],
    unit: torch.Tensor | None = None, sizes: torch.Tensor | None = None, chunk: int = 1024,
) -> dict:
    """Held-out recall per budget (candidate ids for lowrank, blocks for centroids): ``top1_recall`` (rows whose
    full-head argmax is a candidate), ``top2_recall`` (rows whose top-2 both are), ``ids`` (candidate ids; for
    centroids the mean size of the chosen blocks, ``sizes`` [B])."""
    units = scorer.units
    fixed = {b for b in budgets if b < units}
    if len(fixed) < 3:  # a small vocabulary: report fractions of it as well
        fixed |= {max(1, units >> i) for i in range(5, 0, -1)}
    budgets = tuple(sorted(fixed))
    top1 = dict.fromkeys(budgets, 0.0)
    top2 = dict.fromkeys(budgets, 0.0)
    ids = dict.fromkeys(budgets, 0.0)
    for rows in torch.arange(data.rows).split(chunk):
        ranked = scorer(data.hidden[rows]).topk(max(budgets), dim=-1).indices  # [n, k_max], best first
        want = units_of(kind, data.top[rows, :2], unit)  # [n, 2]
        rank = torch.full(want.shape, units, dtype=torch.long)  # where each wanted unit sits in the ranking
        hit = ranked[:, :, None] == want[:, None, :]  # [n, k_max, 2]
        found = hit.any(1)
        rank[found] = hit.float().argmax(1)[found]
        for b in budgets:
            inside = rank < b
            top1[b] += float(inside[:, 0].sum())
            top2[b] += float(inside.all(1).sum())
            ids[b] += b * rows.numel() if sizes is None else float(sizes[ranked[:, :b]].sum())
    n = data.rows
    return {str(b): {"top1_recall": top1[b] / n, "top2_recall": top2[b] / n, "ids": ids[b] / n} for b in budgets}


def default_budget(report: dict, target: float = RECALL_TARGET) -> int:
    """The smallest budget of ``report`` (:func:`recall`) whose top-1 recall reaches ``target``, else the largest."""
    budgets = sorted(int(b) for b in report)
    return next((b for b in budgets if report[str(b)]["top1_recall"] >= target), budgets[-1])


__all__ = [
    "CENTROIDS", "CENTROID_BUDGETS", "LOWRANK", "LOWRANK_BUDGETS", "RECALL_TARGET", "SelectorConfig",
    "balanced_blocks", "block_of", "centroid_init", "default_budget", "fit", "recall", "svd_init",
]
