"""The candidate selectors (lowrank, centroids): their initialisation, training through train-router, the exact
top-k they select with, and lossless drafting over their sets with tiny local models."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import assert_one_line_error, run
from test_router_cli import build, train_args
from tiny_models import corpus_jsonl, tiny_dirs  # noqa: F401  (fixtures)

from dynvocab.artifacts import load_bundle
from dynvocab.artifacts.selectors import SelectorTable
from dynvocab.builders.router.selectors import balanced_blocks, block_of, default_budget, svd_init
from dynvocab.errors import DynvocabError
from dynvocab.models import load_model, load_tokenizer, resolve_model
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.heads.active_set import RowRanges
from dynvocab.runtime.selection.centroids import CentroidConfig
from dynvocab.runtime.selection.lowrank import LowRankConfig
from dynvocab.runtime.selection.batch_select import top_ids
from dynvocab.runtime.strategies import PolicyContext, StrategyOptions, make_policy


def test_svd_init_is_the_best_rank_r_approximation():
    torch.manual_seed(0)
    w = torch.randn(200, 24) @ torch.diag(torch.linspace(3, 0.1, 24))
    proj, rows = svd_init(w, 6)
    assert proj.shape == (6, 24) and rows.shape == (200, 6)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    best = (u[:, :6] * s[:6]) @ vh[:6]
    assert torch.allclose(rows @ proj, best, atol=1e-3)


def test_balanced_blocks_are_equal_and_cluster_the_rows():
    torch.manual_seed(1)
    centres = torch.nn.functional.normalize(torch.randn(8, 16), dim=1)
    w = (centres.repeat_interleave(20, 0) + 0.05 * torch.randn(160, 16))[torch.randperm(160)]
    w = torch.cat([w, torch.randn(5, 16)])  # 165 rows: the last block is short
    order = balanced_blocks(w, 20, iters=4)
    assert sorted(order.tolist()) == list(range(165))
    blocks = block_of(order, 20)
    assert torch.bincount(blocks).tolist() == [20] * 8 + [5]
    # rows of one planted centre share a block far more often than chance (1/9)
    nearest = (torch.nn.functional.normalize(w, dim=1) @ centres.T).argmax(1)
    same = [(blocks[:160][nearest[:160] == c].bincount().max() / 20).item() for c in range(8)]
    assert sum(same) / 8 > 0.8, same


@pytest.mark.parametrize("n,k", [(1000, 10), (151936, 2048), (5000, 4999), (300, 5000), (20000, 64)])
def test_top_ids_are_exactly_the_top_k(n, k):
    gen = torch.Generator().manual_seed(n + k)
    scores = torch.randn(n, generator=gen)
    got = top_ids(scores, k)
    want = scores.topk(min(k, n)).indices
    assert got.numel() == min(k, n) and set(got.tolist()) == set(want.tolist())
    skewed = scores.clone()
    skewed[: n // 2] += 10  # the top half far above the sample's estimate
    assert set(top_ids(skewed, min(k, n)).tolist()) == set(skewed.topk(min(k, n)).indices.tolist())


def test_default_budget_is_the_smallest_reaching_the_target():
    report = {"2": {"top1_recall": 0.9}, "4": {"top1_recall": 0.995}, "8": {"top1_recall": 1.0}}
    assert default_budget(report) == 4
    assert default_budget({"2": {"top1_recall": 0.5}, "4": {"top1_recall": 0.6}}) == 4


@pytest.fixture(scope="module")
def selectors_bundle(tiny_dirs, corpus_jsonl, tmp_path_factory):  # noqa: F811
    out = build(tiny_dirs, corpus_jsonl, tmp_path_factory.mktemp("sel") / "b.safetensors", "freq")
    result = run(*train_args(out, tiny_dirs, corpus_jsonl, "--selector", "lowrank,centroids", "--rank", 2,
                             "--block-size", 16, "--selector-epochs", 20))
    assert result.exit_code == 0, result.output
    for text in ("held-out lowrank recall", "held-out centroids recall", "(default)", "wrote"):
        assert text in result.output, result.output
    return out


def test_train_router_adds_trained_selectors_with_their_recall(selectors_bundle):
    bundle = load_bundle(selectors_bundle, verify=True)
    assert sorted(bundle.stages) == ["centroids", "freq", "lowrank"]
    for kind in ("lowrank", "centroids"):
        info, cfg = bundle.info(kind), bundle.config(kind)
        assert info["losses"][-1] < info["losses"][0]
        assert str(cfg["budget"]) in info["recall"]
        # trained beats the initialisation at the smallest budget (held-out documents)
        small = min(info["recall"], key=int)
        assert info["recall"][small]["top1_recall"] > info["untrained_recall"][small]["top1_recall"], kind
        for r in info["recall"].values():
            assert 0 <= r["top2_recall"] <= r["top1_recall"] <= 1
    table = SelectorTable.from_bundle(bundle, "centroids")
    order, size = table.tensors["order"], table.config["block_size"]
    assert sorted(order.tolist()) == list(range(order.numel())) and size == 16
    assert table.scorer()(torch.zeros(1, 16)).shape == (1, table.config["num_blocks"])


@pytest.fixture(scope="module")
def pair(tiny_dirs):  # noqa: F811
    target_dir, draft_dir = tiny_dirs
    return [CausalLM(load_model(resolve_model(str(target_dir)), "cpu", "float32")),
            DraftModel(load_model(resolve_model(str(draft_dir)), "cpu", "float32"))]


@pytest.mark.parametrize("strategy,config", [
    ("lowrank", LowRankConfig()), ("lowrank", LowRankConfig(candidates=3)),
    ("centroids", CentroidConfig()), ("centroids", CentroidConfig(blocks=1)),
])
def test_selectors_are_lossless_in_the_loop(selectors_bundle, pair, tiny_dirs, strategy, config):  # noqa: F811
    target, draft = pair
    eos = {load_tokenizer(resolve_model(str(tiny_dirs[0]))).eos_token_id}
    ctx = PolicyContext(draft.vocab_size, eos, "cpu", load_bundle(selectors_bundle), draft.info, target)
    sizes = set()
    for seed in range(3):
        prompt = torch.randint(0, 300, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        policy = make_policy(strategy, StrategyOptions(configs=(config,)), ctx)
        seen = []
        original = policy.active_ids
        policy.active_ids = lambda *a, **k: seen.append(original(*a, **k)) or seen[-1]
        decode = DecodeConfig(gamma=3, max_new_tokens=16)
        ar = speculative_generate(target, prompt, decode, eos)
        spec = speculative_generate(target, prompt, decode, eos, draft, policy)
        assert spec.token_ids == ar.token_ids
        sizes |= {s.size for s in seen}
        if strategy == "centroids":
            assert all(isinstance(s.segments[0], RowRanges) for s in seen)
    assert max(sizes) < draft.vocab_size
    if strategy == "lowrank":
        assert len(sizes) == 1  # a fixed size at every step


def test_a_selector_for_another_draft_is_refused(selectors_bundle, pair, tiny_dirs):  # noqa: F811
    target, _ = pair
    ctx = PolicyContext(target.vocab_size, set(), "cpu", load_bundle(selectors_bundle), DraftModel(target.model).info)  # hidden 32, not 16
    with pytest.raises(DynvocabError, match="reads hidden size 16, the draft has 32"):
        make_policy("lowrank", StrategyOptions(), ctx)


def test_bad_selector_options_are_one_line(selectors_bundle, tiny_dirs, corpus_jsonl, tmp_path):  # noqa: F811
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(selectors_bundle.read_bytes())
    assert_one_line_error(run(*train_args(copy, tiny_dirs, corpus_jsonl, "--selector", "lowrank,magic")), "--selector")
    assert_one_line_error(run(*train_args(copy, tiny_dirs, corpus_jsonl, "--selector", "router")), "no 'clusters' stage")
    assert copy.read_bytes() == selectors_bundle.read_bytes()
