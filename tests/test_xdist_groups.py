"""CI's two pytest-xdist workers (``-n 2 --dist loadgroup``) keep each test file on one worker, so its module fixtures
are built once (tests/conftest.py groups the tests before pytest-xdist reads the groups: a hook that ran after it
grouped nothing, and a file's 50-second fixture was built on both workers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = ("tests/test_batch_select.py", "tests/test_engine_context.py")  # quick, each with many tests


def test_each_file_runs_on_one_worker():
    pytest.importorskip("xdist")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                          "no:cacheprovider", *FILES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    workers = defaultdict(set)
    for worker, path in re.findall(r"^\[(gw\d+)\] \[\s*\d+%\] PASSED (tests/\w+\.py)::", run.stdout, re.MULTILINE):
        workers[path].add(worker)
    assert set(workers) == set(FILES), run.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
