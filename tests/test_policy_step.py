"""The per-step policy microbenchmark runs every dynamic policy at tiny shapes and reports consistent figures."""

from __future__ import annotations

from tiny_models import corpus_jsonl, tiny_dirs  # noqa: F401  (fixtures)

from dynvocab.bench.policy_step import policy_rows, policy_step_bench, render_policy_table

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 3000, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 512}


def test_policy_step_bench_times_every_dynamic_policy():
    result = policy_step_bench(dtypes=("float32",), cycles=4, warmup_cycles=2, target=TINY, threads=1)
    res = result["dtypes"]["float32"]
    assert res["eagle"]["step_ms"] == res["eagle"]["body_ms"] + res["eagle"]["head_ms"] > 0
    assert set(res["policies"]) == set(policy_rows())
    for name, r in res["policies"].items():
        assert abs(r["policy_ms"] - r["active_ms"] - r["observe_ms"]) < 1e-9
        assert r["head_ms"] > 0 and 0 < r["mean_active"] <= TINY["vocab_size"]
        assert r["share_of_eagle_step"] == r["policy_ms"] / res["eagle"]["step_ms"]
    assert render_policy_table(result).row_count == len(policy_rows())


def test_policy_step_bench_reads_a_bundle(tmp_path, tiny_dirs, corpus_jsonl):  # noqa: F811
    from cli_helpers import run

    from dynvocab.artifacts import load_bundle

    out = tmp_path / "b.safetensors"
    result = run("build-index", "--target", tiny_dirs[0], "--draft", tiny_dirs[1], "--corpus", corpus_jsonl,
                 "--out", out, "--num-clusters", 8, "--device", "cpu")
    assert result.exit_code == 0, result.output
    result = run("train-router", "--bundle", out, "--draft", tiny_dirs[1], "--target", tiny_dirs[0], "--corpus",
                 corpus_jsonl, "--max-docs", 20, "--max-tokens", 16, "--epochs", 1, "--hidden", 16, "--k-max", 3,
                 "--device", "cpu")
    assert result.exit_code == 0, result.output
    with load_bundle(out) as bundle:
        vocab = bundle.fingerprints["target"].head_rows
        result = policy_step_bench(bundle, dtypes=("float32",), cycles=3, warmup_cycles=1,
                                   target={**TINY, "vocab_size": vocab}, threads=1)
    assert result["tables"] == "bundle"
    rows = result["dtypes"]["float32"]["policies"]
    assert set(rows) == set(policy_rows())
    assert all(0 < r["mean_active"] <= vocab for r in rows.values())
