"""The CI rule "demo tests run, not skip": a skipped ``demo`` test fails under ``DYNVOCAB_REQUIRE_DEMO=1``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

SAMPLE = '''
import pytest

@pytest.mark.demo
@pytest.mark.skip(reason="demo packages absent")
def test_demo_skipped():
    pass

@pytest.mark.demo
def test_demo_skips_itself():
    pytest.skip("model files absent")

@pytest.mark.skip(reason="not a demo test")
def test_plain_skipped():
    pass

def test_passes():
    pass
'''


def run_sample(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess:
    """Run pytest on the sample file with only the ``require_demo`` plugin; ``require`` sets the variable."""
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    demo: a demo test\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DYNVOCAB_REQUIRE_DEMO", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    if require is not None:
        env["DYNVOCAB_REQUIRE_DEMO"] = require
    args = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-p", "require_demo",
            "test_sample.py"]
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_skipped_demo_test_passes_without_the_variable(tmp_path):
    run = run_sample(tmp_path, None)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 3 skipped" in run.stdout


@pytest.mark.parametrize("value", ["0", ""])
def test_other_values_do_not_require_the_demo(tmp_path, value):
    run = run_sample(tmp_path, value)
    assert run.returncode == 0, run.stdout + run.stderr


def test_skipped_demo_test_fails_when_required(tmp_path):
    run = run_sample(tmp_path, "1")
    assert run.returncode == 1, run.stdout + run.stderr
    # A skip mark acts in set-up (reported as an error), ``pytest.skip`` in the call (a failure); a plain skip stays.
    assert "1 failed, 1 passed, 1 skipped, 1 error" in run.stdout
    assert "ERROR test_sample.py::test_demo_skipped" in run.stdout
    assert "FAILED test_sample.py::test_demo_skips_itself" in run.stdout
    assert "DYNVOCAB_REQUIRE_DEMO=1 requires it to run: demo packages absent" in run.stdout
    assert "DYNVOCAB_REQUIRE_DEMO=1 requires it to run: model files absent" in run.stdout


@pytest.mark.parametrize("module", ["test_demo_e2e", "test_demo_bundle_e2e"])
def test_the_demo_end_to_end_modules_carry_the_demo_mark(module):
    """The hook only sees ``demo``-marked tests: the end-to-end modules must carry the mark (not only a skip)."""
    import importlib

    marks = importlib.import_module(module).pytestmark
    assert "demo" in [m.name for m in (marks if isinstance(marks, list) else [marks])]
