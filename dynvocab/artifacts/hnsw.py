"""MIPS over an LM head's rows: an HNSW graph over a low-dimensional projection, re-ranked with the head itself.

**Search.** A query ``q`` [d] is mapped to ``q P_q`` [r] and hnswlib searches the mapped rows ``w P_w`` [r]
for the largest inner products, with ``(q P_q)·(w P_w) ≈ q·w`` (see :func:`dynvocab.builders.hnsw.fit_projection`):
``P_w = S^{1/2} U_r``, ``P_q = S^{-1/2} U_r``, ``S`` the second moment of sample queries, ``U_r`` the top-r right
singular vectors of the preconditioned rows ``W S^{1/2}``. At full rank (the default) ``U`` is dropped, the maps are
the preconditioner and the graph's order is exact; below it the graph proposes ``candidates`` rows and the exact
``q·w`` of those, read from the model's own head (already in memory at run time), picks the top-k.

**MIPS as nearest neighbours.** Projected rows are norm-augmented: ``y -> [y, sqrt(R² − ‖y‖²)]`` with
``R = max ‖y‖``, queries ``z -> [z, 0]``; then ``‖z' − y'‖² = ‖z‖² + R² − 2 z·y`` and the nearest row in hnswlib's
``l2`` space (squared distances) is the one with the largest inner product.

**What the bundle stores.** Only the graph: hnswlib's level-0 records with the vector bytes cut out, the upper
levels' link lists and each node's level, plus the two maps. The vectors are ``head @ P_w``, recomputed from
the loaded head when the index is loaded (about a second), so a stage costs ~270 bytes per row at M = 32
instead of a float32 copy of the head. The record layout is hnswlib's pickle state (``getAnnData`` /
``setAnnData`` in nmslib/hnswlib ``python_bindings/bindings.cpp``): per node ``[links | vector | label]``.

Bundles written before this layout (a full-dimension index, tensor ``<stage>.index``) are refused with a
one-line message to rebuild the stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from dynvocab.artifacts.bundle import Bundle
from dynvocab.errors import DynvocabError

SPACE = "l2"  # on norm-augmented vectors; see the module docstring
GRAPH_TENSORS = ("links", "link_lists", "element_levels")  # the stored hnswlib state, besides the maps


@dataclass(frozen=True)
class HnswParams:
    """What it takes to rebuild and query a stored index."""

    hidden: int  # d: the head's hidden size, the queries' width
    rank: int  # r: the projected dimension the graph is built on
    num_elements: int  # indexed rows; labels are the token ids 0..num_elements-1
    max_norm: float  # R, the largest projected row norm
    m: int
    ef_construction: int
    ef_search: int
    candidates: int  # rows the graph returns for the exact re-rank
    space: str = SPACE
    layout: dict = field(default_factory=dict, compare=False)  # hnswlib's scalar state (offsets, entry point, …)

    @property
    def dim(self) -> int:
        """The indexed vectors' dimension: the projection plus the augmentation coordinate."""
        return self.rank + 1

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "the bundle") -> "HnswParams":
        """Parse stored params; an index of the old full-dimension layout is refused (rebuild it)."""
        if "rank" not in data:
            raise DynvocabError(
                f"{where} holds an HNSW index in the old full-dimension layout, which this dynvocab no longer "
                f"reads; rebuild it with `dynvocab build-index --stages hnsw,draft_hnsw --out …`"
            )
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass
class MipsIndex:
    """An hnswlib graph over projected, norm-augmented head rows, with the maps and the head it re-ranks with."""

    index: object  # hnswlib.Index over [V, r + 1] vectors; labels are token ids
    params: HnswParams
    query_map: torch.Tensor  # [d, r] float32, P_q
    row_map: torch.Tensor  # [d, r] float32, P_w
    head: torch.Tensor  # [V, d] the model's own rows (not a copy), for the exact re-rank

    def set_ef(self, ef: int) -> None:
        """Trade speed for recall at search time (hnswlib searches with at least as many as it returns)."""
        self.index.set_ef(ef)


def project_rows(head: torch.Tensor, row_map: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """``head @ row_map``: [V, d] x [d, r] -> float32 [V, r] on the CPU, a chunk of rows at a time."""
    m = row_map.float().to(head.device)
    return torch.cat([(rows.float() @ m).cpu() for rows in head.detach().split(chunk)])


def augment_rows(rows: torch.Tensor) -> tuple[np.ndarray, float]:
    """Norm-augment rows [V, r] -> (float32 array [V, r + 1] of equal norms R, R)."""
    w = rows.detach().float().cpu()
    sq = (w * w).sum(dim=1)  # [V]
    r2 = float(sq.max())
    extra = torch.sqrt(torch.clamp(r2 - sq, min=0.0)).unsqueeze(1)  # [V, 1]
    return torch.cat([w, extra], dim=1).numpy(), r2**0.5


def augment_queries(queries: torch.Tensor) -> np.ndarray:
    """Queries [n, r] on the CPU -> float32 array [n, r + 1] with a zero last coordinate."""
    q = queries.detach().float().reshape(-1, queries.shape[-1])
    return torch.cat([q, torch.zeros(q.shape[0], 1)], dim=1).numpy()


def graph_tensors(index) -> tuple[dict[str, torch.Tensor], dict]:
    """The graph of an hnswlib index without its vectors: (tensors ``links`` uint8 [n, record − 4·dim],
    ``link_lists`` uint8 [bytes], ``element_levels`` int32 [n]; hnswlib's scalar state)."""
    state = index.__getstate__()[0]
    n, size = state["cur_element_count"], state["size_data_per_element"]
    begin, end = state["offset_data"], state["offset_data"] + 4 * state["dim"]
    records = state["data_level0"].view(np.uint8).reshape(n, size)  # [n, record]
    links = np.concatenate([records[:, :begin], records[:, end:]], axis=1)
    tensors = {
        "links": torch.from_numpy(links),
        "link_lists": torch.from_numpy(state["link_lists"].view(np.uint8).copy()),
        "element_levels": torch.from_numpy(state["element_levels"].astype(np.int32)),
    }
    layout = {k: v for k, v in state.items() if isinstance(v, (bool, int, float, str))}
    return tensors, layout


def index_from_graph(tensors: dict[str, torch.Tensor], vectors: np.ndarray, layout: dict, ef: int):
    """Rebuild an hnswlib index from :func:`graph_tensors` and the vectors [V, dim] (row i = label i)."""
    import hnswlib

    n, begin = layout["cur_element_count"], layout["offset_data"]
    dim = layout["dim"]
    links = tensors["links"].numpy()  # [n, record − 4·dim]
    if links.shape != (n, layout["size_data_per_element"] - 4 * dim) or vectors.shape[1] != dim:
        raise DynvocabError("the stored HNSW graph does not match its layout; rebuild that stage with build-index")
    label_at = layout["label_offset"] - 4 * dim
    labels = np.ascontiguousarray(links[:, label_at : label_at + 8]).view(np.uint64).ravel()  # [n] token ids
    rows = np.ascontiguousarray(vectors, dtype=np.float32)[labels.astype(np.int64)].view(np.uint8)  # [n, 4·dim]
    records = np.concatenate([links[:, :begin], rows, links[:, begin:]], axis=1)
    state = {
        **layout,
        "data_level0": records.reshape(-1).view(np.int8),
        "link_lists": tensors["link_lists"].numpy().view(np.int8),
        "element_levels": tensors["element_levels"].numpy().astype(np.int32),
        "label_lookup_external": labels,
        "label_lookup_internal": np.arange(n, dtype=np.uint32),
    }
    index = hnswlib.Index.__new__(hnswlib.Index)
    try:
        index.__setstate__((state,))
    except (RuntimeError, ValueError) as exc:
        raise DynvocabError(f"the stored HNSW graph cannot be loaded ({exc}); rebuild that stage with build-index") from exc
    index.set_ef(ef)
    return index


def check_head(params: HnswParams, head: torch.Tensor) -> None:
    """Refuse a head [V, d] of another shape than the one the index was built over (one line)."""
    if tuple(head.shape) != (params.num_elements, params.hidden):
        raise DynvocabError(
            f"the HNSW index was built over a {params.num_elements:,}×{params.hidden} head, but the model's head is "
            f"{head.shape[0]:,}×{head.shape[1]}; rebuild that stage for this model with build-index"
        )


@dataclass(frozen=True)
class StoredIndex:
    """An HNSW stage as a bundle stores it, read whole (the graph, the two maps, its params), so a host that closes
    the bundle can still rebuild the index over the head it loads later (:meth:`over`)."""

    params: HnswParams
    graph: dict[str, torch.Tensor]  # GRAPH_TENSORS
    row_map: torch.Tensor  # [d, r]
    query_map: torch.Tensor  # [d, r]

    @classmethod
    def read(cls, bundle: Bundle, stage: str = "hnsw") -> "StoredIndex":
        """Stage ``stage`` (``hnsw`` or ``draft_hnsw``) of ``bundle``; a stage of the old layout is refused."""
        bundle.require(stage)
        params = HnswParams.from_dict(bundle.info(stage)["index"], f"bundle {bundle.path} (stage {stage})")
        graph = {name: bundle.tensor(f"{stage}.{name}") for name in GRAPH_TENSORS}
        return cls(params, graph, bundle.tensor(f"{stage}.row_map"), bundle.tensor(f"{stage}.query_map"))

    def over(self, head: torch.Tensor) -> MipsIndex:
        """The index over ``head`` [V, d] (that model's LM-head rows, all of them; refused in one line where its
        shape is not the indexed one): the vectors recomputed from it, the stored graph laid over them."""
        check_head(self.params, head)
        vectors, _ = augment_rows(project_rows(head, self.row_map))  # [V, r + 1]
        index = index_from_graph(self.graph, vectors, self.params.layout, self.params.ef_search)
        return MipsIndex(index, self.params, self.query_map.float(), self.row_map.float(), head.detach())


def load_hnsw(bundle: Bundle, head: torch.Tensor, stage: str = "hnsw") -> tuple[MipsIndex, HnswParams]:
    """Load an HNSW stage of the bundle (``hnsw``: over the target's head; ``draft_hnsw``: over the draft's)
    for ``head`` [V, d], that model's LM-head weight (all rows): ``(MipsIndex, HnswParams)``; search it with
    :func:`mips_search`. The index is rebuilt once per bundle object and shared (with the head it was first
    loaded with): a policy that changes its ef (:meth:`MipsIndex.set_ef`) changes it for all users."""
    bundle.require(stage)
    params = HnswParams.from_dict(bundle.info(stage)["index"], f"bundle {bundle.path} (stage {stage})")
    check_head(params, head)
    return bundle.loaded(f"hnsw:{stage}", lambda: StoredIndex.read(bundle, stage).over(head)), params


def rerank(head: torch.Tensor, queries: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """The top-``k`` of each query's ``candidates`` [n, c] by exact inner product with ``head`` [V, d] rows.

    ``queries`` [n, d]; returns LongTensor [n, k] of row ids on the head's device (not read back: the caller
    reads what it needs), largest inner product first.
    """
    ids = candidates.to(head.device)  # [n, c]
    rows = head[ids].float()  # [n, c, d]
    scores = torch.einsum("ncd,nd->nc", rows, queries.to(head.device).float())  # [n, c]
    top = scores.topk(min(k, ids.shape[1]), dim=1).indices  # [n, k]
    return ids.gather(1, top)


def mips_search(index: MipsIndex, queries: torch.Tensor, k: int, num_threads: int = 1) -> torch.Tensor:
    """Top-``k`` inner-product search of ``queries`` [n, d] (or [d]) over the head's rows.

    On a projection (rank < d) the graph proposes ``max(k, candidates)`` rows per query and the exact inner
    products with the head's rows keep the best ``k``; at full rank the graph's order already is that of the
    inner products (re-ranking measured no change in recall on the demo), so its top ``k`` are returned. Returns
    LongTensor [n, k] of token ids, largest inner product first: on the CPU at full rank, on the head's device after
    a re-rank. The search runs on the host (hnswlib), so ``queries`` must be on the CPU: the decoding loop copies a
    hidden state there with :func:`dynvocab.runtime.host.to_host_tensor`, which counts the read. One thread suits
    single queries at run time; pass ``num_threads=-1`` for large batches.
    """
    q = queries.detach().float().reshape(-1, queries.shape[-1])  # [n, d]
    exact = index.params.rank >= index.params.hidden  # the graph's own distances are the inner products
    wanted = k if exact else min(max(k, index.params.candidates), index.params.num_elements)
    labels, _ = index.index.knn_query(augment_queries(q @ index.query_map), k=wanted, num_threads=num_threads)
    found = torch.from_numpy(labels.astype(np.int64))  # [n, wanted]
    return found if exact else rerank(index.head, q, found, k)  # [n, k]
