"""scripts/vllm_serve_bench.py's smallest case on the tiny models: an OpenAI-compatible vLLM server per row on the
loopback address, vLLM's own client (``vllm bench serve``) at 1 user, acceptance read from the server's
``/metrics``. The plugin's served acceptance at one user equals the same requests through ``LLM`` (the script's
``--check-llm``), its text equals plain vLLM's (float32), and no row drafted without its request's context (the
server's ``dynvocab_rows_without_context_total``). The rows a ``--schedule`` adds are checked without vLLM in
tests/test_bench_vllm_checks.py."""

from __future__ import annotations

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


def test_the_serve_script_measures_the_plugin_as_served(vllm_pair, vllm_bundle, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "serve.json"
    env = {**os.environ, **ENGINE_ENV}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server as users start it
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--target", str(vllm_pair[0]), "--draft", str(vllm_pair[1]), "--bundle",
         str(vllm_bundle), "--strategies", "fr", "--baselines", "", "--users", "1", "--num-prompts", "3",
         "--max-tokens", str(MAX_TOKENS), "--dtype", "float32", "--max-model-len", "256",
         "--prompts", str(prompts), "--json", str(out), "--keep", str(tmp_path / "logs"), "--check-llm"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
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
