"""scripts/vllm_serve_bench.py's smallest case on the tiny models: an OpenAI-compatible vLLM server per row on the
loopback address, vLLM's own client (``vllm bench serve``) at 1 user, acceptance read from the server's
``/metrics``. The plugin's served acceptance at one user equals the same requests through ``LLM`` (the script's
``--check-llm``), its text equals plain vLLM's (float32), and no row drafted without its request's context (the
server's ``dynvocab_rows_without_context_total``). A server that exports no such counter fails its plugin row (not
vLLM's own rows), naming why, never reading as 0. The rows a ``--schedule`` adds are checked without vLLM in
tests/test_bench_vllm_checks.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)

from vllm_models import ENGINE_ENV, vllm_bundle, vllm_pair  # noqa: E402,F401

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm_serve_bench.py"
PROMPTS = ["def add(a, b): return a + b", "the cat sat on the mat", "a b c d e f"]
MAX_TOKENS = 8
SPEC = 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0\n'


def script():
    """scripts/vllm_serve_bench.py as a module."""
    spec = importlib.util.spec_from_file_location("vllm_serve_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(vllm_pair, vllm_bundle, tmp_path, extra: dict, *args: str) -> subprocess.CompletedProcess:  # noqa: F811
    """The script on the tiny pair at 1 user (float32), its prompts :data:`PROMPTS`, ``extra`` in its
    environment."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    env = {**os.environ, **ENGINE_ENV, **extra}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server as users start it
    if "DYNVOCAB_VLLM_METRICS_DIR" not in extra:  # not this process's own, should it have registered the plugin
        env.pop("DYNVOCAB_VLLM_METRICS_DIR", None)
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--target", str(vllm_pair[0]), "--draft", str(vllm_pair[1]), "--bundle",
         str(vllm_bundle), "--users", "1", "--dtype", "float32", "--max-model-len", "256", "--prompts", str(prompts),
         "--keep", str(tmp_path / "logs"), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)


def test_an_absent_count_of_rows_without_context_fails_the_plugins_rows_only():
    """Absent is not 0: the counter read from a ``/metrics`` without it is missing, and only a row of the plugin
    fails for it, with its server's reason; a count fails any row, and a present 0 passes."""
    serve = script()
    from dynvocab.serving.vllm.without_context import ABSENT

    assert serve.ABSENT == ABSENT
    bare = serve.parse_metrics(SPEC)
    assert serve.WITHOUT_CONTEXT not in bare and bare["vllm:spec_decode_num_drafts"] == 4.0
    zero = serve.parse_metrics(SPEC + "dynvocab_rows_without_context_total 0.0\n")
    assert serve.counted_without_context(zero, zero) == 0.0
    assert serve.counted_without_context(zero, bare) is None and serve.counted_without_context(bare, bare) is None
    why = f"WARNING [without_context.py:1] dynvocab: {ABSENT}: prometheus_client is missing (install it)"
    assert serve.why_absent("INFO a line\n" + why + "\n") == why[why.index(ABSENT):]
    table = [{"row": name, "users": 1, "without_context": None} for name in ("vllm", "ngram", "full", "microspec")]
    failures = serve.context_failures(table, {"microspec"}, {"microspec": serve.why_absent(why)})
    assert len(failures) == 1 and failures[0].startswith("microspec at 1 users: its server exported no ")
    assert "prometheus_client is missing" in failures[0]
    counted = [{"row": "microspec", "users": 4, "without_context": 3.0},
               {"row": "fr", "users": 1, "without_context": 0.0}]
    assert serve.context_failures(counted, {"microspec", "fr"}, {}) == [
        "rows drafted without their request's context (dynvocab_rows_without_context_total): microspec at 4 users: "
        "3; their figures are not the strategies' (docs/vllm.md)"]


def test_a_server_whose_plugin_exports_no_count_fails_its_row_and_says_why(vllm_pair, vllm_bundle,  # noqa: F811
                                                                            tmp_path):
    """A folder variable inherited from elsewhere, naming no folder: the served plugin installs no collector, and
    says why in its log; the script fails the row with that line instead of reading a 0 (as it once did)."""
    gone = tmp_path / "gone"
    proc = run_script(vllm_pair, vllm_bundle, tmp_path, {"DYNVOCAB_VLLM_METRICS_DIR": str(gone)}, "--strategies",
                      "microspec", "--baselines", "", "--num-prompts", "1", "--max-tokens", "4")
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "microspec at 1 users: its server exported no dynvocab_rows_without_context_total" in proc.stdout
    assert f"DYNVOCAB_VLLM_METRICS_DIR={gone} was inherited but names no folder" in proc.stdout


def test_the_serve_script_measures_the_plugin_as_served(vllm_pair, vllm_bundle, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer

    out = tmp_path / "serve.json"
    proc = run_script(vllm_pair, vllm_bundle, tmp_path, {}, "--strategies", "fr", "--baselines", "",
                      "--num-prompts", "3", "--max-tokens", str(MAX_TOKENS), "--json", str(out), "--check-llm")
    assert proc.returncode == 0, proc.stdout[-4000:]
    data = json.loads(out.read_text())
    rows = {(r["row"], r["users"]): r for r in data["rows"]}
    assert set(rows) == {("fr", 1)}
    assert "tok/s" in proc.stdout and "= LLM" in proc.stdout
    assert all(row["output_tok_s"] > 0 and row["drafts"] > 0 and row["without_context"] == 0 for row in rows.values())
    # --check-llm: the same requests through LLM (the script sends the client no test request), the folder as served
    for key in [("fr", 1)]:
        served, llm = rows[key], rows[key]["llm"]
        assert (served["drafts"], served["accepted_tokens"]) == (llm["drafts"], llm["accepted_tokens"]), key
    # float32: every served row gives the target's own text (the server holds back a last incomplete UTF-8 character)
    tok = AutoTokenizer.from_pretrained(vllm_pair[0])
    texts = [tok.decode(t, skip_special_tokens=True).rstrip("\ufffd") for t in data["llm_plain_token_ids"]["1"]]
    for key, row in rows.items():
        assert [t.rstrip("\ufffd") for t in row["texts"]] == texts, key
