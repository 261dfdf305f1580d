"""The suite does not depend on test order: Triton's interpreter tests cannot break the compile tests after them."""

import os
import subprocess
import sys

import pytest

import triton_modes

KERNEL_FILES = ["tests/test_kernels.py", "tests/test_kernels_compile.py"]


def test_collection_left_the_triton_mode_as_the_caller_set_it():
    """No test module sets TRITON_INTERPRET in this process (collection has imported them all by now)."""
    assert os.environ.get("TRITON_INTERPRET") == triton_modes.CALLER_TRITON_INTERPRET


@pytest.mark.parametrize("order", ["default", "reverse"])
def test_compile_tests_pass_in_one_run_with_the_interpreter_tests(order, tmp_path, pytestconfig):
    """Interpreter tests then compile tests (and the reverse) in one pytest run, on an empty Triton cache.

    Before the Triton modules ran in child processes, the interpreter's patches of ``triton.language`` made every
    compile test fail here ("'value' object has no attribute 'dtype'")."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_ADDOPTS")}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_FILES]
    if order == "reverse":
        args.append("--reverse")
    run = subprocess.run(args, cwd=pytestconfig.rootpath, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout.strip().splitlines()[-1]
