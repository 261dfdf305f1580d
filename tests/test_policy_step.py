"""The per-step policy microbenchmark: its figures are those of the policy it drives, and it runs every policy."""

from __future__ import annotations

import math

import pytest
import torch

from tiny_models import corpus_jsonl, tiny_dirs  # noqa: F401  (fixtures)

from dynvocab.bench.micro import policy_step
from dynvocab.bench.micro.policy_step import policy_rows, policy_step_bench, render_policy_table
from dynvocab.runtime.decoding.timing import SectionTimer
from dynvocab.runtime.heads.active_set import ActiveSet
from dynvocab.runtime.selection.base import VocabPolicy

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 3000, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 512}
ACTIVE_MS, OBSERVE_MS = 5.0, 20.0  # what the scripted policy spends per draft step in active_ids and in observe
TICK_MS = 1e-3  # what the clock moves by at each of the timer's marks, so every timed section takes some time


class Clock:
    """The section timer's clock for a scripted run: it moves only by what the scripted policy says it spent and by
    ``TICK_MS`` per mark, so the bench's columns are checked exactly, whatever else the machine is doing."""

    def __init__(self):
        self.now_s = 0.0

    def spend(self, ms: float) -> None:
        """Time passes inside the policy."""
        self.now_s += ms / 1e3

    def mark(self) -> float:
        """A point in time, as :meth:`SectionTimer.mark` gives one (each one a tick later)."""
        self.spend(TICK_MS)
        return self.now_s


class Scripted(VocabPolicy):
    """A policy whose sets and costs are known: at draft step j of its n-th cycle (warm-up cycles counted) it returns
    ``10 (n + 1) + j`` ids, as one tensor on even steps and as two disjoint segments on odd ones; ``active_ids``
    spends ``ACTIVE_MS`` of ``clock`` and ``observe`` ``OBSERVE_MS`` per drafted token."""

    name = "scripted"

    def __init__(self, clock: Clock):
        self.clock = clock
        self.cycle = 0
        self.calls: list[tuple[int, int, int, torch.Tensor]] = []  # (cycle, step, fed token, hidden [1, d])

    def active_ids(self, step, hidden=None, token=None):
        self.clock.spend(ACTIVE_MS)
        self.calls.append((self.cycle, step, token, hidden))
        n = 10 * (self.cycle + 1) + step
        ids = torch.arange(n)
        return ActiveSet.of(ids) if step % 2 == 0 else ActiveSet.of(ids[0::2], ids[1::2])

    def observe(self, cycle):
        self.clock.spend(OBSERVE_MS * len(cycle.draft_tokens))
        self.cycle += 1


def test_policy_step_bench_reports_the_driven_policys_sets_and_costs(monkeypatch):
    policies, scripts, clock = [], [], Clock()
    monkeypatch.setattr(SectionTimer, "mark", lambda timer: clock.mark())  # sections on the scripted clock

    def scripted(name, tables):
        if name != "scripted":  # the full head's reference row
            return real_policy(name, tables)
        policies.append(Scripted(clock))
        return policies[-1]

    def keep_script(*args, **kwargs):
        scripts.append(real_script(*args, **kwargs))
        return scripts[-1]

    real_script, real_policy = policy_step.scripted_cycles, policy_step._policy
    monkeypatch.setattr(policy_step, "_policy", scripted)
    monkeypatch.setattr(policy_step, "scripted_cycles", keep_script)
    warmup, cycles, gamma = 2, 4, 3
    result = policy_step_bench(dtypes=("float32",), policies=("scripted",), cycles=cycles, warmup_cycles=warmup,
                               gamma=gamma, target=TINY, threads=1)
    r = result["dtypes"]["float32"]["policies"]["scripted"]
    (policy,), (script,) = policies, scripts
    # every step of every cycle, warm-up included, reached the policy once, in order, fed the drafted chain
    assert [(c, j) for c, j, _, _ in policy.calls] == [(c, j) for c in range(warmup + cycles) for j in range(gamma)]
    for c, j, token, hidden in policy.calls:
        assert torch.equal(hidden, script[c].draft_hidden[j])
        if j:
            assert token == script[c].draft_tokens[j - 1]
    # mean set size over the timed cycles only, both segments of a split set counted
    timed = [10 * (c + 1) + j for c in range(warmup, warmup + cycles) for j in range(gamma)]
    assert r["mean_active"] == pytest.approx(sum(timed) / len(timed))
    # the costs land in the right columns: active_ids and observe apart, the head's time not mixed with either
    assert r["active_ms"] == pytest.approx(ACTIVE_MS, abs=10 * TICK_MS)
    assert r["observe_ms"] == pytest.approx(OBSERVE_MS, abs=10 * TICK_MS)
    assert r["policy_ms"] == pytest.approx(r["active_ms"] + r["observe_ms"])
    assert 0 < r["head_ms"] < 10 * TICK_MS
    eagle = result["dtypes"]["float32"]["eagle"]
    assert eagle["body_ms"] > 0 and eagle["head_ms"] > 0
    assert r["share_of_eagle_step"] > 0


def test_policy_step_bench_runs_every_dynamic_policy():
    result = policy_step_bench(dtypes=("float32",), cycles=4, warmup_cycles=2, target=TINY, threads=1)
    res = result["dtypes"]["float32"]
    assert res["eagle"]["step_ms"] == res["eagle"]["body_ms"] + res["eagle"]["head_ms"] > 0
    assert set(res["policies"]) == {"full", *policy_rows()}
    for name, r in res["policies"].items():
        assert abs(r["policy_ms"] - r["active_ms"] - r["observe_ms"]) < 1e-9
        assert all(math.isfinite(r[k]) and r[k] >= 0 for k in ("policy_ms", "active_ms", "observe_ms", "head_ms"))
        assert r["head_ms"] > 0 and 0 < r["mean_active"] <= TINY["vocab_size"]
        assert r["share_of_eagle_step"] == r["policy_ms"] / res["eagle"]["step_ms"]
    assert render_policy_table(result).row_count == len(policy_rows()) + 1
    full_head = res["policies"]["full"]["head_ms"]
    for r in res["policies"].values():
        assert r["step_vs_full_head"] == pytest.approx((r["active_ms"] + r["head_ms"]) / full_head)


def test_policy_step_bench_reads_a_bundle(tmp_path, tiny_dirs, corpus_jsonl):  # noqa: F811
    from cli_helpers import run

    from dynvocab.artifacts import load_bundle

    out = tmp_path / "b.safetensors"
    result = run("build-index", "--target", tiny_dirs[0], "--draft", tiny_dirs[1], "--corpus", corpus_jsonl,
                 "--out", out, "--num-clusters", 8, "--device", "cpu")
    assert result.exit_code == 0, result.output
    result = run("train-router", "--bundle", out, "--draft", tiny_dirs[1], "--target", tiny_dirs[0], "--corpus",
                 corpus_jsonl, "--max-docs", 20, "--max-tokens", 16, "--epochs", 1, "--hidden", 16, "--k-max", 3,
                 "--device", "cpu", "--selector", "router,lowrank,centroids", "--rank", 4, "--block-size", 16,
                 "--selector-epochs", 1)
    assert result.exit_code == 0, result.output
    with load_bundle(out) as bundle:
        vocab = bundle.fingerprints["target"].head_rows
        result = policy_step_bench(bundle, dtypes=("float32",), cycles=3, warmup_cycles=1,
                                   target={**TINY, "vocab_size": vocab}, threads=1)
    assert result["tables"] == "bundle"
    rows = result["dtypes"]["float32"]["policies"]
    assert set(rows) == {"full", *policy_rows()}
    assert all(0 < r["mean_active"] <= vocab for r in rows.values())
