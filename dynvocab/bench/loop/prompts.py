"""The bench prompt file format (JSONL rows: id, task, prompt|messages)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dynvocab.errors import DynvocabError


@dataclass(frozen=True)
class PromptRow:
    """One bench prompt: a single user message (``prompt``) or chat turns (``messages``)."""

    id: str
    task: str
    messages: tuple[dict, ...]


def load_prompts(path: str | Path, ids: list[str] | None = None, tasks: list[str] | None = None) -> list[PromptRow]:
    """Read a JSONL prompt file; keep the rows whose id is in ``ids`` and task in ``tasks`` (when given)."""
    path = Path(path)
    if not path.is_file():
        raise DynvocabError(f"prompt file {path} does not exist")
    rows: list[PromptRow] = []
    first_line: dict[str, int] = {}  # id -> the line it first appears on
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DynvocabError(f"{path}:{lineno} is not valid JSON ({exc.msg})") from exc
        if not isinstance(obj, dict):
            raise DynvocabError(f"{path}:{lineno} must be a JSON object with id, task and prompt or messages")
        row = _row(obj, f"{path}:{lineno}", len(rows))
        if row.id in first_line:
            raise DynvocabError(
                f"{path}:{lineno} repeats id '{row.id}' of line {first_line[row.id]}; give every row its own id"
            )
        first_line[row.id] = lineno
        rows.append(row)
    if ids:
        known = {r.id for r in rows}
        unknown = [i for i in ids if i not in known]
        if unknown:
            raise DynvocabError(f"--ids names ids not in {path}: {', '.join(unknown[:5])}")
        rows = [r for r in rows if r.id in set(ids)]
    if tasks:
        rows = [r for r in rows if r.task in set(tasks)]
    if not rows:
        raise DynvocabError(f"no prompts selected from {path}; check --ids / --tasks")
    return rows


def _row(obj: dict, where: str, index: int) -> PromptRow:
    pid = str(obj.get("id", obj.get("question_id", index)))
    task = str(obj.get("task", obj.get("category", "default")))
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise DynvocabError(f"{where}: messages must be a list of {{role, content}} objects")
        messages = tuple({"role": m.get("role", "user"), "content": str(m["content"])} for m in messages)
    elif "prompt" in obj:
        messages = ({"role": "user", "content": str(obj["prompt"])},)
    elif "turns" in obj and obj["turns"]:  # Spec-Bench question.jsonl: the first turn
        messages = ({"role": "user", "content": str(obj["turns"][0])},)
    else:
        raise DynvocabError(f"{where}: a row needs 'prompt' (a user message) or 'messages' (chat turns)")
    if not any(m["content"].strip() for m in messages):
        raise DynvocabError(f"{where}: the prompt is empty")
    return PromptRow(pid, task, messages)
