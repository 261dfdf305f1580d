"""Typed views of the bundle's stages: what the builders produce and what the runtime reads."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dynvocab.artifacts.bundle import Bundle

COVERAGE_SIZES = (4096, 8192, 16384, 32768)  # top-K sizes whose corpus share ``freq`` reports by default


def _stage_table(cls, bundle: Bundle, stage: str, names: tuple[str, ...]):
    """``cls`` built from the stage's tensors ``names`` in order, read once per bundle object and shared."""

    def load():
        tensors = bundle.stage_tensors(stage)
        return cls(*(tensors[n] for n in names))

    return bundle.loaded(stage, load)


@dataclass(frozen=True)
class FreqTable:
    """FR-Spec token frequencies over a corpus, with the target tokenizer's ids."""

    counts: torch.Tensor  # [V] int64, corpus count of each target token id
    ranking: torch.Tensor  # [V] int64, all ids: end tokens first, then by count (desc), ties by id
    eos_ids: torch.Tensor  # [E] int64, end-of-sequence / end-of-turn ids (always ranked in)

    def top(self, k: int) -> torch.Tensor:
        """The first ``k`` ids of the ranking, LongTensor [k]."""
        return self.ranking[:k]

    def top_k_share(self, k: int) -> float:
        """Share of corpus tokens that fall inside the top ``k`` ids."""
        total = int(self.counts.sum())
        return float(self.counts[self.ranking[:k]].sum()) / total if total else 0.0

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors for the bundle, keyed without the stage prefix."""
        return {"counts": self.counts, "ranking": self.ranking, "eos_ids": self.eos_ids}

    @classmethod
    def from_bundle(cls, bundle: Bundle) -> "FreqTable":
        """Read the ``freq`` stage (once per bundle object; the table is immutable and shared)."""
        return _stage_table(cls, bundle, "freq", ("counts", "ranking", "eos_ids"))


@dataclass(frozen=True)
class ClusterTable:
    """DynaSpec token clusters: spherical k-means of the draft's normalised LM-head rows."""

    assign: torch.Tensor  # [V_draft] int64, cluster id of each draft LM-head row
    centroids: torch.Tensor  # [M, d_draft] float32, unit-norm cluster centres

    @property
    def num_clusters(self) -> int:
        return int(self.centroids.shape[0])

    def sizes(self) -> torch.Tensor:
        """Tokens per cluster, LongTensor [M]."""
        return torch.bincount(self.assign, minlength=self.num_clusters)

    def members(self, cluster_ids: torch.Tensor) -> torch.Tensor:
        """Sorted token ids of the union of ``cluster_ids``, LongTensor [n]."""
        return torch.nonzero(torch.isin(self.assign, cluster_ids)).flatten()

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors for the bundle, keyed without the stage prefix."""
        return {"assign": self.assign, "centroids": self.centroids}

    @classmethod
    def from_bundle(cls, bundle: Bundle) -> "ClusterTable":
        """Read the ``clusters`` stage (once per bundle object; the table is immutable and shared)."""
        return _stage_table(cls, bundle, "clusters", ("assign", "centroids"))


@dataclass(frozen=True)
class GraphTable:
    """EvoSpec bigram successor graph u -> v with p(v | u), pruned, as CSR (rows sorted by p, descending)."""

    indptr: torch.Tensor  # [V + 1] int64, row u spans indices[indptr[u]:indptr[u + 1]]
    indices: torch.Tensor  # [E] int32, successor token ids
    probs: torch.Tensor  # [E] float32, p(v | u) over all observed successors of u (before pruning)

    @property
    def num_edges(self) -> int:
        return int(self.indices.numel())

    def successors(self, u: int, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The (at most ``k``) most likely successors of token ``u``: (ids LongTensor [n], probs [n])."""
        begin, end = int(self.indptr[u]), int(self.indptr[u + 1])
        if k is not None:
            end = min(end, begin + k)
        return self.indices[begin:end].long(), self.probs[begin:end]

    def to(self, device: torch.device | str) -> "GraphTable":
        """The same graph with its tensors on ``device`` (``indptr`` as int64)."""
        return replace(self, indptr=self.indptr.long().to(device), indices=self.indices.to(device),
                       probs=self.probs.to(device))

    def top_successors(self, token: torch.Tensor, k: int, fill: int, below: int | None = None) -> torch.Tensor:
        """The first ``k`` successors of ``token`` [..., 1] (on this table's device), looked up there with no host
        read: LongTensor [..., k] (a batch's tokens [B, 1] give [B, k]), ``fill`` (a number, or a tensor that
        broadcasts, e.g. one id per row [B, 1]) past its successor list and in every slot for a token outside the
        graph (or at or past ``below``). The fixed-width, on-device form of :meth:`successors`, for a draft step."""
        last = min(self.indptr.numel() - 1, self.indptr.numel() - 1 if below is None else below) - 1
        if self.indices.numel() == 0 or last < 0:
            return torch.as_tensor(fill, dtype=torch.long, device=self.indices.device).expand(*token.shape[:-1], k)
        token = token.to(self.indptr.device)
        t = token.clamp(0, last)  # [1]
        slots = self.indptr[t] + torch.arange(k, device=self.indptr.device)  # [k]
        ids = self.indices[slots.clamp(max=self.indices.numel() - 1)].long()  # [k]
        valid = (slots < self.indptr[t + 1]) & (token >= 0) & (token <= last)
        return torch.where(valid, ids, fill)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors for the bundle, keyed without the stage prefix."""
        return {"indptr": self.indptr, "indices": self.indices, "probs": self.probs}

    @classmethod
    def from_bundle(cls, bundle: Bundle) -> "GraphTable":
        """Read the ``graph`` stage (once per bundle object; the table is immutable and shared)."""
        return _stage_table(cls, bundle, "graph", ("indptr", "indices", "probs"))
