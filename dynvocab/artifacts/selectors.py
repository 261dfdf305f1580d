"""Learned candidate selectors of the draft head's rows: the modules the trainer fits and the runtime runs, and
their bundle stages.

Both score the draft's vocabulary from the hidden state the head reads (``h`` [d]) and keep a fixed number of
candidates, over which the draft's exact head then runs:

- ``lowrank`` (SpecVocab's vocabulary speculator, EAGLE-4's low-rank candidate head): ``s = R (P h) + b`` scores
  every id at rank r (``P`` [r, d], ``R`` [V, r], ``b`` [V]), initialised from the SVD of the head's rows and then
  trained on the draft's own predictions; the top-k ids are the candidates.
- ``centroids`` (Gemma-4's MTP drafter, ``Gemma4MTPMaskedEmbedder`` in vLLM's gemma4_mtp.py): the vocabulary is
  ordered into equal blocks of ``block_size`` ids (balanced clustering of the head's rows, ``order`` [V]); a
  centroid per block scores it, ``s = C h + b`` (``C`` [B, d], ``b`` [B]); the top-c blocks are the candidates —
  c contiguous runs of one reordered copy of the head.

Stages ``lowrank`` (tensors ``proj``, ``rows``, ``bias``) and ``centroids`` (``order`` int64, ``centroids``,
``bias``), float32; the config holds the shapes, the default budget (the smallest whose held-out top-1 recall
reached the target) and the training report.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from dynvocab.artifacts.bundle import Bundle
from dynvocab.errors import DynvocabError

LOWRANK = "lowrank"
CENTROIDS = "centroids"
SELECTOR_STAGES = (LOWRANK, CENTROIDS)


class LowRankScorer(nn.Module):
    """Scores [n, V] of every id at rank r: ``(h @ proj.T) @ rows.T + bias``."""

    def __init__(self, proj: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.proj = nn.Parameter(proj.float().clone())  # [r, d]
        self.rows = nn.Parameter(rows.float().clone())  # [V, r]
        self.bias = nn.Parameter(torch.zeros(rows.shape[0]) if bias is None else bias.float().clone())  # [V]

    @property
    def units(self) -> int:
        """Scored units: token ids."""
        return self.rows.shape[0]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h.float() @ self.proj.T) @ self.rows.T + self.bias


class CentroidScorer(nn.Module):
    """Scores [n, B] of the vocabulary's blocks: ``h @ centroids.T + bias``."""

    def __init__(self, centroids: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.centroids = nn.Parameter(centroids.float().clone())  # [B, d]
        self.bias = nn.Parameter(torch.zeros(centroids.shape[0]) if bias is None else bias.float().clone())  # [B]

    @property
    def units(self) -> int:
        """Scored units: blocks."""
        return self.centroids.shape[0]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.float() @ self.centroids.T + self.bias


_SHAPES = {
    LOWRANK: lambda c: {"proj": (c["rank"], c["hidden_dim"]), "rows": (c["vocab_rows"], c["rank"]),
                        "bias": (c["vocab_rows"],)},
    CENTROIDS: lambda c: {"order": (c["vocab_rows"],), "centroids": (c["num_blocks"], c["hidden_dim"]),
                          "bias": (c["num_blocks"],)},
}


@dataclass(frozen=True)
class SelectorTable:
    """A selector stage: its tensors and config (``hidden_dim``, ``vocab_rows``, ``budget``, and ``rank`` or
    ``block_size`` / ``num_blocks``)."""

    kind: str  # LOWRANK or CENTROIDS
    tensors: dict[str, torch.Tensor]
    config: dict

    @classmethod
    def lowrank(cls, scorer: LowRankScorer, config: dict) -> "SelectorTable":
        """Snapshot a trained low-rank scorer."""
        t = {"proj": scorer.proj, "rows": scorer.rows, "bias": scorer.bias}
        shapes = {"rank": scorer.proj.shape[0], "hidden_dim": scorer.proj.shape[1], "vocab_rows": scorer.units}
        return cls(LOWRANK, _snapshot(t), {**config, **shapes})

    @classmethod
    def centroids(cls, scorer: CentroidScorer, order: torch.Tensor, block_size: int, config: dict) -> "SelectorTable":
        """Snapshot a trained centroid scorer with its id order (blocks of ``block_size``, the last may be short)."""
        t = _snapshot({"centroids": scorer.centroids, "bias": scorer.bias})
        t["order"] = order.long().cpu().contiguous()
        shapes = {"block_size": block_size, "num_blocks": scorer.units, "hidden_dim": scorer.centroids.shape[1],
                  "vocab_rows": int(order.numel())}
        return cls(CENTROIDS, t, {**config, **shapes})

    def scorer(self) -> LowRankScorer | CentroidScorer:
        """The float32 module (eval mode) holding these weights."""
        t = self.tensors
        module = LowRankScorer(t["proj"], t["rows"], t["bias"]) if self.kind == LOWRANK else CentroidScorer(
            t["centroids"], t["bias"])
        return module.eval()

    @classmethod
    def from_bundle(cls, bundle: Bundle, kind: str) -> "SelectorTable":
        """Read stage ``kind`` and check its tensors agree with its config (one line otherwise)."""
        tensors, config = bundle.stage_tensors(kind), bundle.config(kind)
        try:
            ok = all(tuple(tensors[k].shape) == tuple(int(x) for x in s) for k, s in _SHAPES[kind](config).items())
            if kind == CENTROIDS:
                size, n = int(config["block_size"]), int(config["vocab_rows"])
                ok = ok and size >= 1 and int(config["num_blocks"]) == -(-n // size)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise DynvocabError(
                f"bundle {bundle.path} has a malformed {kind} stage; retrain it with "
                f"`dynvocab train-router --selector {kind} --bundle {bundle.path}`"
            )
        return cls(kind, tensors, config)


def random_selectors(
    vocab: int, dim: int, generator: torch.Generator, rank: int = 256, candidates: int = 4096, block: int = 128,
    blocks: int = 32,
) -> tuple["SelectorTable", "SelectorTable"]:
    """A ``lowrank`` and a ``centroids`` table of random weights at these sizes (default budgets ``candidates``
    ids and ``blocks`` blocks): what the benches time a selector's step with, when no trained one is at hand."""
    return random_lowrank(vocab, dim, generator, rank, candidates), random_centroids(vocab, dim, generator, block, blocks)


def random_lowrank(vocab: int, dim: int, g: torch.Generator, rank: int = 256, candidates: int = 4096,
                   ) -> "SelectorTable":
    """A ``lowrank`` table of random weights at rank ``rank``, default budget ``candidates`` ids."""
    scorer = LowRankScorer(torch.randn(rank, dim, generator=g) * dim**-0.5, torch.randn(vocab, rank, generator=g))
    return SelectorTable.lowrank(scorer, {"budget": candidates})


def random_centroids(vocab: int, dim: int, g: torch.Generator, block: int = 128, blocks: int = 32,
                     ) -> "SelectorTable":
    """A ``centroids`` table of random weights over blocks of ``block`` ids, default budget ``blocks`` blocks."""
    scorer = CentroidScorer(torch.randn(-(-vocab // block), dim, generator=g))
    return SelectorTable.centroids(scorer, torch.randperm(vocab, generator=g), block, {"budget": blocks})


def _snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}
