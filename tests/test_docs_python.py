"""docs/python.md and the README's "From Python" section, run as written, in order, on tiny local models: every
```python block of each file shares one namespace (as a reader pastes them one after another), with ``demo:target``
and ``demo:draft`` swapped for the tiny pair."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(path: Path, section: str | None = None) -> list[str]:
    """The ```python blocks of ``path`` (of its ``## section`` only, when given)."""
    text = path.read_text(encoding="utf-8")
    if section is not None:
        start = text.index(f"## {section}")
        end = text.find("\n## ", start + 1)
        text = text[start: end if end > 0 else None]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def run_blocks(blocks: list[str], tiny_dirs, folder: Path, monkeypatch) -> dict:
    monkeypatch.chdir(folder)
    namespace: dict = {"__name__": "__docs__"}
    for block in blocks:
        code = block.replace("demo:target", str(tiny_dirs["target"])).replace("demo:draft", str(tiny_dirs["draft"]))
        exec(compile(code, "<docs>", "exec"), namespace)
    return namespace


def test_docs_python_runs_as_written(tiny_dirs, tmp_path, monkeypatch, capsys):
    blocks = python_blocks(ROOT / "docs" / "python.md")
    assert len(blocks) >= 6
    ns = run_blocks(blocks, tiny_dirs, tmp_path, monkeypatch)
    printed = capsys.readouterr().out
    assert ns["out"].strategy == "full" and ns["out"].metrics.new_tokens > 0
    assert [r["strategy"] for r in ns["result"].rows] == ["ar", "full", "microspec"] and "bench (rows·prompts): 6/6" in printed
    assert ns["report"].path.exists() and ns["stages"]  # the progress callback saw the stages run
    assert (tmp_path / "token_map.pt").exists() and "unknown strategy 'no-such-strategy'" in printed


def test_readme_from_python_runs_as_written(tiny_dirs, tmp_path, monkeypatch, capsys):
    blocks = python_blocks(ROOT / "README.md", "From Python")
    assert blocks
    ns = run_blocks(blocks, tiny_dirs, tmp_path, monkeypatch)
    assert ns["out"].token_ids and capsys.readouterr().out
