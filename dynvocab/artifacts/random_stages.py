"""Bundles of random stages at any shape: what the benches time a strategy's step with when no trained bundle is at
hand (on a GPU machine nothing is downloaded), and what the tests build tiny bundles from. Nothing here is trained:
the figures they give are costs, never recall."""

from __future__ import annotations

from pathlib import Path

import torch

from dynvocab.artifacts.bundle import Stage, tensor_sha256, write_bundle
from dynvocab.artifacts.fingerprint import ModelFingerprint
from dynvocab.artifacts.router import RouterMLP, RouterTable
from dynvocab.artifacts.selectors import random_selectors
from dynvocab.artifacts.tables import ClusterTable, FreqTable, GraphTable


def random_context_stages(g: torch.Generator, vocab: int, dim: int, clusters: int = 12, width: int = 16,
                          fanout: int = 5) -> list[Stage]:
    """Random ``clusters`` (``clusters`` of them over ``vocab`` ids), ``router`` (a ``width``-wide MLP over hidden
    states and embeddings of ``dim``, for those clusters) and ``graph`` (0 … ``fanout`` - 1 successors per id)
    stages: what the context strategies read besides ``freq``."""
    assign = torch.randint(0, clusters, (vocab,), generator=g)
    table = ClusterTable(assign, torch.randn(clusters, dim, generator=g))
    mlp = RouterMLP(dim, dim, width, clusters)
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(torch.randn(param.shape, generator=g))
    stages = [Stage("clusters", table.to_tensors(), {}, {})]
    router = RouterTable.from_module(mlp, {"top_l": 1, "clusters_sha256": tensor_sha256(table.to_tensors()["assign"])})
    stages.append(Stage("router", router.to_tensors(), router.config, {}))
    counts = torch.randint(0, fanout, (vocab,), generator=g)
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    graph = GraphTable(indptr, torch.randint(0, vocab, (int(indptr[-1]),), generator=g).int(),
                       torch.rand(int(indptr[-1]), generator=g))
    return stages + [Stage("graph", graph.to_tensors(), {}, {})]


def random_frequencies(g: torch.Generator, vocab: int, eos: int = 0) -> Stage:
    """A ``freq`` stage of random counts whose ranking puts ``eos`` first (as a real corpus's EOS is kept)."""
    counts = torch.randint(0, 1000, (vocab,), generator=g)
    rest = torch.argsort(counts, descending=True, stable=True)
    ranking = torch.cat([torch.tensor([eos]), rest[rest != eos]])
    return Stage("freq", FreqTable(counts=counts, ranking=ranking, eos_ids=torch.tensor([eos])).to_tensors(), {}, {})


def random_bundle(path: str | Path, vocab: int, dim: int, seed: int = 0, clusters: int = 1024, width: int = 1024,
                  rank: int = 256, candidates: int = 2048, block: int = 128, blocks: int = 128) -> Path:
    """A bundle at ``path`` for a head of ``vocab`` rows read at ``dim``: random ``freq``, ``lowrank`` (rank
    ``rank``, ``candidates`` ids), ``centroids`` (``blocks`` blocks of ``block``) and context stages (``clusters``
    clusters, a ``width``-wide router), the same model as target and draft. Defaults: the demo bundle's sizes."""
    g = torch.Generator().manual_seed(seed)
    low, cen = random_selectors(vocab, dim, g, rank=rank, candidates=candidates, block=block, blocks=blocks)
    stages = [random_frequencies(g, vocab), Stage(low.kind, low.tensors, low.config, {}),
              Stage(cen.kind, cen.tensors, cen.config, {}),
              *random_context_stages(g, vocab, dim, clusters=clusters, width=width)]
    fp = ModelFingerprint(vocab, "random", vocab, dim, "random")
    return write_bundle(path, stages, fp, fp)
