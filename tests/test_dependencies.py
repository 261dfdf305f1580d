"""Declared dependencies are tested ranges; optional features name the extra they need."""

import importlib.util
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from cli_helpers import assert_one_line_error, run

tomllib = pytest.importorskip("tomllib")
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def declared() -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    rows = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return [Requirement(r) for r in rows]


def test_every_dependency_has_an_upper_bound():
    """Each third-party requirement is capped (``<``, ``<=``, ``==`` or ``~=``); dynvocab's own extras are not."""
    open_ended = [str(r) for r in declared()
                  if r.name != "dynvocab" and not any(s.operator in ("<", "<=", "==", "~=") for s in r.specifier)]
    assert not open_ended, f"no upper bound: {open_ended}"


def test_plot_lives_in_an_extra_that_demo_and_test_include():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert not any(Requirement(r).name == "matplotlib" for r in project["dependencies"])
    extras = project["optional-dependencies"]
    assert [Requirement(r).name for r in extras["plot"]] == ["matplotlib"]
    for extra in ("demo", "test"):
        assert "dynvocab[plot]" in extras[extra], extra


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "w1 w2"}\n')
    result = run("bench", "--prompts", prompts, "--strategies", "ar", "--plot", tmp_path / "b.png",
                 "--target", tmp_path / "no-such-model")
    assert_one_line_error(result, "matplotlib", "dynvocab[plot]")
