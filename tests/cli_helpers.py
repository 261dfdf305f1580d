"""Helpers shared by the CLI tests: run a command through typer's CliRunner and check one-line errors."""

from __future__ import annotations

from typer.testing import CliRunner

from dynvocab.cli import app

runner = CliRunner()


def run(*args):
    """Invoke ``dynvocab ARGS…`` in-process; arguments are converted to strings."""
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *words):
    """The command failed with exactly one ``error: …`` line (no traceback) that mentions every word."""
    assert result.exit_code != 0
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error:"), result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], lines[0]
