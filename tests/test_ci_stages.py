"""What CI's second stage runs is declared by the tests themselves, and no vLLM test can fall out of it.

``.ci/run`` runs the whole suite once (transformers' upper bound, no vLLM: the vLLM tests skip there), then again
beside vLLM at transformers' lower bound, only what that environment can change: ``-m vllm`` (the engine tests, two
workers), then ``-m "transformers_api and not vllm"`` (two workers): together ``vllm or transformers_api``.
A vLLM test module without the ``vllm`` mark would skip in the first stage and never be selected in the second, so
this test reads every test module (``ast``, nothing imported) and fails on one that needs vLLM and lacks the mark.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECOND_STAGE = ("vllm", "transformers_api")


def needs_vllm(tree: ast.Module) -> bool:
    """Whether a module imports vLLM, skips without it, or uses the vLLM engine fixtures."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("vllm", "vllm_models"):
            return True
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("importorskip", "find_spec"):
            if node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "vllm":
                return True
    return False


def module_marks(tree: ast.Module) -> set[str]:
    """The ``pytest.mark.NAME`` names of a module's top-level ``pytestmark``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            return {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    return set()


def unmarked_vllm_modules(sources: dict[str, str]) -> list[str]:
    """The modules of ``{name: source}`` that need vLLM but are not marked ``vllm``."""
    out = []
    for name, source in sources.items():
        tree = ast.parse(source)
        if needs_vllm(tree) and "vllm" not in module_marks(tree):
            out.append(name)
    return out


def test_every_vllm_test_module_is_marked_for_the_second_stage():
    sources = {p.name: p.read_text() for p in sorted((ROOT / "tests").glob("test_*.py"))}
    assert unmarked_vllm_modules(sources) == []
    assert sum("vllm" in module_marks(ast.parse(s)) for s in sources.values()) >= 7


def test_the_check_catches_an_unmarked_module():
    bad = 'import pytest\npytest.importorskip("vllm")\n'
    good = bad + "pytestmark = pytest.mark.vllm\n"
    fixtures = "import pytest\nfrom vllm_models import vllm_pair\npytestmark = [pytest.mark.demo]\n"
    assert unmarked_vllm_modules({"bad": bad, "good": good, "fixtures": fixtures}) == ["bad", "fixtures"]


def test_the_second_stage_selects_the_declared_marks():
    """The marks are registered with pytest, and ``.ci/run``'s second stage selects exactly them: the engine tests,
    then the rest of what transformers' version can change."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    for mark in SECOND_STAGE:
        assert re.search(rf'"{mark}: ', pyproject), mark
    run = (ROOT / ".ci" / "run").read_text()
    engines, rest = SECOND_STAGE
    assert f"-m {engines} " in run and f'-m "{rest} and not {engines}"' in run
