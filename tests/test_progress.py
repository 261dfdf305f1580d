"""Progress anywhere: plain lines where stderr is no terminal (start, interval, end; done/total, rate, ETA), rich
bars on a terminal, a callback for library use, and the commands' progress in a log."""

from __future__ import annotations

import io
import re

import pytest
from cli_helpers import run
from rich.console import Console
from tiny_models import corpus_jsonl, tiny_dirs  # noqa: F401  (fixtures)

from dynvocab.errors import DynvocabError
from dynvocab.progress import (
    PlainReporter, Reporter, RichReporter, SilentReporter, as_reporter, callback_reporter, format_rate, format_seconds,
    make_reporter, progress_mode, split_description,
)


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def plain(interval: float = 10.0):
    clock = FakeClock()
    out = io.StringIO()
    return PlainReporter(stream=out, interval=interval, clock=clock, heartbeat=False), clock, out


def test_plain_lines_at_start_interval_and_end():
    reporter, clock, out = plain()
    with reporter.task("draft pass (documents)", total=300) as advance:
        for _ in range(25):
            clock.now += 1.0
            advance(1)
    assert out.getvalue().splitlines() == [
        "[draft pass] 0/300 documents",
        "[draft pass] 10/300 documents · 1.00/s · ETA 4m 50s",
        "[draft pass] 20/300 documents · 1.00/s · ETA 4m 40s",
        "[draft pass] 25/300 documents · 1.00/s · done in 25s",
    ]


def test_plain_live_description_and_rates():
    reporter, clock, out = plain(interval=5.0)
    with reporter.task("training (3 epochs, batches)", total=90) as advance:
        clock.now += 5.0
        advance(2, description="training · loss 2.345")
    reporter.log("training: 5.0 s · loss 2.3")
    assert out.getvalue().splitlines() == [
        "[training (3 epochs)] 0/90 batches",
        "[training (3 epochs)] 2/90 batches · 0.40/s · ETA 3m 40s · loss 2.345",
        "[training (3 epochs)] 2/90 batches · 0.40/s · done in 5s",
        "training: 5.0 s · loss 2.3",
    ]


def test_plain_stage_of_unknown_length_keeps_its_description():
    reporter, clock, out = plain()
    with reporter.task("tokenize corpus (documents)", total=None) as advance:
        clock.now += 10.0
        advance(40)
    assert out.getvalue().splitlines() == [
        "[tokenize corpus (documents)] started",
        "[tokenize corpus (documents)] 40 · 4.00/s · 10s elapsed",
        "[tokenize corpus (documents)] 40 · 4.00/s · done in 10s",
    ]


def test_plain_heartbeat_for_a_stage_that_does_not_advance():
    reporter, clock, out = plain()
    with reporter.task("loading draft demo:draft", total=None):
        clock.now += 4.0
        reporter.tick()  # too soon: no line
        clock.now += 8.0
        reporter.tick()
        clock.now += 3.0
    assert out.getvalue().splitlines() == [
        "[loading draft demo:draft] started",
        "[loading draft demo:draft] 12s elapsed",
        "[loading draft demo:draft] done in 15s",
    ]


def test_plain_reporter_heartbeat_thread_stops():
    out = io.StringIO()
    with PlainReporter(stream=out, interval=0.01) as reporter:
        assert reporter._thread is not None and reporter._thread.is_alive()
        thread = reporter._thread
    assert not thread.is_alive()


def test_helpers():
    assert split_description("hnsw (rows indexed)") == ("hnsw", "rows indexed")
    assert split_description("writing b.safetensors") == ("writing b.safetensors", "")
    assert [format_seconds(s) for s in (0.4, 24, 576, 3720)] == ["0s", "24s", "9m 36s", "1h 02m"]
    assert [format_rate(r) for r in (0.00912, 0.0153, 0.214, 3.5, 42.04, 1234.4)] == [
        "0.0091/s", "0.015/s", "0.21/s", "3.50/s", "42.0/s", "1,234/s"]


def test_callback_reporter_and_as_reporter():
    events, messages = [], []
    reporter = callback_reporter(lambda stage, done, total: events.append((stage, done, total)), messages.append)
    assert isinstance(reporter, Reporter)
    with reporter.task("clusters (k-means iterations)", total=50) as advance:
        advance(1)
        advance(2, description="live text is not the stage")
    with reporter.task("loading", total=None):
        pass
    reporter.log("clusters: 1.0 s")
    assert events == [
        ("clusters (k-means iterations)", 0, 50), ("clusters (k-means iterations)", 1, 50),
        ("clusters (k-means iterations)", 3, 50), ("clusters (k-means iterations)", 3, 3),
        ("loading", 0, None), ("loading", 0, 0),
    ]
    assert messages == ["clusters: 1.0 s"]
    assert isinstance(as_reporter(None), SilentReporter)
    assert as_reporter(reporter) is reporter
    seen = []
    with as_reporter(lambda *a: seen.append(a)).task("x", total=2) as advance:
        advance()
    assert seen == [("x", 0, 2), ("x", 1, 2), ("x", 1, 1)]
    with pytest.raises(TypeError):
        as_reporter(3)


def test_terminal_choice(monkeypatch):
    monkeypatch.delenv("DYNVOCAB_PROGRESS", raising=False)
    tty = Console(file=io.StringIO(), force_terminal=True)
    pipe = Console(file=io.StringIO(), force_terminal=False)
    assert progress_mode(tty) == "rich" and isinstance(make_reporter(tty), RichReporter)
    assert progress_mode(pipe) == "plain" and isinstance(make_reporter(pipe), PlainReporter)
    monkeypatch.setenv("DYNVOCAB_PROGRESS", "plain")
    assert isinstance(make_reporter(tty), PlainReporter)
    monkeypatch.setenv("DYNVOCAB_PROGRESS", "off")
    assert isinstance(make_reporter(tty), SilentReporter)
    monkeypatch.setenv("DYNVOCAB_PROGRESS", "rich")
    assert isinstance(make_reporter(pipe), RichReporter)
    monkeypatch.setenv("DYNVOCAB_PROGRESS", "loud")
    with pytest.raises(DynvocabError, match="DYNVOCAB_PROGRESS"):
        make_reporter(pipe)
    monkeypatch.setenv("DYNVOCAB_PROGRESS", "plain")
    monkeypatch.setenv("DYNVOCAB_PROGRESS_INTERVAL", "2.5")
    assert make_reporter(pipe).interval == 2.5


def test_build_index_prints_progress_lines_without_a_terminal(tiny_dirs, corpus_jsonl, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.delenv("DYNVOCAB_PROGRESS", raising=False)
    out = tmp_path / "b.safetensors"
    result = run("build-index", "--target", tiny_dirs[0], "--draft", tiny_dirs[1], "--corpus", corpus_jsonl,
                 "--out", out, "--stages", "freq,clusters", "--num-clusters", 8, "--device", "cpu")
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert "[tokenize corpus (documents)] started" in lines
    assert any(re.fullmatch(r"\[tokenize corpus \(documents\)\] [\d,]+ · [\d.,]+/s · done in \d+s", ln) for ln in lines), lines
    assert "[clusters] 0/" in result.stderr
    assert re.search(r"\[clusters\] \d+/\d+ k-means iterations · [\d.,]+/s · done in \d+s", result.stderr)
    assert any(ln.startswith("wrote ") for ln in lines)
