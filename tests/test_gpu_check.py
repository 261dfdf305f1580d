"""scripts/gpu_check.sh, the first GPU session's one command: on CPU it runs every section at small shapes and
writes the JSON it promises, naming what the CUDA run times (so the script cannot rot before a GPU shows up)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynvocab.bench.micro.gpu_check import BUDGET_S, LIMIT_S, SECTIONS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


# The CPU run's budget: four times the default, so that a busy machine stretches each section's limit (a hang guard)
# rather than failing a section on time; the run itself takes under a minute on two idle cores.
CPU_BUDGET_S = 4 * BUDGET_S


def gpu_check(*args: str, timeout: float = CPU_BUDGET_S + 60) -> subprocess.CompletedProcess:
    """The script as a user runs it, with this interpreter and no Triton mode chosen (``timeout``: a hang guard
    past the script's own budget, which ends it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHON"] = sys.executable
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "nested" / "report.json"
    run = gpu_check("--device", "cpu", "--out", str(out), "--budget-s", str(CPU_BUDGET_S))
    assert run.returncode == 0, run.stderr[-6000:]
    return json.loads(out.read_text())


def test_cpu_run_passes_every_section(report):
    assert report["ok"] and report["device"] == "cpu" and report["quick"]
    assert list(report["sections"]) == list(SECTIONS)
    assert {name: s["status"] for name, s in report["sections"].items()} == {name: "ok" for name in SECTIONS}
    env = report["env"]
    assert env["torch"] == torch.__version__ and env["device_name"] and "triton" in env and env["transformers"]


def test_the_run_reports_its_budget_and_each_sections_time(report):
    """The time budget is a field of the report, not a test's threshold (a busy machine is slower, not wrong)."""
    sections = report["sections"]
    assert report["budget_s"] == CPU_BUDGET_S
    assert list(sections) == list(SECTIONS)
    assert all(0 < s["limit_s"] <= 4 * LIMIT_S[name] for name, s in sections.items())  # stretched, at most
    seconds = [s["seconds"] for s in sections.values()]
    assert all(math.isfinite(t) and t >= 0 for t in seconds) and math.isfinite(report["total_s"])


def test_sections_share_the_budget_and_report_their_time(tmp_path, monkeypatch):
    """On a clock the test moves (each section, replaced, takes 100 s of it): a section is given its own limit or
    what is left of the budget, whichever is less, and reports the seconds it took; once less than 10 s are left the
    rest are skipped, and the run is not ok; ``total_s`` is the run's time on that clock. A budget past the default
    stretches every limit alike."""
    from dynvocab.bench.micro import gpu_check as check

    now, given = [0.0], {}

    def section(name: str, limit_s: float) -> dict:
        given[name] = limit_s
        now[0] += 100.0
        return {"status": "ok"}

    monkeypatch.setattr(check, "run_tests", lambda device, root, limit_s: section("tests", limit_s))
    monkeypatch.setattr(check, "_child", lambda name, device, quick, root, limit_s: section(name, limit_s))
    out = tmp_path / "report.json"
    report = check.gpu_check("cpu", out, True, ROOT, budget_s=350, clock=lambda: now[0])
    assert given == {"tests": 200, "graph_step": 150, "draft_step": 120, "eagle_step": 50}  # 350 - 3 × 100 left
    sections = report["sections"]
    assert all(sections[name]["limit_s"] == limit and sections[name]["seconds"] == 100.0
               for name, limit in given.items())
    skipped = [name for name, s in sections.items() if s["status"] == "skipped"]
    assert skipped == ["kernels", "batch_heads", "tree_step"]
    assert "the 350 s budget is spent" in sections["kernels"]["reason"]
    assert report["total_s"] == 400.0 and not report["ok"]
    assert json.loads(out.read_text())["sections"] == sections

    given.clear()  # twice the default budget: every section's limit twice its own (700 s of 1,140 used)
    report = check.gpu_check("cpu", out, True, ROOT, budget_s=2 * BUDGET_S, clock=lambda: now[0])
    assert given == {name: 2 * LIMIT_S[name] for name in SECTIONS} and report["ok"]


def test_the_cuda_marked_tests_ran_interpreted(report):
    tests = report["sections"]["tests"]
    assert "tests/test_kernels.py" in tests["files"] and tests["TRITON_INTERPRET"] == "1"
    assert tests["passed"] > 0 and tests["failed"] == 0 and tests["failures"] == {}
    assert set(tests["skip_reasons"]) <= {"no GPU"}  # only the CUDA parametrizations are left for the GPU


def test_benchmarks_report_their_numbers(report):
    sections = {name: s["result"] for name, s in report["sections"].items() if name != "tests"}
    graph = sections["graph_step"]
    assert graph["host_reads_per_step"] == {}  # the step reads nothing back, so CUDA can capture it
    assert graph["static_vs_dynamic"] < 1e-4  # the static-cache step is the usual step
    assert set(graph["eager_ms"]) == set(graph["graph"]) == {"full", "1024"}
    for head in graph["graph"].values():
        assert head["captured"] is False and "CUDA" in head["reason"]
    assert sections["draft_step"]["body_ms"] > 0 and "full" in sections["draft_step"]["head_ms"]
    eagle = sections["eagle_step"]["results"]
    assert [r["shape"] for r in eagle] == ["gemma3-270m-eagle3"] and eagle[0]["step_ms"]["full"] > 0
    kernels = sections["kernels"]["tiny-head"]
    assert {r["method"] for r in kernels["results"]} == {"full", "static", "index_select", "packed"}


def test_names_what_the_cuda_run_times(report):
    plan = report["would_time_on_cuda"]
    assert set(plan) == set(SECTIONS)
    assert "llama3-8b-eagle1" in plan["eagle_step"]["settings"]["shapes"]
    assert plan["graph_step"]["settings"]["dims"]["num_hidden_layers"] == 24  # the demo draft, whole
    assert "CUDAGraph" in plan["graph_step"]["cuda_only"] and "fused" in plan["kernels"]["cuda_only"]
    assert "not captured" in plan["eagle_step"]["graph"]
    assert plan["kernels"]["settings"]["shapes"]["llama3-8b-head"] == [128256, 4096]


def test_help_and_bad_arguments():
    helped = gpu_check("--help", timeout=30)
    assert helped.returncode == 0 and "--device cuda|cpu" in helped.stdout and "--out FILE" in helped.stdout
    assert gpu_check("--bogus", timeout=30).returncode == 2
    assert gpu_check("--device", "tpu", timeout=30).returncode == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused(tmp_path):
    run = gpu_check("--device", "cuda", "--out", str(tmp_path / "r.json"), timeout=60)
    assert run.returncode == 2 and "no CUDA device" in run.stderr and not (tmp_path / "r.json").exists()


def test_the_batched_heads_section_times_every_strategy_both_ways(report):
    """Every strategy that runs inside vLLM but evospec (its retrieval runs on the host: no graph could hold it), at
    each batch size and draft position: scored over the batch's distinct ids and row by row (the two give the same
    logits), with no device read in a step."""
    from dynvocab.runtime.batched import batch_strategies

    section = report["sections"]["batch_heads"]["result"]
    cases = {(r["strategy"], r["batch"], r["step"]) for r in section["results"]}
    timed = set(batch_strategies()) - {"evospec"}
    assert {s for s, _, _ in cases} == timed and len(cases) == len(section["results"])
    assert {(b, t) for _, b, t in cases} == {(1, 0), (1, 3), (4, 0), (4, 3)}
    for r in section["results"]:
        for way in ("union", "per_row"):
            assert r[way]["host_reads_per_step"] == {} and r[way]["ms"] > 0, (r["strategy"], way)
            assert not r[way]["graph"]["captured"]  # CPU: the CUDA run captures them
        assert r["per_row"]["max_abs_diff"] < 1e-4, r


def test_tree_cycles_read_the_host_once_after_growth(report):
    tree = report["sections"]["tree_step"]["result"]
    rows = {(r["set"], r["tree"]): r for r in tree["rows"]}
    assert set(rows) == {("full", "off"), ("full", "3x2x5"), (256, "off"), (256, "3x2x5")}
    for (_, shape), row in rows.items():
        assert row["reads_elsewhere"] == {}
        if shape != "off":
            reads = row["reads"]
            assert 0 < reads["grow_tree"] <= reads["verify_greedy"] == row["cycles"]  # none inside the growth
            assert row["tokens_verified"] > 1 and row["draft_ms"] > 0 and row["verify_ms"] > 0
