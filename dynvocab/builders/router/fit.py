"""Fitting the router: multi-hot cluster labels, DynaSpec's BCE loss, the training loop (DynaSpec §4.2)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from dynvocab.artifacts.router import DEFAULT_K_MAX, DEFAULT_TOP_L, RouterMLP
from dynvocab.builders.router.data import RouterData
from dynvocab.progress import Advance


@dataclass(frozen=True)
class RouterConfig:
    """How the router is trained. Defaults: ~30k positions (160 documents × 192 tokens) of the 0.5B demo draft,
    whose float32 data pass dominates (~1 GFLOP per position) and takes 10–30 min on a shared 2-core CPU;
    8 epochs of a 1024-wide MLP take 1–3 min. Recall still grows with more data (--max-docs)."""

    top_l: int = DEFAULT_TOP_L  # positives: the draft's top-L tokens at each position
    width: int = 1024  # hidden units of the one-hidden-layer MLP
    epochs: int = 8
    batch_size: int = 256
    lr: float = 1e-3  # AdamW, cosine decay to 0
    weight_decay: float = 1e-4
    max_tokens: int = 192  # tokens per document (chat-template encoded for ShareGPT)
    holdout_every: int = 10  # every n-th document is held out for the recall report
    k_max: int = DEFAULT_K_MAX  # the budget whose recall is the headline figure
    seed: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def labels(top: torch.Tensor, assign: torch.Tensor, num_clusters: int) -> torch.Tensor:
    """Multi-hot cluster labels [n, M]: y_m = 1 iff cluster m holds one of the row's top-L tokens."""
    y = torch.zeros(top.shape[0], num_clusters)
    return y.scatter_(1, assign[top], 1.0)


def positive_counts(data: RouterData, assign: torch.Tensor, num_clusters: int, chunk: int = 8192) -> torch.Tensor:
    """Rows in which each cluster is positive, [M] float."""
    counts = torch.zeros(num_clusters)
    for s in range(0, data.rows, chunk):
        counts += labels(data.top[s : s + chunk], assign, num_clusters).sum(0)
    return counts


def inputs(data: RouterData, rows: torch.Tensor, embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's two inputs at ``rows``: the draft's hidden state and the fed token's embedding."""
    return data.hidden[rows].float(), embedding[data.tokens[rows]].float()  # [n, d_h], [n, d_e]


def input_stats(data: RouterData, embedding: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and std [D] of ``concat[h, E(x)]`` over the rows of ``data``."""
    total = sq = None
    for s in range(0, data.rows, chunk):
        h, e = inputs(data, torch.arange(s, min(s + chunk, data.rows)), embedding)
        x = torch.cat([h, e], dim=-1).double()
        total = x.sum(0) if total is None else total + x.sum(0)
        sq = (x * x).sum(0) if sq is None else sq + (x * x).sum(0)
    mean = total / data.rows
    std = (sq / data.rows - mean * mean).clamp_min(0).sqrt()
    return mean.float(), std.float()


def bce_loss(
    module: RouterMLP, data: RouterData, rows: torch.Tensor, embedding: torch.Tensor, assign: torch.Tensor
) -> torch.Tensor:
    """DynaSpec's router loss on ``rows``: BCE summed over the M clusters, averaged over rows."""
    h, e = inputs(data, rows, embedding)
    y = labels(data.top[rows], assign, module.num_clusters)  # [n, M]
    return F.binary_cross_entropy_with_logits(module(h, e), y, reduction="sum") / rows.numel()


@torch.no_grad()
def mean_loss(
    module: RouterMLP, data: RouterData, embedding: torch.Tensor, assign: torch.Tensor, chunk: int = 4096
) -> float:
    """:func:`bce_loss` over all rows of ``data``."""
    chunks = torch.arange(data.rows).split(chunk)
    return sum(float(bce_loss(module, data, rows, embedding, assign)) * rows.numel() for rows in chunks) / data.rows


def train(
    cfg: RouterConfig, data: RouterData, embedding: torch.Tensor, assign: torch.Tensor, num_clusters: int,
    advance: Advance = lambda n: None,
) -> tuple[RouterMLP, list[float]]:
    """Fit the router on ``data``; returns the module (eval mode) and the mean loss of each epoch.

    ``embedding`` [V, d_e] is the draft's input embedding, ``assign`` [V] the cluster of each token id.
    """
    torch.manual_seed(cfg.seed)
    module = RouterMLP(data.hidden.shape[1], embedding.shape[1], cfg.width, num_clusters)
    module.set_input_stats(*input_stats(data, embedding))
    with torch.no_grad():  # start from the clusters' prior positive rate: the first steps learn context, not base rates
        rate = (positive_counts(data, assign, num_clusters) / data.rows).clamp(1e-6, 1 - 1e-6)
        module.fc2.bias.copy_(torch.log(rate / (1 - rate)))
    module.train()
    losses = run_epochs(module.parameters(), cfg.lr, cfg.weight_decay, cfg.epochs, cfg.batch_size, data.rows,
                        cfg.seed, lambda rows: bce_loss(module, data, rows, embedding, assign), advance)
    return module.eval(), losses


def run_epochs(
    parameters, lr: float, weight_decay: float, epochs: int, batch_size: int, rows: int, seed: int,
    loss_of: Callable[[torch.Tensor], torch.Tensor], advance: Advance = lambda n: None,
) -> list[float]:
    """AdamW with cosine decay to 0 over ``epochs`` shuffled passes of ``rows`` rows in batches; ``loss_of(batch
    row indices)`` is a batch's mean loss. Returns the mean loss of each epoch."""
    opt = torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * math.ceil(rows / batch_size)))
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for batch in torch.randperm(rows, generator=gen).split(batch_size):
            loss = loss_of(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * batch.numel()
            advance(1)
        losses.append(total / rows)
    return losses
