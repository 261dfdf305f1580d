"""Stage ``hnsw``: an HNSW graph for maximum inner-product search over an LM head's rows, on a projection.

The rows are projected to ``rank`` dimensions by maps fitted on sample hidden states of the model (see
:func:`fit_projection`), norm-augmented and indexed with hnswlib in L2 space; at run time the graph proposes
``candidates`` rows and exact inner products with the loaded head keep the top-k (see
:mod:`dynvocab.artifacts.hnsw`). The bundle gets the graph without its vectors and the two [d, r] maps.
Recall@k of the whole search against exact MIPS is measured on held-out queries (other documents than the
ones the maps were fitted on) and stored with the stage.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from dataclasses import asdict, dataclass

import numpy as np
import torch

from dynvocab.artifacts import Stage
from dynvocab.artifacts.hnsw import HnswParams, MipsIndex, augment_rows, graph_tensors, mips_search, project_rows
from dynvocab.artifacts.stages import DRAFT_HNSW, HNSW
from dynvocab.builders.corpus import iter_documents
from dynvocab.builders.models import hidden_states, load_head
from dynvocab.builders.stage_registry import DOCUMENTS, DRAFT, TARGET, BuildInputs, Built, StageBuilder, Synthetic
from dynvocab.errors import DynvocabError
from dynvocab.progress import Advance


@dataclass(frozen=True)
class HnswConfig:
    """EvoSpec Table 5: M = 32. Rank, candidates and ef are ours, chosen on the demo pair (docs/retrieval.md)."""

    m: int = 32
    ef_construction: int = 200
    ef_search: int = 512
    rank: int = 0  # dimension of the projection the graph is built on (0 or ≥ d: the full hidden size)
    candidates: int = 64  # rank < d only: rows the graph proposes for the exact re-rank
    seed: int = 100
    num_threads: int = -1  # hnswlib threads for building (-1: all cores; 1: the same graph on every build)
    batch_rows: int = 4096  # rows added per call (progress granularity)
    precondition: bool = True  # fit S^{1/2} on sample queries (see fit_preconditioner)
    shrinkage: float = 0.1  # S = (1 - λ) E[q qᵀ] + λ diag(E[q qᵀ])
    fit_docs: int = 16  # projection: hidden states of these corpus documents …
    recall_docs: int = 8  # recall: … and of these other (held-out) documents
    query_tokens: int = 64  # tokens per document
    recall_k: int = 10

    def as_dict(self) -> dict:
        return asdict(self)


def fit_preconditioner(queries: torch.Tensor, shrinkage: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S^{1/2}, S^{-1/2})``, both [d, d] float32, from sample queries [n, d] (shrunk to the diagonal).

    Real hidden states are far from isotropic (a few massive channels, a large mean); mapping rows by
    ``S^{1/2}`` and queries by ``S^{-1/2}`` keeps every inner product and makes the queries near-isotropic.
    """
    q = queries.double()
    second = q.T @ q / q.shape[0]  # [d, d]
    s = (1.0 - shrinkage) * second + shrinkage * torch.diag(torch.diagonal(second))
    evals, evecs = torch.linalg.eigh(s)
    evals = evals.clamp(min=float(evals.max()) * 1e-6)
    root = evecs @ torch.diag(evals.sqrt()) @ evecs.T
    inv_root = evecs @ torch.diag(evals.rsqrt()) @ evecs.T
    return root.float(), inv_root.float()


def fit_projection(
    head: torch.Tensor, rank: int, fit_queries: torch.Tensor | None = None, shrinkage: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_map, query_map)``, both [d, r] float32, with ``(q @ query_map)·(w @ row_map) ≈ q·w``.

    With the preconditioner, queries ``q S^{-1/2}`` are near-isotropic, so the rank-r map that best keeps the
    inner products with the rows ``W S^{1/2}`` is their top-r right singular vectors ``U_r`` (uncentred PCA):
    ``row_map = S^{1/2} U_r``, ``query_map = S^{-1/2} U_r``. Without sample queries ``S = I``.
    At ``rank`` 0 or ≥ d no direction is dropped and the maps are the preconditioner itself (any rotation
    ``U`` keeps every inner product, so none is fitted).
    """
    d = head.shape[1]
    if fit_queries is not None and fit_queries.numel():
        root, inv_root = fit_preconditioner(fit_queries, shrinkage)
    else:
        root, inv_root = torch.eye(d), torch.eye(d)
    if rank <= 0 or rank >= d:
        return root, inv_root
    gram = torch.zeros(d, d, dtype=torch.float64)
    for rows in head.detach().split(16384):
        a = rows.float().cpu() @ root  # [chunk, d]
        gram += (a.T @ a).double()
    _, evecs = torch.linalg.eigh(gram)  # ascending
    top = evecs[:, -min(rank, d) :].flip(1).float()  # [d, r], largest first
    return root @ top, inv_root @ top


def build_index(
    cfg: HnswConfig, head: torch.Tensor, fit_queries: torch.Tensor | None = None, advance: Advance = lambda n: None
) -> MipsIndex:
    """Index the LM-head rows ``head`` [V, d] (labels = row ids) on their projection; the returned index
    re-ranks with ``head`` itself. The maps are fitted on ``fit_queries`` [n, d] when given (and ``precondition``)."""
    import hnswlib

    queries = fit_queries if cfg.precondition else None
    row_map, query_map = fit_projection(head, cfg.rank, queries, cfg.shrinkage)
    data, max_norm = augment_rows(project_rows(head, row_map))  # [V, r + 1], R
    params = HnswParams(
        hidden=head.shape[1], rank=row_map.shape[1], num_elements=data.shape[0], max_norm=max_norm,
        m=cfg.m, ef_construction=cfg.ef_construction, ef_search=cfg.ef_search, candidates=cfg.candidates,
    )
    index = hnswlib.Index(space=params.space, dim=params.dim)
    index.init_index(max_elements=params.num_elements, ef_construction=cfg.ef_construction, M=cfg.m, random_seed=cfg.seed)
    for start in range(0, data.shape[0], cfg.batch_rows):
        block = data[start : start + cfg.batch_rows]
        index.add_items(block, np.arange(start, start + block.shape[0]), num_threads=cfg.num_threads)
        advance(block.shape[0])
    mips = MipsIndex(index, params, query_map, row_map, head.detach())
    mips.set_ef(cfg.ef_search)
    return mips


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
    """Build the index and take it apart for the bundle: (tensors ``links``, ``link_lists``, ``element_levels``
    (the graph, see :func:`dynvocab.artifacts.hnsw.graph_tensors``), ``row_map`` and ``query_map`` [d, r];
    params with hnswlib's layout; stats with recall@k of the whole search on ``eval_queries`` [n, d])."""
    mips = build_index(cfg, head, fit_queries, advance)
    stats: dict = {"preconditioned": bool(cfg.precondition and fit_queries is not None and fit_queries.numel())}
    if eval_queries is not None and eval_queries.numel():
        stats[f"recall@{cfg.recall_k}"] = round(recall_at_k(mips, head, eval_queries, cfg.recall_k), 4)
        stats["recall_queries"] = int(eval_queries.shape[0])
    tensors, layout = graph_tensors(mips.index)
    tensors |= {"row_map": mips.row_map.contiguous(), "query_map": mips.query_map.contiguous()}
    return tensors, dataclasses.replace(mips.params, layout=layout), stats


def _stage_builder(name: str, role: str):
    """The builder of stage ``name``: an index over the LM-head rows of ``role``'s model (``hnsw``: the target,
    EvoSpec's retrieval; ``draft_hnsw``: the draft, the hybrid's per-step retrieval), preconditioned on that
    model's hidden states of some corpus documents, recall measured on others."""

    def build_stage(inputs: BuildInputs, h: HnswConfig) -> Built:
        spec = inputs.spec(role)
        docs = list(itertools.islice(iter_documents(inputs.corpus), h.recall_docs + h.fit_docs))
        if len(docs) <= h.recall_docs:
            raise DynvocabError(
                f"the corpus has {len(docs)} documents; the {name} stage needs more than {h.recall_docs}")
        with inputs.reporter.task(f"{name} queries ({role} hidden states)", total=None):
            states = hidden_states(spec, inputs.target_tokenizer, docs, h.query_tokens, inputs.device)  # [T_i, d] each
        eval_queries, fit_queries = torch.cat(states[: h.recall_docs]), torch.cat(states[h.recall_docs :])
        del states
        gc.collect()
        head = load_head(spec)  # [V, d] of that model
        with inputs.reporter.task(f"{name} (rows indexed)", total=head.shape[0]) as advance:
            tensors, params, stats = build(h, head, fit_queries, eval_queries, advance)
        return Built(tensors, stats, {"index": params.as_dict(), "model": role})

    return build_stage


def head_stage(name: str, head: torch.Tensor, role: str, cfg: HnswConfig | None = None) -> Stage:
    """Stage ``name`` (``hnsw`` or ``draft_hnsw``) indexing ``head`` [V, d], the LM-head rows of ``role``'s model,
    without sample queries (no preconditioner, no recall): what synthetic bundles and the tests build. Default: a
    cheap graph (M 8, ef 32 at construction; ef at search as a built bundle's)."""
    cfg = cfg or HnswConfig(m=8, ef_construction=32)
    tensors, params, _ = build(cfg, head)
    return Stage(name, tensors, cfg.as_dict(), {"index": params.as_dict(), "model": role})


def _synthetic(spec: Synthetic, made: dict) -> Stage:
    """A cheap graph over the target's stand-in rows (:func:`head_stage`)."""
    return head_stage(HNSW.name, spec.rows, TARGET)


STAGE = StageBuilder(HNSW, HnswConfig, _stage_builder(HNSW.name, TARGET), needs=(DOCUMENTS, TARGET),
                     synthetic=_synthetic)
DRAFT_STAGE = StageBuilder(DRAFT_HNSW, HnswConfig, _stage_builder(DRAFT_HNSW.name, DRAFT), needs=(DOCUMENTS, DRAFT))
