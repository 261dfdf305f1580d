"""The kernel microbenchmark and draft-step benchmark run and report well-formed results (no timing asserts)."""

import io

import pytest
from rich.console import Console

from dynvocab.bench.microbench import draft_step_bench, render_kernel_table, run_kernel_bench

TINY_DRAFT = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 2048}


def test_run_kernel_bench_cpu_small():
    result = run_kernel_bench("cpu", "float32", vocab=2048, dim=96, sizes=(100, 512, 4096), ms=(1, 3),
                              repeats=2, warmup=1, flush_cache=False, threads=1)
    assert result["device"] == "cpu" and result["dtype"] == "float32" and result["threads"] == 1
    assert result["bandwidth_gbps"] > 0
    assert "fused" not in result["methods"] and any("fused" in note for note in result["notes"])
    rows = {(r["method"], r["m"], r["rows"]) for r in result["results"]}
    assert ("full", 3, 2048) in rows and {r["method"] for r in result["results"]} == set(result["methods"])
    for method in ("static", "index_select", "packed"):
        assert {(method, m, s) for m in (1, 3) for s in (100, 512)} <= rows
    assert all(r["rows"] <= 2048 for r in result["results"])  # sizes past the vocabulary are dropped
    assert all(r["time_ms"] > 0 and r["gbps"] > 0 for r in result["results"])
    out = io.StringIO()
    Console(file=out, width=200).print(render_kernel_table(result))
    text = out.getvalue()
    assert "packed buffer" in text and "GB/s" in text and "fused" in text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_draft_step_bench_tiny(dtype):
    result = draft_step_bench(TINY_DRAFT, "cpu", dtype, layers=1, context=8, active=(1024, 128, 4096),
                              repeats=2, warmup=1, threads=1)
    assert result["config"]["num_hidden_layers"] == 1 and result["config"]["hidden_size"] == 64
    assert set(result["head_ms"]) == {"full", "1024", "1024_gathered", "128", "128_gathered"}
    for name, head in result["head_ms"].items():
        assert result["step_ms"][name] == pytest.approx(result["body_ms"] + head)
        assert 0 < result["head_share"][name] < 1


def test_draft_step_bench_rejects_unknown_config():
    with pytest.raises(ValueError, match="unknown draft config"):
        draft_step_bench("qwen9-huge")
