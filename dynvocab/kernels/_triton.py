"""Lazy access to Triton: whether it can run here, and whether it runs under the interpreter.

The ``@triton.jit`` kernels live in ``*_triton.py`` modules that are imported only when a kernel is first
launched. Triton decides at decoration time whether a kernel is compiled or interpreted (``TRITON_INTERPRET=1``),
so importing ``dynvocab.kernels`` never decorates anything: a test can set the variable at any point before its
first launch, and CPU-only code paths never import Triton at all.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works in this environment."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def can_launch(*tensors: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on these tensors: CUDA tensors, or any tensors under the interpreter."""
    if not triton_available():
        return False
    return interpreting() or all(t.is_cuda for t in tensors)


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise a clear error when a Triton kernel cannot run on these tensors."""
    if not triton_available():
        raise RuntimeError("Triton is not installed; use the torch reference (the *_auto dispatchers do this)")
    if not can_launch(*tensors):
        raise RuntimeError(
            "Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before the first launch for CPU tensors"
        )
