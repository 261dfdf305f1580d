"""The clusters stage: seeded spherical k-means on normalised LM-head rows."""

from __future__ import annotations

import pytest
import torch

from dynvocab.builders import clusters
from dynvocab.errors import DynvocabError


def planted(k: int = 8, per: int = 60, d: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows around ``k`` random directions with random norms (norms must not matter: spherical)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(k, d, generator=g), dim=1)
    labels = torch.arange(k).repeat_interleave(per)
    rows = centres[labels] + 0.08 * torch.randn(k * per, d, generator=g)
    norms = torch.rand(k * per, 1, generator=g) * 5 + 0.1
    return rows * norms, labels


def test_recovers_planted_clusters():
    head, labels = planted()
    cfg = clusters.ClustersConfig(num_clusters=8, chunk_rows=100)
    table, stats = clusters.build(cfg, head)
    assert table.assign.shape == (480,) and table.centroids.shape == (8, 24)
    assert torch.allclose(table.centroids.norm(dim=1), torch.ones(8), atol=1e-5)
    # Each planted group falls into exactly one cluster (k-means may need re-seeding to get there).
    pure = sum(len(set(table.assign[labels == c].tolist())) == 1 for c in range(8))
    assert pure >= 7
    assert stats["mean_cosine"] > 0.9 and stats["empty_clusters"] == 0
    assert int(table.sizes().sum()) == 480


def test_seeded_and_deterministic():
    head, _ = planted(seed=3)
    cfg = clusters.ClustersConfig(num_clusters=5)
    a, _ = clusters.build(cfg, head)
    b, _ = clusters.build(cfg, head)
    assert torch.equal(a.assign, b.assign) and torch.equal(a.centroids, b.centroids)


def test_members_are_the_union_of_clusters():
    head, _ = planted()
    table, _ = clusters.build(clusters.ClustersConfig(num_clusters=8), head)
    ids = table.members(torch.tensor([0, 3]))
    assert ids.tolist() == sorted(torch.nonzero((table.assign == 0) | (table.assign == 3)).flatten().tolist())


def test_zero_rows_and_duplicates_do_not_break_it():
    head, _ = planted(k=4, per=20)
    head = torch.cat([head, torch.zeros(10, 24), head[:5]])  # padding rows and duplicates
    table, stats = clusters.build(clusters.ClustersConfig(num_clusters=6), head)
    assert stats["empty_clusters"] == 0
    assert not torch.isnan(table.centroids).any()


def test_too_many_clusters_is_one_line():
    with pytest.raises(DynvocabError, match="--num-clusters"):
        clusters.build(clusters.ClustersConfig(num_clusters=50), torch.randn(10, 4))


def test_default_is_dynaspecs_m():
    assert clusters.ClustersConfig().num_clusters == 1024
