"""Stage ``clusters``: DynaSpec's token clusters, spherical k-means on the draft's L2-normalised LM-head rows.

Spherical k-means: assign each unit row to the centroid of largest cosine, then set each centroid to the
re-normalised mean of its rows. Clusters are left unbalanced (DynaSpec: balance hurts recall in dense
regions). Seeded: the initial centroids are distinct rows drawn with ``torch.Generator(seed)``; a cluster that
empties is re-seeded with the rows farthest from their centroids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from dynvocab.artifacts import ClusterTable, Stage
from dynvocab.artifacts.stages import CLUSTERS
from dynvocab.builders.models import load_head
from dynvocab.builders.stage_registry import DRAFT, BuildInputs, Built, StageBuilder, Synthetic
from dynvocab.errors import DynvocabError
from dynvocab.progress import Advance


@dataclass(frozen=True)
class ClustersConfig:
    """DynaSpec default M = 1024 clusters."""

    num_clusters: int = 1024
    max_iters: int = 30
    tol: float = 0.01  # stop once fewer than tol * V rows change cluster (demo: iteration 15, mean cosine within 0.1%)
    seed: int = 0
    chunk_rows: int = 16384  # rows per similarity block (memory: chunk_rows * M floats)

    def as_dict(self) -> dict:
        return asdict(self)


def _assign(x: torch.Tensor, centroids: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best centroid per row: (ids LongTensor [V], cosine float32 [V])."""
    ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    best = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], chunk):
        sims = x[start : start + chunk] @ centroids.T  # [chunk, M]
        best[start : start + chunk], ids[start : start + chunk] = sims.max(dim=1)
    return ids, best


def spherical_kmeans(
    x: torch.Tensor, cfg: ClustersConfig, advance: Advance = lambda n: None
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Cluster unit rows ``x`` [V, d]; returns (assign LongTensor [V], centroids float32 [M, d], stats)."""
    n, m = x.shape[0], cfg.num_clusters
    zero_rows = x.abs().sum(dim=1) == 0  # [V]
    gen = torch.Generator().manual_seed(cfg.seed)
    centroids = x[torch.randperm(n, generator=gen)[:m].to(x.device)].clone()  # [M, d]
    assign = torch.full((n,), -1, dtype=torch.long, device=x.device)
    iters, changed = 0, n
    for iters in range(1, cfg.max_iters + 1):
        new_assign, best = _assign(x, centroids, cfg.chunk_rows)
        changed = int((new_assign != assign).sum())
        assign = new_assign
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)  # [M, d]
        sizes = torch.bincount(assign, minlength=m)  # [M]
        empty = torch.nonzero(sizes == 0).flatten()
        if empty.numel():
            # Re-seed with the rows least similar to their centroid (zero rows, e.g. padding, never).
            far = torch.argsort(best.masked_fill(zero_rows, float("inf")))[: empty.numel()]
            sums[empty] = x[far]
            assign[far] = empty
        centroids = F.normalize(sums, dim=1)
        advance(1)
        if changed < cfg.tol * n:
            break
    assign, best = _assign(x, centroids, cfg.chunk_rows)
    stats = {"iterations": iters, "last_changed": changed, "mean_cosine": round(float(best.mean()), 5)}
    return assign, centroids, stats


def build(
    cfg: ClustersConfig, head: torch.Tensor, device: str = "cpu", advance: Advance = lambda n: None
) -> tuple[ClusterTable, dict]:
    """Cluster the draft LM-head rows ``head`` [V, d]; returns the table and statistics for the bundle."""
    if not 1 <= cfg.num_clusters <= head.shape[0]:
        raise DynvocabError(
            f"cannot make {cfg.num_clusters} clusters of {head.shape[0]} LM-head rows; pick --num-clusters ≤ {head.shape[0]}"
        )
    x = F.normalize(head.to(device=device, dtype=torch.float32), dim=1)  # [V, d], zero rows stay zero
    assign, centroids, stats = spherical_kmeans(x, cfg, advance)
    table = ClusterTable(assign=assign.cpu(), centroids=centroids.float().cpu())
    sizes = table.sizes()
    stats.update(
        {
            "rows": int(head.shape[0]),
            "empty_clusters": int((sizes == 0).sum()),
            "largest_cluster": int(sizes.max()),
            "median_cluster": int(sizes.median()),
        }
    )
    return table, stats


def _build_stage(inputs: BuildInputs, cfg: ClustersConfig) -> Built:
    head = load_head(inputs.draft)  # [V_draft, d_draft]
    with inputs.reporter.task("clusters (k-means iterations)", total=cfg.max_iters) as advance:
        table, stats = build(cfg, head, inputs.device, advance)
    return Built(table.to_tensors(), stats)


def _synthetic(spec: Synthetic, made: dict, m: int = 1024) -> Stage:
    """``m`` clusters of random ids around random unit centroids."""
    assign = torch.randint(m, (spec.vocab,), generator=spec.generator)  # [V]
    centroids = F.normalize(torch.randn(m, spec.dim, generator=spec.generator), dim=-1)  # [m, d]
    return Stage(CLUSTERS.name, {"assign": assign, "centroids": centroids}, {})


STAGE = StageBuilder(CLUSTERS, ClustersConfig, _build_stage, needs=(DRAFT,), synthetic=_synthetic)
