"""The loop's one way from the device to the host (vLLM's ``parse_output``), and the spy that checks it.

Every value the speculative loop needs as a Python number — a ranked draft step's confidence, a cycle's verdict
with its drafted tokens, a head's slot counts, a generation's counters — comes back through :func:`to_host`, one
small tensor at a time; host code that takes a tensor (hnswlib's searches, a kept table) gets its copy through
:func:`to_host_tensor`. Each call is one device→host copy (on a GPU, one wait); anything else on the hot path stays
a device tensor. :class:`HostReads` counts these calls and every other read of a tensor (a conversion to Python
numbers or a ``.cpu()``); tests/test_host_reads.py runs every strategy under it and forbids the others.
:func:`host_reads` is the same spy watching every caller, for a step that must read nothing back
(``scripts/gpu_check.sh``'s CUDA-graph step).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch


def to_host(t: torch.Tensor) -> list | int | float | bool:
    """``t`` as Python numbers: a list for a tensor with dimensions, a scalar for a 0-d tensor (one device wait)."""
    return t.tolist()


def to_host_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to the CPU as a tensor, for host code that takes tensors or arrays (hnswlib's searches, a kept
    table): one device wait; a CPU tensor is returned as it is."""
    return t.cpu()


CONVERSIONS = ("__int__", "__float__", "__bool__", "__index__", "item", "tolist")  # the ways a tensor reaches Python
READS = CONVERSIONS + ("cpu",)  # … and the way it reaches the host as a tensor
HELPERS = ("to_host", "to_host_tensor")
PACKAGE = str(Path(__file__).parents[1])  # dynvocab/
HOST = str(Path(__file__))


class HostReads:
    """While entered: ``helper`` counts :func:`to_host` and :func:`to_host_tensor` calls by the name of the
    function that made them, and ``elsewhere`` every other read of a tensor (``conversions``, by default
    :data:`READS`: the conversions to Python numbers and ``.cpu()``, counted even where the tensor already is on
    the CPU, so a CPU run catches what would wait on a GPU) made from a frame in a file under ``roots`` (by
    ``file:line conversion``; ``roots=("",)``: from anywhere outside torch). Counting changes nothing else;
    leaving restores everything. The loop's test (tests/test_host_reads.py), ``bench``'s tree step and
    ``scripts/gpu_check.sh``'s CUDA-graph step use it."""

    def __init__(self, roots: tuple[str, ...] = (PACKAGE,), conversions: tuple[str, ...] = READS):
        self.roots = roots
        self.conversions = conversions
        self.helper: collections.Counter = collections.Counter()
        self.elsewhere: collections.Counter = collections.Counter()
        self._undo: list[tuple[object, str, object]] = []

    def __enter__(self) -> "HostReads":
        modules = [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("dynvocab")]
        for helper in HELPERS:
            original = globals()[helper]  # this module's own names are patched too
            counted = self._counting(original)
            for module in modules:
                if getattr(module, helper, None) is original:
                    self._patch(module, helper, counted)
        for name in self.conversions:
            self._patch(torch.Tensor, name, self._watching(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            setattr(owner, name, original)

    def _patch(self, owner, name: str, value) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _counting(self, original):
        def counted(t):
            self.helper[sys._getframe(1).f_code.co_name] += 1
            return original(t)
        return counted

    def _watching(self, name: str, conversion):
        def watched(t, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            where = "" if frame is None else frame.f_code.co_filename
            if where.startswith(self.roots) and where != HOST:
                self.elsewhere[f"{Path(where).name}:{frame.f_lineno} {name}"] += 1
            return conversion(t, *args, **kwargs)
        return watched


def host_reads() -> HostReads:
    """Records every device-to-host read of a tensor (``.item()``, ``bool()``, ``.cpu()``, …) in the block by
    ``"file:line name"`` of the first caller outside torch (``.elsewhere``): a step with any cannot be captured as
    a CUDA graph. :class:`HostReads` watching every caller."""
    return HostReads(roots=("",))
