"""The per-step policy microbenchmark runs every dynamic policy at tiny shapes and reports consistent figures."""

from __future__ import annotations

from dynvocab.bench.policy_step import POLICIES, policy_step_bench, render_policy_table

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 3000, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 512}


def test_policy_step_bench_times_every_dynamic_policy():
    result = policy_step_bench(dtypes=("float32",), cycles=4, warmup_cycles=2, target=TINY, threads=1)
    res = result["dtypes"]["float32"]
    assert res["eagle"]["step_ms"] == res["eagle"]["body_ms"] + res["eagle"]["head_ms"] > 0
    assert set(res["policies"]) == set(POLICIES)
    for name, r in res["policies"].items():
        assert abs(r["policy_ms"] - r["active_ms"] - r["observe_ms"]) < 1e-9
        assert r["head_ms"] > 0 and 0 < r["mean_active"] <= TINY["vocab_size"]
        assert r["share_of_eagle_step"] == r["policy_ms"] / res["eagle"]["step_ms"]
    assert render_policy_table(result).row_count == len(POLICIES)
