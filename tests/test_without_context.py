"""The count of rows that drafted without their request's context (dynvocab/serving/vllm/without_context.py), without
an engine: logged rate-limited, written for the API server's collector at most once per interval (and at exit),
and never raising into the draft where it cannot be written; what the exporter says where it installs nothing; the
collector's sum, and its silence once its folder is gone. A served vLLM with the folder removed mid-run is in
tests/test_vllm_server.py."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time

import pytest

from dynvocab.serving.vllm import without_context

FAST_S = 0.2  # the publishing interval here


@pytest.fixture
def said(monkeypatch) -> list[str]:
    """The plugin's log lines, each process-wide one-time line new again, the process's count fresh."""
    lines = []
    monkeypatch.setattr(without_context.logger, "warning", lambda line, *args: lines.append(line % args))
    monkeypatch.setattr(without_context, "_SAID", set())
    monkeypatch.setattr(without_context, "_FILE", without_context._ProcessFile())
    monkeypatch.setattr(without_context, "PUBLISH_EVERY_S", FAST_S)
    yield lines
    without_context._FILE.flush()  # no timer outlives the test


def written(folder) -> int:
    """What this process's file in ``folder`` says."""
    return without_context.exported_total(folder)


def settled(folder, total: int, limit_s: float = 10.0) -> int:
    """What ``folder`` says once it says ``total`` (the interval's timer wrote it), or after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while written(folder) != total and time.monotonic() < deadline:
        time.sleep(FAST_S / 4)
    return written(folder)


def test_misses_are_logged_rate_limited_and_written_for_the_servers_collector(tmp_path, monkeypatch, said):
    monkeypatch.setenv(without_context.DIR_ENV, str(tmp_path))
    misses = without_context.Misses("microspec")
    for _ in range(3):
        misses.count(2, "a head call no proposal announced")
    assert misses.total == 6 and len(said) == 1 and "microspec" in said[0] and "\n" not in said[0]
    without_context.Misses("hybrid").count(1, "a batch of 3 rows against 2 announced requests")  # a second draft
    assert settled(tmp_path, 7) == 7  # one file per process, every draft's rows in it
    assert [p.name for p in tmp_path.iterdir()] == [f"{os.getpid()}.json"]  # written whole: no .tmp left


def test_the_count_is_written_at_most_once_per_interval_and_the_last_of_it_when_the_interval_ends(
        tmp_path, monkeypatch, said):
    monkeypatch.setenv(without_context.DIR_ENV, str(tmp_path))
    replaced = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append(time.monotonic()), replace(a, b)))
    misses = without_context.Misses("microspec")
    misses.count(2, "a head call no proposal announced")
    assert written(tmp_path) == 2  # the first count at once
    for _ in range(50):
        misses.count(1, "a head call no proposal announced")
    assert written(tmp_path) == 2 and len(replaced) == 1  # the rest wait for the interval's end
    assert settled(tmp_path, 52) == 52 and len(replaced) == 2  # one write for all fifty
    assert replaced[1] - replaced[0] >= FAST_S * 0.99


def test_a_process_writes_what_it_counted_last_as_it_exits(tmp_path):
    """The interval's last counts are written by the exit hook, where the process ends before the interval does."""
    code = ("from dynvocab.serving.vllm import without_context as w\n"
            "w.PUBLISH_EVERY_S = 60.0\n"
            "m = w.Misses('microspec')\n"
            "m.count(2, 'a head call no proposal announced')\n"
            "m.count(3, 'a head call no proposal announced')\n")
    env = {**os.environ, without_context.DIR_ENV: str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert written(tmp_path) == 5


def test_a_removed_folder_stops_the_export_once_and_never_fails_the_draft(tmp_path, monkeypatch, said):
    folder = tmp_path / "metrics"
    folder.mkdir()
    monkeypatch.setenv(without_context.DIR_ENV, str(folder))
    misses = without_context.Misses("hybrid")
    misses.count(1, "a head call no proposal announced")
    shutil.rmtree(folder)  # as the API server's exit removes it
    for _ in range(3):
        time.sleep(1.5 * FAST_S)
        misses.count(1, "a head call no proposal announced")  # raises nothing
    stopped = [line for line in said if "stopped being exported" in line]
    assert len(stopped) == 1 and str(folder) in stopped[0] and "No such file" in stopped[0]
    assert misses.total == 4 and without_context._FILE.written == 1
    without_context._FILE.flush(final=True)  # the exit hook, the folder gone: quiet
    assert len([line for line in said if "stopped" in line]) == 1


def test_a_full_disk_stops_the_export_once_leaves_no_partial_file_and_never_fails_the_draft(
        tmp_path, monkeypatch, said):
    monkeypatch.setenv(without_context.DIR_ENV, str(tmp_path))

    def full(a, b):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    misses = without_context.Misses("microspec")
    for _ in range(2):
        misses.count(2, "a head call no proposal announced")
        time.sleep(1.5 * FAST_S)
    assert [line for line in said if "stopped" in line] == [said[-1]] and "No space left" in said[-1]
    assert list(tmp_path.iterdir()) == []  # the temporary file removed, no file half written
    assert without_context._FILE.stopped and misses.total == 4
    misses._logged.clear()
    misses.count(1, "a head call no proposal announced")
    assert "not exported" in said[-1]  # the rate-limited line no longer says it is exported


def test_the_exporter_says_why_it_installed_nothing_once_and_stays_quiet_in_a_child_of_the_one_that_did(
        tmp_path, monkeypatch, said):
    monkeypatch.delenv(without_context.NOT_EXPORTED_ENV, raising=False)
    monkeypatch.setenv(without_context.DIR_ENV, str(tmp_path))
    assert without_context.install_exporter() == (str(tmp_path), "") and said == []  # a worker: the normal case
    gone = tmp_path / "gone"
    monkeypatch.setenv(without_context.DIR_ENV, str(gone))
    for _ in range(2):  # this process, then one it started (which inherits what the first said)
        export = without_context.install_exporter()
        assert export.folder is None and str(gone) in export.why_not
    assert len(said) == 1 and without_context.ABSENT in said[0] and str(gone) in said[0]
    assert str(gone) in os.environ[without_context.NOT_EXPORTED_ENV]
    monkeypatch.delenv(without_context.DIR_ENV)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # not installed
    export = without_context.install_exporter()
    assert export.folder is None and "prometheus_client" in export.why_not
    assert without_context.DIR_ENV not in os.environ and "prometheus_client" in said[-1]


@pytest.mark.vllm  # prometheus_client comes with vLLM (CI's second stage)
def test_the_collector_sums_the_workers_counts_and_exports_nothing_once_their_folder_is_gone(tmp_path, said):
    pytest.importorskip("prometheus_client")
    folder = tmp_path / "metrics"
    folder.mkdir()
    (folder / "11.json").write_text('{"total": 4}')
    (folder / "12.json").write_text('{"total": 3}')
    collector = without_context._Collector(str(folder))
    collected = list(collector.collect())
    assert collected[0].name == without_context.METRIC and collected[0].samples[0].value == 7
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    assert list(collector.collect()) == [] and list(collector.collect()) == []  # absent, not a false 0
    assert len(said) == 1 and without_context.ABSENT in said[0] and str(folder) in said[0]


@pytest.mark.vllm  # prometheus_client comes with vLLM (CI's second stage)
def test_multiprocess_mode_beside_the_collector_skips_its_counter_instead_of_failing_the_draft(
        tmp_path, monkeypatch, said):
    """Where the process that installed the collector also drafts (an engine in its process) under
    ``PROMETHEUS_MULTIPROC_DIR``, the metric's name belongs to the collector, not to a counter."""
    prometheus_client = pytest.importorskip("prometheus_client")
    monkeypatch.setenv(without_context.DIR_ENV, str(tmp_path))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(without_context, "_SHARED", without_context._SharedCounter())
    registry = prometheus_client.REGISTRY
    mine = None  # an earlier register() in this process (a vLLM test's) may have installed the collector already
    if not isinstance(registry._names_to_collectors.get(without_context.METRIC), without_context._Collector):
        mine = without_context._Collector(str(tmp_path))
        registry.register(mine)
    try:
        misses = without_context.Misses("microspec")
        misses.count(2, "a head call no proposal announced")
        misses.count(1, "a head call no proposal announced")
    finally:
        if mine is not None:
            registry.unregister(mine)
    assert misses.total == 3 and len([line for line in said if "not as a counter" in line]) == 1
