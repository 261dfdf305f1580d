"""The graph stage: EvoSpec's pruned bigram successors as CSR."""

from __future__ import annotations

import numpy as np
import pytest

from dynvocab.builders import graph
from dynvocab.builders.counting import BigramCounter


def counted(pairs: dict[tuple[int, int], int], vocab: int):
    counter = BigramCounter(vocab)
    for (u, v), c in pairs.items():
        for _ in range(c):
            counter.add(np.array([u, v]))
    return counter.result()


def test_pruning_follows_evospec():
    vocab = 6
    pairs = {(0, 1): 50, (0, 2): 30, (0, 3): 4, (0, 4): 16, (1, 2): 5, (2, 0): 3, (5, 5): 9}
    keys, counts = counted(pairs, vocab)
    table = graph.build(graph.GraphConfig(min_count=5, tau=0.2, max_out_degree=2), keys, counts, vocab)
    assert table.indptr.tolist() == [0, 2, 3, 3, 3, 3, 4]
    ids, probs = table.successors(0)
    assert ids.tolist() == [1, 2]  # (0,3): count 4 < 5; (0,4): p = 0.16 < τ; degree cap 2
    assert probs.tolist() == pytest.approx([0.5, 0.3])  # p over all 100 successors of 0, before pruning
    assert table.successors(1)[0].tolist() == [2] and table.successors(1)[1].tolist() == pytest.approx([1.0])
    assert table.successors(2)[0].numel() == 0  # count 3 < 5
    assert table.successors(5)[0].tolist() == [5]
    assert table.indices.dtype.is_floating_point is False and table.probs.dtype.is_floating_point


def zipf_graph(cfg, vocab: int, seed: int, exponent: float, rounds: int, size: int):
    """The graph of ``rounds`` Zipf-distributed token streams of ``size`` ids below ``vocab``."""
    rng = np.random.default_rng(seed)
    counter = BigramCounter(vocab, flush_at=1000)
    for _ in range(rounds):
        counter.add(rng.zipf(exponent, size=size).clip(max=vocab) - 1)
    keys, counts = counter.result()
    return graph.build(cfg, keys, counts, vocab)


def test_rows_sorted_by_probability_and_capped():
    vocab = 50
    cfg = graph.GraphConfig(max_out_degree=8)
    table = zipf_graph(cfg, vocab, seed=1, exponent=1.3, rounds=300, size=200)
    degree = (table.indptr[1:] - table.indptr[:-1]).numpy()
    assert degree.max() <= 8 and table.indptr[-1] == table.num_edges
    for u in range(vocab):
        _, p = table.successors(u)
        assert np.all(np.diff(p.numpy()) <= 0)
        assert np.all(p.numpy() >= cfg.tau)
    stats = graph.summary(table)
    assert stats["edges"] == table.num_edges and stats["sources"] == int((degree > 0).sum())


def test_top_successors_is_successors_padded_on_the_device_form():
    """The draft step's fixed-width lookup (no host read) agrees with the host one: the first k successors, then
    the fill; every slot the fill for a token outside the graph or at or past ``below``."""
    import torch

    vocab = 40
    table = zipf_graph(graph.GraphConfig(max_out_degree=5), vocab, seed=2, exponent=1.4, rounds=100, size=100).to("cpu")
    fill = vocab
    for k in (1, 3, 8):
        for u in range(vocab):
            want = table.successors(u, k)[0].tolist()
            got = table.top_successors(torch.tensor([u]), k, fill).tolist()
            assert got == want + [fill] * (k - len(want))
        for u in (-1, vocab, vocab + 7):
            assert table.top_successors(torch.tensor([u]), k, fill).tolist() == [fill] * k
        assert table.top_successors(torch.tensor([vocab - 1]), k, fill, below=vocab - 1).tolist() == [fill] * k


def test_defaults_are_the_papers():
    cfg = graph.GraphConfig()
    assert (cfg.min_count, cfg.tau, cfg.max_out_degree) == (5, 1e-4, 64)
