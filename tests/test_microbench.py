"""The kernel microbenchmark and draft-step benchmark run and report well-formed results (no timing asserts);
``dynvocab microbench``'s modes, at tiny shapes, print their tables and write their JSON."""

import io
import json

import pytest
from cli_helpers import assert_one_line_error, run
from rich.console import Console

from dynvocab.bench.micro import draft_step, eagle_step, microbench, policy_step
from dynvocab.bench.micro.microbench import draft_step_bench, render_kernel_table, run_kernel_bench
from dynvocab.bench.micro.timing import StepParams

pytestmark = pytest.mark.usefixtures("one_thread")  # and puts back the threads a --threads run sets
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
    step = StepParams(context=8, active=(1024, 128, 4096), repeats=2, warmup=1)
    result = draft_step_bench(TINY_DRAFT, "cpu", dtype, layers=1, step=step, threads=1)
    assert result["config"]["num_hidden_layers"] == 1 and result["config"]["hidden_size"] == 64
    assert set(result["head_ms"]) == {"full", "1024", "1024_gathered", "128", "128_gathered"}
    for name, head in result["head_ms"].items():
        assert result["step_ms"][name] == pytest.approx(result["body_ms"] + head)
        assert 0 < result["head_share"][name] < 1


def test_draft_step_bench_rejects_unknown_config():
    with pytest.raises(ValueError, match="unknown draft config"):
        draft_step_bench("qwen9-huge")


TINY_TARGET = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 3000, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 512}
TINY_EAGLE = dict(kind="eagle", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=9000)


def shrunk(monkeypatch, module, name: str, **small):
    """Make ``module.name`` run at ``small`` shapes (what the command passes still reaches it); returns its calls."""
    calls = []
    original = getattr(module, name)

    def small_run(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **{**small, **kwargs})

    monkeypatch.setattr(module, name, small_run)
    return calls


def test_microbench_kernels_prints_the_table_and_writes_json(monkeypatch, tmp_path):
    shrunk(monkeypatch, microbench, "run_kernel_bench", vocab=2048, dim=64, sizes=(128,), ms=(1,), repeats=1,
           warmup=0, flush_cache=False)
    out = tmp_path / "k.json"
    result = run("microbench", "kernels", "--device", "cpu", "--threads", 1, "--json", out)
    assert result.exit_code == 0, result.output
    assert "LM-head kernels" in result.output and "packed buffer" in result.output
    data = json.loads(out.read_text())
    assert (data["dtype"], data["vocab"], data["threads"]) == ("float32", 2048, 1)
    assert {r["method"] for r in data["results"]} == set(data["methods"])


def test_microbench_policy_steps_times_the_asked_rows(monkeypatch, tmp_path):
    calls = shrunk(monkeypatch, policy_step, "policy_step_bench", policies=("microspec",), cycles=2, warmup_cycles=1,
                   target=TINY_TARGET)
    out = tmp_path / "p.json"
    result = run("microbench", "policy-steps", "--dtype", "float32", "--draft-weights", "int8", "--draft-kind",
                 "eagle1", "--threads", 1, "--json", out)
    assert result.exit_code == 0, result.output
    assert calls[0]["dtypes"] == ("int8", "float32") and calls[0]["kind"] == "eagle1"  # int8 rows first
    assert "policy time per draft step" in result.output
    data = json.loads(out.read_text())
    assert data["tables"] == "synthetic" and set(data["dtypes"]) == {"int8", "float32"}
    assert set(data["dtypes"]["float32"]["policies"]) == {"full", "microspec"}


def test_microbench_eagle_step_times_every_shape(monkeypatch, tmp_path):
    shapes = {"tiny-a": TINY_EAGLE, "tiny-b": {**TINY_EAGLE, "vocab_size": 5000}}
    monkeypatch.setattr(eagle_step, "EAGLE_SHAPES", shapes)
    shrunk(monkeypatch, eagle_step, "eagle_step_bench", step=StepParams(context=8, active=(3072,), repeats=1, warmup=0))
    out = tmp_path / "e.json"
    result = run("microbench", "eagle-step", "--device", "cpu", "--dtype", "float32", "--draft-weights", "float32",
                 "--json", out)
    assert result.exit_code == 0, result.output
    assert "one EAGLE draft step" in result.output
    rows = json.loads(out.read_text())["eagle_step"]
    assert [r["shape"] for r in rows] == ["tiny-a", "tiny-b"] and {r["weights"] for r in rows} == {"float32"}


def test_microbench_draft_step_splits_body_and_head(monkeypatch, tmp_path):
    small = StepParams(context=8, active=(1024, 128), repeats=1, warmup=0)
    calls = shrunk(monkeypatch, draft_step, "draft_step_bench", step=small)
    monkeypatch.setitem(draft_step.DRAFT_CONFIGS, "qwen2-0.5b", {**draft_step.QWEN2_0_5B, **TINY_DRAFT})
    out = tmp_path / "d.json"
    result = run("microbench", "draft-step", "--device", "cpu", "--layers", 1, "--threads", 1, "--json", out)
    assert result.exit_code == 0, result.output
    assert calls[0]["layers"] == 1 and calls[0]["dtype"] == "float32"
    assert "one draft-model step" in result.output and "1024_gathered" in result.output
    data = json.loads(out.read_text())
    assert data["config"]["num_hidden_layers"] == 1 and set(data["head_ms"]) >= {"full", "1024", "128_gathered"}


def test_microbench_usage_errors_name_the_mode():
    result = run("microbench", "kernels", "--bogus")
    assert_one_line_error(result, "No such option", "see `dynvocab microbench kernels --help`")
    assert_one_line_error(run("microbench", "kernels", "--json", "/nonexistent-folder/k.json"), "--json")
    assert run("microbench").exit_code != 0
