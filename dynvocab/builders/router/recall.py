"""Held-out recall of the router's top-k clusters: what the runtime will see at each cluster budget."""

from __future__ import annotations

import torch

from dynvocab.artifacts.router import RouterMLP
from dynvocab.budget import pa_budget
from dynvocab.builders.router.data import RouterData
from dynvocab.builders.router.fit import inputs, labels

REPORT_GAMMA = 4  # draft steps per cycle whose position-aware budgets the recall report covers (loop default)


def schedule(k_max: int, gamma: int = REPORT_GAMMA) -> list[int]:
    """DynaSpec's cluster budget k_c(t) for t < γ (§4.2): k_max, k_max, then ⌊k_max / (2(t+1))⌋ — the budgets
    the runtime's DynaSpec policy uses."""
    return [pa_budget(k_max, t, divisor=2) for t in range(gamma)]


def report_budgets(k_max: int, gamma: int = REPORT_GAMMA) -> list[int]:
    """Cluster budgets the report covers: the schedule's k_c(t) for t < γ and a few fixed ones up to k_max."""
    return sorted({k for k in (*schedule(k_max, gamma), 16, 32, 64, 128) if k <= k_max})


@torch.no_grad()
def evaluate(
    module: RouterMLP, data: RouterData, embedding: torch.Tensor, assign: torch.Tensor, sizes: torch.Tensor,
    budgets: list[int], static_order: torch.Tensor | None = None, gamma: int = REPORT_GAMMA, chunk: int = 4096,
) -> dict:
    """Held-out recall of the router's top-k clusters for each budget k.

    Per budget: ``cluster_recall`` (positive clusters inside the top-k / all positive clusters), ``top1_recall``
    (rows whose draft top-1 token lies in the top-k clusters' union), ``mean_shortlist`` (mean union size in
    draftable ids, ``sizes`` [M]), and with ``static_order`` [M] the top-1 recall of one fixed top-k cluster list.
    Also the position-aware schedule over ``gamma`` steps: its mean shortlist and mean top-1 recall.
    """
    m = module.num_clusters
    k_top = min(max(budgets), m)
    captured = {k: 0.0 for k in budgets}
    top1 = {k: 0.0 for k in budgets}
    shortlist = {k: 0.0 for k in budgets}
    static = {k: 0.0 for k in budgets}
    positives = 0.0
    for s in range(0, data.rows, chunk):
        rows = torch.arange(s, min(s + chunk, data.rows))
        h, e = inputs(data, rows, embedding)
        order = module(h, e).topk(k_top, dim=-1).indices  # [n, k_top], best first
        y = labels(data.top[rows], assign, m)  # [n, M]
        first = assign[data.top[rows, 0]]  # [n] cluster of the draft's top-1 token
        positives += float(y.sum())
        for k in budgets:
            sel = order[:, : min(k, m)]  # [n, k]
            captured[k] += float(y.gather(1, sel).sum())
            top1[k] += float((sel == first[:, None]).any(1).sum())
            shortlist[k] += float(sizes[sel].sum())
            if static_order is not None:
                static[k] += float(torch.isin(first, static_order[:k]).sum())
    n = data.rows
    out = {
        str(k): {
            "cluster_recall": captured[k] / positives if positives else 0.0,
            "top1_recall": top1[k] / n,
            "mean_shortlist": shortlist[k] / n,
            **({"static_top1_recall": static[k] / n} if static_order is not None else {}),
        }
        for k in budgets
    }
    steps = [str(b) for b in schedule(max(budgets), gamma)]
    if all(b in out for b in steps):
        out["schedule"] = {
            "gamma": gamma,
            "mean_shortlist": sum(out[b]["mean_shortlist"] for b in steps) / gamma,
            "top1_recall": sum(out[b]["top1_recall"] for b in steps) / gamma,
        }
    return out
