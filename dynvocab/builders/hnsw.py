"""Stage ``hnsw``: EvoSpec's HNSW index over the target's LM-head rows for maximum inner-product search.

Rows are norm-augmented (see :mod:`dynvocab.artifacts.hnsw`) and indexed with hnswlib in L2 space; the
index bytes go into the bundle as a uint8 tensor. Recall@k against exact MIPS is measured on held-out
queries (real target hidden states in a real build) and stored with the stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from dynvocab.artifacts.hnsw import HnswParams, augment_rows, index_to_tensor, mips_search
from dynvocab.builders.progress import Advance


@dataclass(frozen=True)
class HnswConfig:
    """EvoSpec Table 5: M = 32. ef values are not given by the paper; these reach recall@10 ≥ 0.95."""

    m: int = 32
    ef_construction: int = 200
    ef_search: int = 128
    seed: int = 100
    num_threads: int = -1  # hnswlib threads for building (-1: all cores)
    batch_rows: int = 4096  # rows added per call (progress granularity)
    recall_k: int = 10
    recall_docs: int = 8  # recall queries: target hidden states of the first documents of the corpus
    recall_tokens: int = 64  # … truncated to this many tokens each

    def as_dict(self) -> dict:
        return asdict(self)


def build_index(cfg: HnswConfig, head: torch.Tensor, advance: Advance = lambda n: None):
    """Index the LM-head rows ``head`` [V, d]; labels are row ids. Returns ``(hnswlib.Index, HnswParams)``."""
    import hnswlib

    data, max_norm = augment_rows(head)  # [V, d + 1], R
    params = HnswParams(
        dim=data.shape[1],
        num_elements=data.shape[0],
        max_norm=max_norm,
        m=cfg.m,
        ef_construction=cfg.ef_construction,
        ef_search=cfg.ef_search,
    )
    index = hnswlib.Index(space=params.space, dim=params.dim)
    index.init_index(max_elements=params.num_elements, ef_construction=cfg.ef_construction, M=cfg.m, random_seed=cfg.seed)
    for start in range(0, data.shape[0], cfg.batch_rows):
        block = data[start : start + cfg.batch_rows]
        index.add_items(block, np.arange(start, start + block.shape[0]), num_threads=cfg.num_threads)
        advance(block.shape[0])
    index.set_ef(cfg.ef_search)
    return index, params


def exact_mips(head: torch.Tensor, queries: torch.Tensor, k: int, chunk: int = 256) -> torch.Tensor:
    """Brute-force top-``k`` inner products: LongTensor [n, k] of row ids, best first."""
    w = head.float()
    out = [torch.topk(q.float() @ w.T, k, dim=1).indices for q in queries.split(chunk)]  # [chunk, k] each
    return torch.cat(out)


def recall_at_k(index, head: torch.Tensor, queries: torch.Tensor, k: int) -> float:
    """Mean |HNSW top-k ∩ exact top-k| / k over ``queries`` [n, d]."""
    approx = mips_search(index, queries, k, num_threads=-1)  # [n, k]
    exact = exact_mips(head, queries, k)  # [n, k]
    hits = sum(len(set(a.tolist()) & set(e.tolist())) for a, e in zip(approx, exact))
    return hits / (k * queries.shape[0])


def build(
    cfg: HnswConfig, head: torch.Tensor, queries: torch.Tensor | None = None, advance: Advance = lambda n: None
) -> tuple[torch.Tensor, HnswParams, dict]:
    """Build and serialise the index; returns (index bytes uint8 [n_bytes], params, stats incl. recall)."""
    index, params = build_index(cfg, head, advance)
    stats: dict = {}
    if queries is not None and queries.numel():
        stats[f"recall@{cfg.recall_k}"] = round(recall_at_k(index, head, queries, cfg.recall_k), 4)
        stats["recall_queries"] = int(queries.shape[0])
    data = index_to_tensor(index)
    del index
    return data, params, stats
