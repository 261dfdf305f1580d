"""``dynvocab bench --vllm`` through CliRunner: refusals in one line without vLLM, and one run on a real vLLM-CPU
engine with the tiny models (two engines: plain, then every speculative row in one) where vLLM is installed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from cli_helpers import assert_one_line_error, run
from vllm_models import ENGINE_ENV, LOWRANK_K, vllm_bundle, vllm_pair  # noqa: F401

from dynvocab.bench.engines.vllm.rows import engine_env, last_error_line, plugin_strategies, summarize_row
from dynvocab.bench.loop.items import BenchItem
from dynvocab.models import load_tokenizer, resolve_model
from dynvocab.prompts import encode_prompt
from dynvocab.errors import DynvocabError

pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)


def _python_without_vllm() -> str:
    for python in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
        if python and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode != 0:
            return python
    pytest.skip("every python here imports vLLM")


def test_a_python_without_vllm_is_one_line_naming_the_option(tmp_path):
    python = _python_without_vllm()
    result = run("bench", "--vllm", "--vllm-python", python, "--target", tmp_path, "--draft", tmp_path)
    assert_one_line_error(result, "--vllm-python", "docs/vllm.md")


def test_a_missing_vllm_python_is_one_line(tmp_path):
    result = run("bench", "--vllm", "--vllm-python", tmp_path / "nope" / "python")
    assert_one_line_error(result, "--vllm-python", "does not exist")


@pytest.mark.parametrize("strategy,why", [("evospec", "on a draft model"), ("nonsense", "not a dynvocab strategy")])
def test_a_strategy_vllm_cannot_run_is_refused_in_one_line(tiny_dirs, strategy, why):
    result = run("bench", "--vllm", "--draft", tiny_dirs["draft"], "--strategies", f"full,{strategy}")
    assert_one_line_error(result, strategy, why)


def test_plugin_rows_need_a_bundle_and_ar_full_are_the_engine_rows(tiny_dirs):
    assert plugin_strategies("ar,full", None) == ()
    result = run("bench", "--vllm", "--draft", tiny_dirs["draft"], "--strategies", "lowrank")
    assert_one_line_error(result, "--bundle")


def test_a_strategy_whose_stage_the_bundle_lacks_is_refused_before_any_engine_starts(tmp_path):
    import torch

    from dynvocab.artifacts import FreqTable, ModelFingerprint, Stage, write_bundle

    freq = FreqTable(counts=torch.ones(10, dtype=torch.long), ranking=torch.arange(10), eos_ids=torch.tensor([0]))
    fp = ModelFingerprint(10, "0" * 64, 10, 8)
    bundle = write_bundle(tmp_path / "b.safetensors", [Stage("freq", freq.to_tensors(), {}, {})], fp, fp)
    with pytest.raises(DynvocabError, match="no 'centroids' stage"):
        plugin_strategies("fr,fr-pa,centroids", str(bundle))
    assert plugin_strategies("fr,fr-pa,microspec,hybrid", str(bundle)) == ("fr", "fr-pa", "microspec", "hybrid")


def test_sampling_is_refused_in_one_line():
    assert_one_line_error(run("bench", "--vllm", "--temperature", "0.7"), "greedily")


def test_engine_env_keeps_what_the_caller_set(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    env = engine_env(sys.executable, tensor_parallel_size=2)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "7"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert engine_env(sys.executable)["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"


def test_last_error_line_skips_vllms_generic_wrapper():
    out = ("INFO 11-25 loading\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
           "(EngineCore_DP0 pid=12) ValueError: max_model_len 4096 is larger than the model's 512\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert last_error_line(out) == "ValueError: max_model_len 4096 is larger than the model's 512"


def test_last_error_line_finds_a_workers_root_cause_behind_vllms_log_prefix():
    """vLLM logs a worker's traceback line by line behind ``(Worker pid=N) ERROR <date> [file.py:NNN]``; the root
    cause is the last error there, not the engine's generic wrappers after it."""
    where = "ERROR 11-25 10:11:12 [multiproc_executor.py:953]"
    out = (f"INFO 11-25 10:11:00 [core.py:90] loading\n"
           f"(Worker pid=4242) {where} WorkerProc failed to start.\n"
           f"(Worker pid=4242) {where} Traceback (most recent call last):\n"
           f"(Worker pid=4242) {where}   File \"llama.py\", line 3, in __init__\n"
           f"(Worker pid=4242) {where} ValueError: Unsupported activation: gelu_pytorch_tanh. Only silu is supported "
           "for now\n"
           "\x1b[1;36m(EngineCore_DP0 pid=4200)\x1b[0;0m ERROR 11-25 10:11:13 [core.py:1000] Exception: WorkerProc "
           "initialization failed due to an exception in a background process. See stack trace for root cause.\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert last_error_line(out) == ("ValueError: Unsupported activation: gelu_pytorch_tanh. Only silu is supported "
                                    "for now")


def test_last_error_line_reads_pydantics_reason():
    out = ("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
           "  Value error, Model architectures ['X'] are not supported for now. [type=value_error, input_value=…]\n"
           "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n")
    assert last_error_line(out) == "ValueError: Model architectures ['X'] are not supported for now."


def test_row_figures_are_medians_and_vllms_counters():
    rounds = [{"wall_s": w, "new_tokens": 16, "drafts": 4, "draft_tokens": 12, "accepted_tokens": 8,
               "accepted_per_pos": [4, 3, 1], "head": {"head_s": 0.1, "selector_s": 0.02, "calls": 10, "rows": 10}}
              for w in (1.0, 2.0, 4.0)]
    s = summarize_row({"name": "vllm-spec:lowrank", "rounds": rounds, "token_ids": []}, 48)
    assert s["tokens_per_s"] == 8.0
    assert s["mal"] == 3.0  # 1 + 24 / 12
    assert s["accept_by_position"] == [1.0, 0.75, 0.25]
    assert s["head_ms_per_step"] == 10.0 and s["selector_ms_per_step"] == 2.0
    assert s["oracle_tokens_per_s"] == round(16 / 1.9, 4)


def test_bench_vllm_on_tiny_models(tmp_path_factory, monkeypatch, request):
    """Plain vLLM, vLLM's own n-gram speculation, vLLM's own full head and two plugin strategies on 2 prompts and a
    two-turn conversation × 8 tokens, at 1 and 2 requests in flight (``lowrank`` at the budget its own flag asks), and
    every speculative row again with a batch-size schedule that stops speculating at 2 in flight: every row, the same
    tokens as plain vLLM, the conversation's second turn after plain vLLM's answer to its first, the JSON whole."""
    pytest.importorskip("vllm")
    pair, bundle = request.getfixturevalue("vllm_pair"), request.getfixturevalue("vllm_bundle")
    for key, value in ENGINE_ENV.items():
        monkeypatch.setenv(key, value)
    tmp = tmp_path_factory.mktemp("bench_vllm")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text('{"id": "a", "task": "code", "prompt": "def add(a, b): return a + b"}\n'
                       '{"id": "b", "task": "chat", "prompt": "the cat sat on the mat"}\n'
                       '{"question_id": "c", "category": "talk", "turns": ["the dog ran", "and then the cat"]}\n')
    out = tmp / "bench.json"
    result = run("bench", "--vllm", "--target", pair[0], "--draft", pair[1], "--bundle", bundle, "--strategies",
                 "ngram,lowrank,centroids", "--prompts", prompts, "--max-new-tokens", 8, "--gamma", 3, "--rounds", 1,
                 "--dtype", "float32", "--concurrency", "1,2", "--candidates", LOWRANK_K // 2, "--json", out,
                 "--schedule", "1:3,2:0")
    assert result.exit_code == 0, result.output[-3000:]
    data = json.loads(out.read_text())
    spec_names = ["vllm-spec:ngram", "vllm-spec", "vllm-spec:lowrank", "vllm-spec:centroids"]
    names = ["vllm", *spec_names, *(n + "+schedule" for n in spec_names)]
    assert [(r["name"], r["concurrency"]) for r in data["rows"]] == [(n, c) for n in names for c in (1, 2)]
    for row in data["rows"]:
        assert row["matches_vllm"] == 1.0, row["name"]
        assert row["tokens_per_s"] > 0
        assert row["speedup_vs_vllm"] == round(row["tokens_per_s"] / next(
            r["tokens_per_s"] for r in data["rows"] if r["name"] == "vllm" and r["concurrency"] == row["concurrency"]), 4)
    spec = {r["name"]: r for r in data["rows"] if r["concurrency"] == 1}
    assert spec["vllm-spec"]["mal"] > 1 and spec["vllm-spec"]["head_ms_per_step"] > 0
    assert spec["vllm-spec:ngram"]["head_ms_per_step"] is None  # no head (it may find no n-gram to draft here)
    assert spec["vllm-spec:lowrank"]["selector_ms_per_step"] > 0
    assert spec["vllm-spec:lowrank"]["active_ids"] == LOWRANK_K // 2  # --candidates reaches the plugin's row
    assert data["config"]["budgets"] == {"lowrank": LOWRANK_K // 2}
    assert len(data["generations"]) == 4 * len(data["rows"])
    assert {g["id"] for g in data["generations"]} == {"a", "b", "c/t1", "c/t2"}
    plain = {g["id"]: g for g in data["generations"] if g["strategy"] == "vllm" and g["concurrency"] == 1}
    tokenizer = load_tokenizer(resolve_model(str(pair[0])))
    answered = tokenizer.decode(plain["c/t1"]["token_ids"], skip_special_tokens=True)
    item = BenchItem.conversation("c", "talk", ["the dog ran", "and then the cat"], ())
    assert plain["c/t2"]["turn"] == 2 and answered.strip()
    assert plain["c/t2"]["prompt_tokens"] == len(encode_prompt(tokenizer, item.context(1, [answered])))
    assert "replaying turn 2 of 1 conversation(s)" in result.output
    assert "vllm-spec:centroids" in result.output and "oracle" in result.output and "in flight" in result.output
    assert data["config"]["concurrency"] == [1, 2]
    assert data["config"]["schedule"]["ranges"] == [[1, 1, 3], [2, 8, 0]] and data["acceptance_mismatches"] == []
    by = {(r["name"], r["concurrency"]): r for r in data["rows"]}
    for name in spec_names[1:]:  # at one request the schedule speculates as without it; at two, only once one ended
        assert by[(name + "+schedule", 1)]["drafts"] == by[(name, 1)]["drafts"] > 0
        assert by[(name + "+schedule", 2)]["drafts"] < by[(name, 2)]["drafts"]
    assert "schedule: 1:3,2:0 (given)" in result.output
    assert [len(by[("vllm", c)]["tokens_per_s_rounds"]) for c in (1, 2)] == [2, 2]  # again beside the schedule's rows
    loads = [rnd["load"] for row in data["rows"] for rnd in row["rounds"]]  # measured in the engine's process tree
    assert all(0 <= w["others_share"] <= 1 and len(w["loadavg_before"]) == 3 for w in loads)
    assert data["machine"]["rows_measured"] == len(loads) and isinstance(data["warnings"], list)


@pytest.mark.parametrize("text", ["0", "1,1", "a,b", ""])
def test_bad_concurrency_is_one_line(text):
    assert_one_line_error(run("bench", "--vllm", "--concurrency", text), "--concurrency")


def test_the_suffix_row_beside_ngram_on_tiny_models(tmp_path, monkeypatch, request):
    """``suffix`` in --strategies: vLLM's suffix decoding (Arctic Inference's suffix trees) as a row beside plain
    vLLM and ``ngram``, greedy: its tokens equal plain vLLM's, its acceptance is vLLM's own counters. Runs where
    arctic-inference is installed beside vLLM (an sdist with a C++ extension: CI's vLLM environment does not build
    it); the refusal without it is tested in tests/test_bench_vllm_checks.py."""
    pytest.importorskip("vllm")
    pytest.importorskip("arctic_inference.suffix_decoding")
    pair = request.getfixturevalue("vllm_pair")
    for key, value in ENGINE_ENV.items():
        monkeypatch.setenv(key, value)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "task": "code", "prompt": "a b c a b c a b c a b c"}\n'
                       '{"id": "b", "task": "chat", "prompt": "the cat sat on the mat, the cat sat on the mat"}\n')
    out = tmp_path / "bench.json"
    result = run("bench", "--vllm", "--target", pair[0], "--draft", pair[1], "--strategies", "ngram,suffix",
                 "--prompts", prompts, "--max-new-tokens", 16, "--gamma", 3, "--rounds", 1, "--dtype", "float32",
                 "--json", out)
    assert result.exit_code == 0, result.output[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert {"vllm", "vllm-spec:ngram", "vllm-spec:suffix", "vllm-spec"} <= set(rows)
    suffix = rows["vllm-spec:suffix"]
    assert suffix["drafts"] > 0 and suffix["oracle_tokens_per_s"] is None and suffix["head_ms_per_step"] is None
    generations = json.loads(out.read_text())["generations"]
    plain = [g["token_ids"] for g in generations if g["strategy"] == "vllm"]
    assert [g["token_ids"] for g in generations if g["strategy"] == "vllm-spec:suffix"] == plain
