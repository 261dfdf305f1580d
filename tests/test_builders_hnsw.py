"""The hnsw stage: MIPS over LM-head rows on a projection, re-ranked exactly; recall@10 ≥ 0.95 against brute force."""

from __future__ import annotations

import numpy as np
import torch
from tiny_models import tiny_dirs  # noqa: F401  (fixture)

from dynvocab.artifacts import HnswParams, Stage, augment_queries, augment_rows, load_bundle, load_hnsw, mips_search, write_bundle
from dynvocab.artifacts.fingerprint import ModelFingerprint
import pytest

from dynvocab.artifacts.hnsw import graph_tensors, index_from_graph, project_rows, rerank
from dynvocab.errors import DynvocabError
from dynvocab.builders import hnsw


def synthetic_head(vocab: int = 6000, d: int = 64, seed: int = 0) -> torch.Tensor:
    """LM-head-like rows: a few shared directions plus noise, with log-normal norms."""
    g = torch.Generator().manual_seed(seed)
    topics = torch.randn(32, d, generator=g)
    mix = torch.randn(vocab, 32, generator=g).pow(3) / 10  # sparse-ish topic weights
    rows = mix @ topics + torch.randn(vocab, d, generator=g)
    norms = torch.exp(0.3 * torch.randn(vocab, 1, generator=g))
    return torch.nn.functional.normalize(rows, dim=1) * norms


def hidden_state_like(head: torch.Tensor, n: int = 300, seed: int = 1) -> torch.Tensor:
    """Queries like final hidden states of a real LM: a large shared mean, a few massive channels, and a part
    pointing at a few output rows; RMS-normalised with a per-channel gain (as a final RMSNorm does)."""
    d = head.shape[1]
    g = torch.Generator().manual_seed(42)  # the model: fixed across query sets
    mean = torch.randn(d, generator=g)
    gain = torch.ones(d)
    gain[torch.randperm(d, generator=g)[:3]] = torch.tensor([20.0, 12.0, 8.0])  # massive channels
    g = torch.Generator().manual_seed(seed)  # the contexts
    picks = torch.randint(0, head.shape[0], (n, 3), generator=g)
    signal = torch.nn.functional.normalize(head[picks].sum(dim=1), dim=1) * d**0.5
    q = 0.8 * mean + signal + 0.5 * torch.randn(n, d, generator=g)
    return q / q.pow(2).mean(dim=1, keepdim=True).sqrt() * gain


def test_norm_augmentation_turns_mips_into_l2():
    head = synthetic_head(500, 16)
    data, r = augment_rows(head)
    assert np.allclose(np.linalg.norm(data, axis=1), r, rtol=1e-4)
    q = augment_queries(hidden_state_like(head, 20))
    l2 = ((q[:, None, :] - data[None, :, :]) ** 2).sum(-1)  # [20, 500]
    ip = q[:, :-1] @ head.numpy().T
    assert (l2.argmin(axis=1) == ip.argmax(axis=1)).all()


def test_preconditioner_keeps_inner_products():
    head = synthetic_head(300, 24)
    fit = hidden_state_like(head, 200, seed=5)
    root, inv_root = hnsw.fit_preconditioner(fit, shrinkage=0.1)
    q = hidden_state_like(head, 10, seed=6)
    assert torch.allclose((q @ inv_root) @ (head @ root).T, q @ head.T, rtol=1e-3, atol=1e-3)


def test_projection_keeps_inner_products_at_full_rank_and_most_of_them_below():
    head = synthetic_head(2000, 48)
    fit, q = hidden_state_like(head, 400, seed=7), hidden_state_like(head, 50, seed=8)
    row_map, query_map = hnsw.fit_projection(head, 48, fit)
    assert torch.allclose((q @ query_map) @ (head @ row_map).T, q @ head.T, rtol=1e-3, atol=1e-3)
    row_map, query_map = hnsw.fit_projection(head, 16, fit)
    assert row_map.shape == query_map.shape == (48, 16)
    approx, exact = (q @ query_map) @ (head @ row_map).T, q @ head.T  # [50, 2000]
    assert torch.corrcoef(torch.stack([approx.flatten(), exact.flatten()]))[0, 1] > 0.8


def test_recall_at_10_against_brute_force():
    head = synthetic_head()
    fit, held_out = hidden_state_like(head, 600, seed=2), hidden_state_like(head, 300, seed=3)
    index = hnsw.build_index(hnsw.HnswConfig(rank=32), head, fit)
    assert index.params.m == 32 and index.params.dim == 33 and index.params.hidden == head.shape[1]
    recall = hnsw.recall_at_k(index, head, held_out, k=10)
    assert recall >= 0.95, recall


def test_rerank_returns_the_exact_top_k_of_the_candidates():
    g = torch.Generator().manual_seed(3)
    head = torch.randn(500, 24, generator=g)
    queries = torch.randn(7, 24, generator=g)
    candidates = torch.stack([torch.randperm(500, generator=g)[:40] for _ in range(7)])  # [7, 40]
    got = rerank(head, queries, candidates, 10)  # [7, 10]
    for q, c, ids in zip(queries, candidates, got):
        scores = head[c] @ q  # [40]
        assert torch.equal(ids, c[scores.topk(10).indices])
        assert set(ids.tolist()) <= set(c.tolist())


def test_graph_without_vectors_rebuilds_the_same_index():
    head = synthetic_head(1500, 32)
    fit, queries = hidden_state_like(head, 300, seed=4), hidden_state_like(head, 40, seed=5)
    index = hnsw.build_index(hnsw.HnswConfig(rank=16, ef_construction=64, num_threads=2), head, fit)
    tensors, layout = graph_tensors(index.index)
    assert tensors["links"].shape[0] == 1500 and tensors["links"].dtype == torch.uint8
    vectors, _ = augment_rows(project_rows(head, index.row_map))
    again = index_from_graph(tensors, vectors, layout, ef=index.params.ef_search)
    z = augment_queries(queries @ index.query_map)
    assert np.array_equal(index.index.knn_query(z, k=20)[0], again.knn_query(z, k=20)[0])


def test_index_round_trips_through_the_bundle(tmp_path):
    head = synthetic_head(2000, 32)
    fit, queries = hidden_state_like(head, 300, seed=4), hidden_state_like(head, 50, seed=5)
    cfg = hnsw.HnswConfig(ef_construction=100, rank=16)
    tensors, params, stats = hnsw.build(cfg, head, fit, queries)
    assert set(tensors) == {"links", "link_lists", "element_levels", "row_map", "query_map"}
    assert tensors["query_map"].shape == (32, 16) and tensors["links"].dtype == torch.uint8
    assert tensors["links"].shape[1] == params.layout["size_data_per_element"] - 4 * params.dim  # no vectors stored
    assert stats["recall@10"] >= 0.95 and stats["recall_queries"] == 50 and stats["preconditioned"]
    fp = ModelFingerprint(2000, "0" * 64, 2000, 32)
    stage = Stage("hnsw", tensors, cfg.as_dict(), {"index": params.as_dict()})
    path = write_bundle(tmp_path / "h.safetensors", [stage], fp, None)
    bundle = load_bundle(path)
    index, loaded = load_hnsw(bundle, head)
    assert loaded == params and isinstance(loaded, HnswParams) and loaded.layout == params.layout
    assert load_hnsw(bundle, head)[0] is index  # rebuilt from the graph once per bundle object
    ids = mips_search(index, queries, 10)
    assert ids.shape == (50, 10) and ids.dtype == torch.int64
    assert hnsw.recall(ids, hnsw.exact_mips(head, queries, 10)) == stats["recall@10"]
    assert torch.equal(mips_search(index, queries[0], 5), ids[:1, :5])  # a single [d] query works too
    with pytest.raises(DynvocabError, match="2,000×32 head.*1,999×32.*rebuild"):
        load_hnsw(bundle, head[:-1])


def test_an_old_full_dimension_index_is_refused_in_one_line(tmp_path):
    old = {"dim": 33, "num_elements": 2000, "max_norm": 1.0, "m": 32, "ef_construction": 200, "ef_search": 512, "space": "l2"}
    stage = Stage("hnsw", {"index": torch.zeros(8, dtype=torch.uint8), "query_map": torch.eye(32)}, {}, {"index": old})
    path = write_bundle(tmp_path / "old.safetensors", [stage], ModelFingerprint(2000, "0" * 64, 2000, 32), None)
    with pytest.raises(DynvocabError, match="old full-dimension layout.*rebuild it with `dynvocab build-index --stages hnsw"):
        load_hnsw(load_bundle(path), synthetic_head(2000, 32))


def test_without_sample_queries_the_maps_are_the_identity_at_full_rank_and_principal_axes_below():
    head = synthetic_head(500, 16)
    index = hnsw.build_index(hnsw.HnswConfig(ef_construction=50), head, None)  # rank 0: the full hidden size
    assert index.params.rank == 16 and torch.equal(index.row_map, torch.eye(16)) and torch.equal(index.query_map, torch.eye(16))
    row_map, query_map = hnsw.fit_projection(head, 4)
    assert torch.equal(row_map, query_map) and torch.allclose(row_map.T @ row_map, torch.eye(4), atol=1e-5)


def test_hidden_states_are_the_same_in_padded_batches(tiny_dirs):  # noqa: F811
    from dynvocab.builders.models import hidden_states
    from dynvocab.models import load_tokenizer, resolve_model

    spec = resolve_model(str(tiny_dirs[0]))
    tok = load_tokenizer(spec)
    texts = ["the model runs fast", "a b", "def x(x):\n    return x + 3", ""]
    batched = hidden_states(spec, tok, texts, max_tokens=12, batch_size=4)
    single = hidden_states(spec, tok, texts, max_tokens=12, batch_size=1)
    assert [s.shape[0] for s in batched] == [min(len(tok(t)["input_ids"]), 12) or 1 for t in texts]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(batched, single))
