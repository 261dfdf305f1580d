"""Stage ``hnsw``: EvoSpec's HNSW index over the target's LM-head rows for maximum inner-product search.

Rows are preconditioned with the second moment of sample target hidden states, norm-augmented (see
:mod:`dynvocab.artifacts.hnsw`) and indexed with hnswlib in L2 space; the index bytes and the query map go
into the bundle. Recall@k against exact MIPS is measured on held-out queries (other documents than the ones
the preconditioner saw) and stored with the stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from dynvocab.artifacts.hnsw import HnswParams, MipsIndex, augment_rows, index_to_tensor, mips_search
from dynvocab.builders.progress import Advance


@dataclass(frozen=True)
class HnswConfig:
    """EvoSpec Table 5: M = 32. The ef values are not in the paper; these give recall@10 ≥ 0.95 on the demo."""

    m: int = 32
    ef_construction: int = 200
    ef_search: int = 512
    seed: int = 100
    num_threads: int = -1  # hnswlib threads for building (-1: all cores; 1: the same graph on every build)
    batch_rows: int = 4096  # rows added per call (progress granularity)
    precondition: bool = True  # fit S^{1/2} on sample queries (see dynvocab.artifacts.hnsw)
    shrinkage: float = 0.1  # S = (1 - λ) E[q qᵀ] + λ diag(E[q qᵀ])
    fit_docs: int = 16  # preconditioner: target hidden states of these corpus documents …
    recall_docs: int = 8  # recall: … and of these other (held-out) documents
    query_tokens: int = 64  # tokens per document
    recall_k: int = 10

    def as_dict(self) -> dict:
        return asdict(self)


def fit_preconditioner(queries: torch.Tensor, shrinkage: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S^{1/2}, S^{-1/2})``, both [d, d] float32, from sample queries [n, d] (shrunk to the diagonal)."""
    q = queries.double()
    second = q.T @ q / q.shape[0]  # [d, d]
    s = (1.0 - shrinkage) * second + shrinkage * torch.diag(torch.diagonal(second))
    evals, evecs = torch.linalg.eigh(s)
    evals = evals.clamp(min=float(evals.max()) * 1e-6)
    root = evecs @ torch.diag(evals.sqrt()) @ evecs.T
    inv_root = evecs @ torch.diag(evals.rsqrt()) @ evecs.T
    return root.float(), inv_root.float()


def build_index(
    cfg: HnswConfig, head: torch.Tensor, fit_queries: torch.Tensor | None = None, advance: Advance = lambda n: None
) -> MipsIndex:
    """Index the LM-head rows ``head`` [V, d] (labels = row ids), preconditioned when ``fit_queries`` [n, d] are given."""
    import hnswlib

    d = head.shape[1]
    if cfg.precondition and fit_queries is not None and fit_queries.numel():
        row_map, query_map = fit_preconditioner(fit_queries, cfg.shrinkage)
    else:
        row_map, query_map = None, torch.eye(d)
    rows = head.float() @ row_map if row_map is not None else head.float()  # [V, d]
    data, max_norm = augment_rows(rows)  # [V, d + 1], R
    del rows
    params = HnswParams(
        dim=data.shape[1], num_elements=data.shape[0], max_norm=max_norm,
        m=cfg.m, ef_construction=cfg.ef_construction, ef_search=cfg.ef_search,
    )
    index = hnswlib.Index(space=params.space, dim=params.dim)
    index.init_index(max_elements=params.num_elements, ef_construction=cfg.ef_construction, M=cfg.m, random_seed=cfg.seed)
    for start in range(0, data.shape[0], cfg.batch_rows):
        block = data[start : start + cfg.batch_rows]
        index.add_items(block, np.arange(start, start + block.shape[0]), num_threads=cfg.num_threads)
        advance(block.shape[0])
    index.set_ef(cfg.ef_search)
    return MipsIndex(index, params, query_map)


def exact_mips(head: torch.Tensor, queries: torch.Tensor, k: int, chunk: int = 256) -> torch.Tensor:
    """Brute-force top-``k`` inner products: LongTensor [n, k] of row ids, best first."""
    w = head.float()
    return torch.cat([torch.topk(q.float() @ w.T, k, dim=1).indices for q in queries.split(chunk)])  # [n, k]


def recall(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean |approx ∩ exact| / k over rows of two [n, k] id tensors."""
    hits = sum(len(set(a.tolist()) & set(e.tolist())) for a, e in zip(approx, exact))
    return hits / exact.numel()


def recall_at_k(index: MipsIndex, head: torch.Tensor, queries: torch.Tensor, k: int) -> float:
    """Recall@k of the index against exact MIPS over ``head`` [V, d] for ``queries`` [n, d]."""
    return recall(mips_search(index, queries, k, num_threads=-1), exact_mips(head, queries, k))


def build(
    cfg: HnswConfig,
    head: torch.Tensor,
    fit_queries: torch.Tensor | None = None,
    eval_queries: torch.Tensor | None = None,
    advance: Advance = lambda n: None,
) -> tuple[dict[str, torch.Tensor], HnswParams, dict]:
    """Build and serialise the index; returns (tensors ``index`` uint8 [n_bytes] and ``query_map`` [d, d], params, stats)."""
    exact = exact_mips(head, eval_queries, cfg.recall_k) if eval_queries is not None and eval_queries.numel() else None
    mips = build_index(cfg, head, fit_queries, advance)
    stats: dict = {"preconditioned": bool(cfg.precondition and fit_queries is not None and fit_queries.numel())}
    if exact is not None:
        stats[f"recall@{cfg.recall_k}"] = round(recall(mips_search(mips, eval_queries, cfg.recall_k, num_threads=-1), exact), 4)
        stats["recall_queries"] = int(eval_queries.shape[0])
    tensors = {"index": index_to_tensor(mips.index), "query_map": mips.query_map.contiguous()}
    return tensors, mips.params, stats
