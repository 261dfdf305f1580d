"""Triton test modules, each in a child pytest process that fixes Triton's mode for its whole life.

Triton decides compile-or-interpret when a kernel is decorated (``TRITON_INTERPRET`` read by ``@triton.jit``), and
its interpreter patches ``triton.language`` in place on nested ``@triton.jit`` calls without undoing it
(``triton/runtime/interpreter.py``, ``InterpretedFunction.__call__``): after interpreted kernels have run, the GPU
compiler fails on the same process's ``triton.language`` ("'value' object has no attribute 'dtype'"). The two
modes cannot share a process, so the test process itself never sets ``TRITON_INTERPRET``: each module below runs
in a child ``pytest`` with the mode it needs, and the parent reports one item per module.

To run one of these modules in-process (to pick tests with ``-k``), set the mode yourself:
``TRITON_INTERPRET=1 python -m pytest tests/test_kernels.py -k window``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynvocab.kernels import interpreting, triton_available

# Module file name -> whether it needs the interpreter (on a machine without CUDA).
TRITON_MODULES = {
    "test_kernels.py": True,
    "test_kernels_compile.py": False,
}
CHILD_TIMEOUT_S = 1200
CALLER_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET")  # as the caller started pytest (None: not set)

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
# Where the kernels launch: CPU tensors under the interpreter, CUDA tensors otherwise.
KERNEL_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreting(), reason="CPU launches need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available() or interpreting(), reason="no GPU")),
]
# The one device a kernel test runs on here, and whether it can.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
kernel_runs_here = pytest.mark.skipif(
    not triton_available() or (KERNEL_DEVICE == "cpu" and not interpreting()), reason="needs a GPU or the interpreter"
)


def runs_in_child(path: Path) -> bool:
    """Whether this test file must run in a child process (the caller did not choose a Triton mode)."""
    return path.name in TRITON_MODULES and CALLER_TRITON_INTERPRET is None


def child_env(name: str) -> dict[str, str]:
    """The environment of the child for module ``name``: the parent's, plus its Triton mode."""
    interpret = TRITON_MODULES[name] and not torch.cuda.is_available()
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # one process: no xdist workers
    return {**env, "TRITON_INTERPRET": "1" if interpret else "0"}


class ChildFailed(Exception):
    """A child pytest run failed; carries its output."""


class TritonModuleItem(pytest.Item):
    """One test file run by a child ``python -m pytest`` with its own Triton mode."""

    def runtest(self) -> None:
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(self.path)]
        if self.config.getoption("keyword"):
            args += ["-k", self.config.getoption("keyword")]
        if self.config.getoption("reverse"):
            args.append("--reverse")
        run = subprocess.run(args, cwd=self.config.rootpath, env=child_env(self.path.name), capture_output=True,
                             text=True, timeout=CHILD_TIMEOUT_S)
        summary = (run.stdout.strip().splitlines() or [""])[-1]
        if run.returncode == 5:  # no test selected (``-k``)
            pytest.skip(f"child: {summary}")
        if run.returncode != 0:
            raise ChildFailed(run.stdout[-6000:] + run.stderr[-2000:])
        if " passed" not in summary:
            pytest.skip(f"child: {summary}")
        self.user_properties.append(("child", summary))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, ChildFailed):
            mode = child_env(self.path.name)["TRITON_INTERPRET"]
            return f"child pytest (TRITON_INTERPRET={mode}) failed:\n{excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.path.name} (child process)"


class TritonModuleFile(pytest.File):
    """Collects a Triton test file as one child-process item, without importing it here."""

    def collect(self):
        yield TritonModuleItem.from_parent(self, name="child-process")
