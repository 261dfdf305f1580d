"""The HNSW index over the target's LM-head rows, stored as bytes inside the bundle, and MIPS search on it.

Maximum inner-product search (MIPS) is turned into nearest-neighbour search by **norm augmentation**: every
row ``w`` becomes ``[w, sqrt(R² − ‖w‖²)]`` with ``R = max ‖w‖``, so all rows have norm ``R``; a query ``q``
becomes ``[q, 0]``. Then ``‖q' − w'‖² = ‖q‖² + R² − 2 q·w``, and the nearest row in **L2** is the row with
the largest inner product. We index the augmented rows in hnswlib's ``l2`` space (squared distances).

**Preconditioning.** Real target hidden states are far from isotropic (a few "massive" channels, a large
mean), and plain augmentation then finds only ~60% of the true top-10 on the demo target. Before augmenting,
rows are mapped ``w -> w S^{1/2}`` and queries ``q -> q S^{-1/2}``, where ``S`` is the (shrunk) second
moment of sample queries; inner products are unchanged (``q S^{-1/2} · w S^{1/2} = q·w``), so the search is
still exact MIPS, but the rows' geometry now matches what queries can tell apart. The query map
``S^{-1/2}`` [d, d] is stored with the index (identity when no queries were available).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import numpy as np
import torch

from dynvocab.artifacts.bundle import Bundle
from dynvocab.errors import DynvocabError

SPACE = "l2"  # on norm-augmented vectors; see the module docstring


@dataclass(frozen=True)
class HnswParams:
    """What it takes to load and query a stored index."""

    dim: int  # augmented dimension = hidden size + 1
    num_elements: int  # indexed rows; labels are the token ids 0..num_elements-1
    max_norm: float  # R, the largest (preconditioned) row norm
    m: int
    ef_construction: int
    ef_search: int
    space: str = SPACE

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "HnswParams":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass
class MipsIndex:
    """An hnswlib index over preconditioned, norm-augmented rows, with the map its queries need."""

    index: object  # hnswlib.Index; labels are token ids
    params: HnswParams
    query_map: torch.Tensor  # [d, d] float32, S^{-1/2}: queries are multiplied by it before augmentation

    def set_ef(self, ef: int) -> None:
        """Trade speed for recall at search time."""
        self.index.set_ef(ef)


def augment_rows(weight: torch.Tensor) -> tuple[np.ndarray, float]:
    """Norm-augment rows ``weight`` [V, d] -> (float32 array [V, d + 1] of equal norms R, R)."""
    w = weight.detach().float().cpu()
    sq = (w * w).sum(dim=1)  # [V]
    r2 = float(sq.max())
    extra = torch.sqrt(torch.clamp(r2 - sq, min=0.0)).unsqueeze(1)  # [V, 1]
    return torch.cat([w, extra], dim=1).numpy(), r2**0.5


def augment_queries(queries: torch.Tensor) -> np.ndarray:
    """Queries [n, d] -> float32 array [n, d + 1] with a zero last coordinate."""
    q = queries.detach().float().cpu().reshape(-1, queries.shape[-1])
    return torch.cat([q, torch.zeros(q.shape[0], 1)], dim=1).numpy()


def index_to_tensor(index) -> torch.Tensor:
    """Serialise an hnswlib index to a uint8 tensor [n_bytes] (through an in-memory file: nothing on disk)."""
    fd = os.memfd_create("dynvocab-hnsw")
    try:
        path = f"/proc/self/fd/{fd}"
        index.save_index(path)
        data = np.fromfile(path, dtype=np.uint8)
    finally:
        os.close(fd)
    return torch.from_numpy(data)


def index_from_tensor(data: torch.Tensor, params: HnswParams, query_map: torch.Tensor) -> MipsIndex:
    """Rebuild the index from :func:`index_to_tensor`'s bytes; ef is set to ``params.ef_search``."""
    import hnswlib

    index = hnswlib.Index(space=params.space, dim=params.dim)
    # hnswlib loads only from a path: hand it an anonymous in-memory file, which no kill can leave on disk.
    with os.fdopen(os.memfd_create("dynvocab-hnsw"), "wb") as f:
        f.write(data.numpy().tobytes())
        f.flush()
        try:
            index.load_index(f"/proc/self/fd/{f.fileno()}", max_elements=params.num_elements)
        except RuntimeError as exc:
            raise DynvocabError(
                f"the stored HNSW index cannot be loaded ({exc}); rebuild that stage with build-index"
            ) from exc
    index.set_ef(params.ef_search)
    return MipsIndex(index, params, query_map.float())


def load_hnsw(bundle: Bundle, stage: str = "hnsw") -> tuple[MipsIndex, HnswParams]:
    """Load an HNSW stage of the bundle (``hnsw``: over the target's head; ``draft_hnsw``: over the draft's):
    ``(MipsIndex, HnswParams)``; search it with :func:`mips_search`. The index is loaded once per bundle
    object and shared: a policy that changes its ef (:meth:`MipsIndex.set_ef`) changes it for all users."""
    bundle.require(stage)
    params = HnswParams.from_dict(bundle.info(stage)["index"])

    def load() -> MipsIndex:
        return index_from_tensor(bundle.tensor(f"{stage}.index"), params, bundle.tensor(f"{stage}.query_map"))

    return bundle.loaded(f"hnsw:{stage}", load), params


def mips_search(index: MipsIndex, queries: torch.Tensor, k: int, num_threads: int = 1) -> torch.Tensor:
    """Approximate top-``k`` inner-product search of ``queries`` [n, d] (or [d]) over the indexed rows.

    Returns LongTensor [n, k] of token ids, largest inner product first. One thread suits single queries at
    run time; pass ``num_threads=-1`` for large batches.
    """
    q = queries.detach().float().cpu().reshape(-1, queries.shape[-1]) @ index.query_map  # [n, d]
    labels, _ = index.index.knn_query(augment_queries(q), k=k, num_threads=num_threads)  # [n, k] uint64
    return torch.from_numpy(labels.astype(np.int64))
