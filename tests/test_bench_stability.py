"""The bench's load probe and its warnings: /proc parsing on a written tree, the rules on hand-made rows, and the
probe around a row, reading written trees, naming a busy machine and only a busy one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynvocab.bench import stability


def _proc(root: Path, busy: int, idle: int, tree: dict[int, tuple[int, int, int]], load: float = 0.5) -> Path:
    """A /proc with ``stat``, ``loadavg`` and one ``PID/stat`` per entry of ``tree`` (pid -> (ppid, utime, cutime))."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\n")
    (root / "loadavg").write_text(f"{load} 0.40 0.30 2/300 12345\n")
    for pid, (ppid, utime, cutime) in tree.items():
        (root / str(pid)).mkdir(exist_ok=True)
        fields = ["S", str(ppid)] + ["0"] * 9 + [str(utime), "0", str(cutime), "0"] + ["0"] * 30
        (root / str(pid) / "stat").write_text(f"{pid} (py thon) {' '.join(fields)}\n")
    return root


def test_window_counts_what_the_rest_of_the_machine_used(tmp_path, monkeypatch):
    """Others = machine busy ticks minus this tree's (its descendants and reaped children included); a process
    outside the tree counts as other."""
    me = os.getpid()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    before = stability.sample(_proc(tmp_path / "a", busy=1000, idle=1000, tree={me: (1, 100, 0), 7: (me, 50, 0), 9: (1, 10, 0)}))
    after = stability.sample(_proc(tmp_path / "b", busy=1150, idle=1050, tree={me: (1, 150, 20), 7: (me, 80, 0), 9: (1, 60, 0)}))
    assert before.own_ticks == 150 and after.own_ticks == 250
    w = stability.window(before, after)
    assert w["others_share"] == pytest.approx(50 / 200)  # 150 busy - 100 ours, of 200 ticks
    assert w["others_cores"] == pytest.approx(0.5)
    assert w["loadavg_before"] == [0.5, 0.4, 0.3]
    assert stability.sample(tmp_path / "missing") is None
    assert stability.window(None, after) is None


def test_busy_rule_names_the_rows_that_shared_the_machine():
    quiet = {"others_share": 0.02}
    busy = {"others_share": 0.31}
    assert stability.busy_warning({"ar": [quiet, quiet], "full": [quiet, None]}) is None
    line = stability.busy_warning({"ar": [quiet, busy], "full": [quiet], "fr": [None]})
    assert "31%" in line and "ar" in line and "full" not in line


def test_spread_rule_follows_pyperf_outliers():
    assert stability.spread_warning({"full": [0.10, 0.12, 0.09, 0.11]}) is None
    line = stability.spread_warning({"full": [0.10, 0.11, 0.10], "ar": [0.05, 0.05, 0.20]})
    assert line is not None and "ar (" in line and "full" not in line
    assert stability.rounds_warning({"vllm": [10.0, 10.4, 9.8]}) is None
    assert "vllm-spec" in stability.rounds_warning({"vllm": [10.0, 10.4, 9.8], "vllm-spec": [12.0, 6.0, 12.5]})


def test_bench_warnings_read_the_generations():
    """Time per target pass leaves prefill out and divides by passes, so prompts of different acceptance agree."""
    gens = [
        {"strategy": "full", "metrics": {"wall_s": 1.2, "prefill_s": 0.2, "cycles": 10}, "load": {"others_share": 0.0}},
        {"strategy": "full", "metrics": {"wall_s": 2.5, "prefill_s": 0.5, "cycles": 20}, "load": {"others_share": 0.0}},
    ]
    assert stability.bench_warnings(gens) == []
    gens.append({"strategy": "full", "metrics": {"wall_s": 4.0, "prefill_s": 0.0, "cycles": 10}, "load": {"others_share": 0.4}})
    warnings = stability.bench_warnings(gens)
    assert len(warnings) == 2 and warnings[0].startswith("the machine was busy")


@pytest.mark.parametrize("others", [0, 90])
def test_a_process_outside_the_tree_makes_the_machine_busy(tmp_path, monkeypatch, others):
    """The probe around a row, its two readings taken from written /proc trees (``stability.sample`` replaced): a
    process outside this tree that used ``others`` of the row's 200 ticks is named by the busy rule when that is
    at least 10% of the machine, and nothing is warned when it stayed idle; our own 50 ticks never count."""
    me = os.getpid()
    trees = iter([
        _proc(tmp_path / "before", busy=1000, idle=1000, tree={me: (1, 100, 0), 9: (1, 10, 0)}),
        _proc(tmp_path / "after", busy=1050 + others, idle=1150 - others,
              tree={me: (1, 150, 0), 9: (1, 10 + others, 0)}),
    ])
    read = stability.sample
    monkeypatch.setattr(stability, "sample", lambda: read(next(trees)))
    probe = stability.Probe()
    probe.start()
    row = probe.stop()
    assert row["others_share"] == pytest.approx(others / 200)
    warning = stability.busy_warning({"ar": [row]})
    if others:
        assert warning is not None and "45%" in warning and "during ar" in warning
    else:
        assert warning is None
