"""The docs cannot rot: the README and each guide stay within their line budgets, every relative link in README.md and
docs/ (measurements included) reaches a file and a heading there, and every ```bash block of the README and the
guides runs as written on tiny local models, in order, one folder per file, unless the line before it says why not
(``<!-- not run: REASON -->``); the README's first block, the set-up, is .ci/run's own. A block's ``dynvocab …`` lines run in-process with ``demo:target`` and
``demo:draft`` swapped for the tiny pair, which ``DYNVOCAB_TARGET`` and ``DYNVOCAB_DRAFT`` also make the default."""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_helpers import run

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs").glob("*.md"))
MEASURED = ROOT / "docs" / "measurements"
INDEX = MEASURED / "README.md"
MEASUREMENTS = sorted(p for p in MEASURED.glob("*.md") if p != INDEX)
README_LINES, GUIDE_LINES = 200, 300

FENCE = re.compile(r"^(```|~~~)")
NOT_RUN = re.compile(r"^<!-- not run: (\S.*\S) -->$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclass(frozen=True)
class Block:
    """One fenced block: its info string, its lines, the line before its opening fence and its line number."""

    info: str
    lines: tuple[str, ...]
    before: str
    line: int


def blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown text, in order."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            fence, start = lines[i][:3], i
            i += 1
            while i < len(lines) and not lines[i].startswith(fence):
                i += 1
            before = lines[start - 1].strip() if start > 0 else ""
            found.append(Block(lines[start][3:].strip(), tuple(lines[start + 1:i]), before, start + 1))
        i += 1
    return found


def outside_fences(text: str) -> list[str]:
    """The lines of a markdown text outside its fenced blocks."""
    out, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            out.append(line)
    return out


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code spans."""
    return "\n".join(re.sub(r"`[^`]*`", "", line) for line in outside_fences(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercased, punctuation but ``-`` and ``_`` removed, spaces
    to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's ``-1``, ``-2`` … for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in outside_fences(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        out.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return out


def test_the_readme_and_each_guide_stay_within_their_line_budgets():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= README_LINES
    long = {p.name: n for p in GUIDES if (n := len(p.read_text(encoding="utf-8").splitlines())) > GUIDE_LINES}
    assert not long, f"guides over {GUIDE_LINES} lines: {long}"


@pytest.mark.parametrize("path", [README, *GUIDES, INDEX, *MEASUREMENTS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_a_heading(path):
    broken = []
    for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_index_lists_every_measurement():
    listed = {target.partition("#")[0] for target in LINK.findall(INDEX.read_text(encoding="utf-8"))}
    files = {p.name for p in MEASURED.iterdir() if p.is_file() and p != INDEX}
    assert files <= listed, f"not in docs/measurements/README.md: {sorted(files - listed)}"


def test_every_measurement_says_when_where_and_how_it_was_measured():
    for path in MEASUREMENTS:
        assert re.match(r"^\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md$", path.name), path.name
        head = path.read_text(encoding="utf-8")[:2000]
        for field in ("**Date:**", "**Commit:**", "**CPU:**", "**Load:**", "**Command:**"):
            assert field in head, f"{path.name} lacks {field}"


def commands(block: Block) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", "\n".join(block.lines))
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def shell_blocks(path: Path) -> list[Block]:
    return [b for b in blocks(path.read_text(encoding="utf-8")) if b.info in ("bash", "sh", "shell", "console")]


DOCS_WITH_SHELL = [p for p in (README, *GUIDES) if shell_blocks(p)]


@pytest.mark.parametrize("path", DOCS_WITH_SHELL, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shell_block_runs_or_says_why_not(path, tiny_dirs, tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DYNVOCAB_TARGET", str(tiny_dirs["target"]))
    monkeypatch.setenv("DYNVOCAB_DRAFT", str(tiny_dirs["draft"]))
    swaps = {"demo:target": str(tiny_dirs["target"]), "demo:draft": str(tiny_dirs["draft"])}
    for i, block in enumerate(shell_blocks(path)):
        if path == README and i == 0:
            continue  # the set-up commands: .ci/run runs the second itself, test_demo_e2e what the first benches
        where = f"{path.relative_to(ROOT)}:{block.line}"
        if block.before.startswith("<!-- not run"):
            assert NOT_RUN.match(block.before), f"{where}: write the reason as <!-- not run: REASON -->"
            continue
        assert block.info == "bash", f"{where}: shell blocks are ```bash"
        for command in commands(block):
            assert command.startswith("dynvocab "), (
                f"{where}: `{command}` is not a dynvocab command; mark the block <!-- not run: REASON -->"
            )
            assert "demo:gemma" not in command, f"{where}: the 262k demo cannot run on tiny models; mark the block"
            args = shlex.split(command)[1:]
            args = [swaps.get(a, a) for a in args]
            result = run(*args)
            assert result.exit_code == 0, f"{where}: `{command}` failed:\n{result.output}"
