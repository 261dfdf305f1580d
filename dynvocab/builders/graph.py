"""Stage ``graph``: EvoSpec's token co-occurrence graph (Appendix A.3).

An edge u -> v exists when v immediately follows u in the corpus; its weight is the empirical p(v | u) =
c(u, v) / c(u, ·). Pruning as in EvoSpec: c(u, v) >= 5, p(v | u) >= τ = 1e-4, at most 64 successors per u
(the most likely ones). Stored as CSR with each row sorted by p, descending.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from dynvocab.artifacts import GraphTable, Stage
from dynvocab.artifacts.stages import GRAPH
from dynvocab.builders.stage_registry import BIGRAMS, TARGET, BuildInputs, Built, StageBuilder, Synthetic


@dataclass(frozen=True)
class GraphConfig:
    """EvoSpec Table 5 / Appendix A.3 pruning."""

    min_count: int = 5
    tau: float = 1e-4
    max_out_degree: int = 64

    def as_dict(self) -> dict:
        return asdict(self)


def build(cfg: GraphConfig, keys: np.ndarray, counts: np.ndarray, vocab: int) -> GraphTable:
    """CSR successor lists from bigram ``keys`` [P] (u * vocab + v, sorted unique) and their ``counts`` [P]."""
    u, v = keys // vocab, keys % vocab  # [P]
    row_total = np.bincount(u, weights=counts, minlength=vocab)  # [V], c(u, ·) over all successors
    p = counts / np.maximum(row_total[u], 1)  # [P]
    keep = (counts >= cfg.min_count) & (p >= cfg.tau)
    u, v, p = u[keep], v[keep], p[keep]
    order = np.lexsort((v, -p, u))  # by source, then p descending, then successor id
    u, v, p = u[order], v[order], p[order]
    row_start = np.searchsorted(u, u, side="left")  # [E'] first edge of each edge's row
    keep = (np.arange(u.size) - row_start) < cfg.max_out_degree
    u, v, p = u[keep], v[keep], p[keep]
    indptr = np.zeros(vocab + 1, dtype=np.int64)  # [V + 1]
    np.cumsum(np.bincount(u, minlength=vocab), out=indptr[1:])
    return GraphTable(
        indptr=torch.from_numpy(indptr),
        indices=torch.from_numpy(v.astype(np.int32)),
        probs=torch.from_numpy(p.astype(np.float32)),
    )


def summary(table: GraphTable) -> dict:
    """Statistics stored with the stage."""
    degree = table.indptr[1:] - table.indptr[:-1]
    return {
        "edges": table.num_edges,
        "sources": int((degree > 0).sum()),
        "mean_out_degree": round(float(degree[degree > 0].float().mean()), 3) if table.num_edges else 0.0,
    }


def _build_stage(inputs: BuildInputs, cfg: GraphConfig) -> Built:
    counts = inputs.counts
    table = build(cfg, counts.bigram_keys, counts.bigram_counts, inputs.target_fp.head_rows)
    return Built(table.to_tensors(), summary(table), {"corpus": inputs.corpus_info})


def _synthetic(spec: Synthetic, made: dict, fanout: int = 64) -> Stage:
    """``fanout`` random successors of every id, equally likely."""
    v = spec.vocab
    return Stage(GRAPH.name, {
        "indptr": torch.arange(0, (v + 1) * fanout, fanout, dtype=torch.long),
        "indices": torch.randint(v, (v * fanout,), generator=spec.generator, dtype=torch.int32),
        "probs": torch.full((v * fanout,), 1.0 / fanout),
    }, {})


STAGE = StageBuilder(GRAPH, GraphConfig, _build_stage, needs=(BIGRAMS, TARGET), synthetic=_synthetic)
