"""The router trainer on synthetic data and the router stage round trip."""

from __future__ import annotations

import torch

from dynvocab.artifacts import ClusterTable, ModelFingerprint, Stage, load_bundle, write_bundle
from dynvocab.artifacts.router import RouterMLP, RouterTable, clusters_checksum
from dynvocab.builders.router import data as router_data
from dynvocab.builders.router import fit
from dynvocab.builders.router import recall as router_recall
from dynvocab.builders.router.data import RouterData
from dynvocab.builders.router.fit import RouterConfig


def synthetic(rows: int, seed: int, vocab: int = 40, dim: int = 8, top_l: int = 3):
    """Rows whose top-L tokens are a fixed function of the hidden state and the token: a learnable task."""
    gen = torch.Generator().manual_seed(seed)
    truth = torch.Generator().manual_seed(99)
    w_h, w_e = torch.randn(vocab, dim, generator=truth), torch.randn(vocab, dim, generator=truth)
    embedding = torch.randn(vocab, dim, generator=truth)
    hidden = torch.randn(rows, dim, generator=gen)
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    top = (hidden @ w_h.T + embedding[tokens] @ w_e.T).topk(top_l, dim=-1).indices  # [rows, L]
    data = RouterData(hidden.to(torch.bfloat16), tokens, top, torch.arange(rows) // 10)
    return data, embedding


def test_labels_are_multi_hot_over_clusters():
    assign = torch.tensor([0, 0, 1, 2, 2, 3])
    y = fit.labels(torch.tensor([[0, 1, 4], [5, 2, 3]]), assign, 4)
    assert y.tolist() == [[1, 0, 1, 0], [0, 1, 1, 1]]


def test_training_loss_goes_down_and_recall_beats_static():
    assign = torch.arange(40) % 8  # 8 clusters of 5 tokens
    train, embedding = synthetic(1200, seed=0)
    held, _ = synthetic(300, seed=1)
    cfg = RouterConfig(top_l=3, width=32, epochs=6, batch_size=64, lr=1e-2, k_max=3)
    before = RouterMLP(8, 8, 32, 8)
    before.set_input_stats(*fit.input_stats(train, embedding))
    module, losses = fit.train(cfg, train, embedding, assign, 8)
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
    untrained = fit.mean_loss(before, held, embedding, assign)
    assert fit.mean_loss(module, held, embedding, assign) < 0.8 * untrained
    sizes = torch.bincount(assign, minlength=8)
    static = fit.positive_counts(train, assign, 8).argsort(descending=True)
    recall = router_recall.evaluate(module, held, embedding, assign, sizes, [1, 3], static, gamma=3)
    assert recall["3"]["top1_recall"] > recall["3"]["static_top1_recall"] + 0.1, recall
    assert recall["3"]["mean_shortlist"] == 15 and recall["1"]["cluster_recall"] < recall["3"]["cluster_recall"]
    assert recall["schedule"]["gamma"] == 3  # budgets 3, 3, 1
    assert abs(recall["schedule"]["mean_shortlist"] - (15 + 15 + 5) / 3) < 1e-9


def test_report_budgets_cover_the_schedule():
    assert router_recall.schedule(256) == [256, 256, 42, 32]
    assert router_recall.report_budgets(256) == [16, 32, 42, 64, 128, 256]
    assert router_recall.report_budgets(8) == [1, 8]


def test_split_holds_out_whole_documents():
    data, _ = synthetic(200, seed=0)  # 20 documents of 10 rows
    train, held = router_data.split(data, 10)
    assert set(held.doc.tolist()) == {9, 19} and held.rows == 20 and train.rows == 180
    assert not set(train.doc.tolist()) & set(held.doc.tolist())


def test_router_stage_round_trip(tmp_path):
    fp = ModelFingerprint(vocab_size=10, tokenizer_sha256="a" * 64, head_rows=12, hidden_size=4, source="d")
    clusters = ClusterTable(torch.arange(12) % 3, torch.eye(3, 4))
    path = tmp_path / "b.safetensors"
    write_bundle(path, [Stage("clusters", clusters.to_tensors(), {"num_clusters": 3})], fp, fp)
    torch.manual_seed(0)
    mlp = RouterMLP(4, 4, 6, 3)
    mlp.set_input_stats(torch.randn(8), torch.rand(8) + 0.5)
    table = RouterTable.from_module(mlp, {"top_l": 2, "clusters_sha256": clusters_checksum(load_bundle(path))})
    stages = [load_bundle(path).load_stage("clusters"), Stage("router", table.to_tensors(), table.config, {})]
    write_bundle(path, stages, fp, fp)
    bundle = load_bundle(path, verify=True)
    back = RouterTable.from_bundle(bundle)
    assert back.config["num_clusters"] == 3 and back.config["width"] == 6
    assert back.config["clusters_sha256"] == clusters_checksum(bundle)
    h, e = torch.randn(5, 4), torch.randn(5, 4)
    torch.testing.assert_close(back.module()(h, e), mlp(h, e))
