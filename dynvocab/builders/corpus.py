"""Corpus sources as streams of documents (plain strings), and those documents as token ids for a model.

- ``slimpajama``: ``cerebras/SlimPajama-627B`` streamed through ``datasets`` (rows with ``text`` and ``meta``).
- ``sharegpt``: the embedded ShareGPT V3 conversations, **training split only** (see :mod:`dynvocab.data`):
  positions ≡ 9 (mod 10) are the evaluation split and never reach a builder.
- ``python-stubs``: code-completion prompts made from the running Python's standard library (signature and
  docstring of each documented public function; see :mod:`dynvocab.data.python_stubs`), for self-distilled heads.
- ``debian-faq`` / ``debian-faq-translate`` / ``licences``: prompts made from the **training split** of Debian's FAQ
  in nine languages (explain a section in its language; translate an English section into each other language) and
  of its licence texts (:mod:`dynvocab.data.debian_docs`; the evaluation split is the bench's shifted tasks').
- paths: ``.txt`` (one document per non-empty line), ``.jsonl``/``.json`` (``text``, ShareGPT
  ``conversations`` or chat ``messages``), ``.parquet``, or a folder written by ``datasets.save_to_disk``.
  JSON lines and parquet go through ``datasets`` streaming, the same path as SlimPajama.
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

from dynvocab.data import debian_docs, python_stubs
from dynvocab.data.sharegpt import EVAL_EVERY, EVAL_REMAINDER, conversation_text, sharegpt_train, to_messages
from dynvocab.errors import DynvocabError

SLIMPAJAMA = "cerebras/SlimPajama-627B"
_STREAMED = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_NAMED = ("sharegpt", "slimpajama", python_stubs.NAME, *debian_docs.CORPORA)


@dataclass(frozen=True)
class CorpusConfig:
    """Which documents to read. ``sources`` items are ``slimpajama``, ``sharegpt``, ``python-stubs`` or file/folder
    paths."""

    sources: tuple[str, ...] = ("sharegpt",)
    max_docs: int = 1_000_000  # FR-Spec counts 1M SlimPajama documents
    slimpajama_id: str = SLIMPAJAMA  # hub id, or a local SlimPajama-format .jsonl (tests)

    def describe(self) -> dict:
        """A JSON-ready description stored in the bundle (ShareGPT: training split)."""
        out = asdict(self)
        out["sources"] = list(self.sources)
        if "sharegpt" in self.sources:
            out["sharegpt_split"] = f"train (positions not ≡ {EVAL_REMAINDER} mod {EVAL_EVERY})"
        if python_stubs.NAME in self.sources:
            out["python_stubs"] = python_stubs.describe()
        for name in debian_docs.CORPORA:
            if name in self.sources:
                out[name.replace("-", "_")] = debian_docs.describe(name)
        return out


def check_sources(cfg: CorpusConfig) -> None:
    """Fail early on empty or missing sources, before any model is loaded."""
    if not cfg.sources:
        raise DynvocabError(f"no corpus given; pass --corpus {', '.join(_NAMED)} or file paths")
    if cfg.max_docs < 1:
        raise DynvocabError("--max-docs must be at least 1")
    for src in cfg.sources:
        if src in _NAMED:
            continue
        path = Path(src).expanduser()
        if not path.exists():
            raise DynvocabError(f"corpus {src} does not exist; pass {', '.join(_NAMED)} or existing files")
        if path.is_file() and path.suffix not in (".txt", *_STREAMED):
            raise DynvocabError(f"corpus file {src} has an unknown type; use .txt, .jsonl, .json or .parquet")
        if path.is_dir() and not ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            raise DynvocabError(f"corpus folder {src} is not a saved `datasets` folder (no dataset_info.json)")


def iter_documents(cfg: CorpusConfig) -> Iterator[str]:
    """All documents of all sources, in order, at most ``cfg.max_docs`` non-empty ones."""
    return (text for _, text in iter_labelled_documents(cfg))


def iter_labelled_documents(cfg: CorpusConfig) -> Iterator[tuple[str, str]]:
    """``(group, text)`` of :func:`iter_documents`' documents: the group is the source (a corpus name or file
    path), with the language after a colon where the source has several (``debian-faq:ru``)."""
    check_sources(cfg)
    docs = itertools.chain.from_iterable(_labelled(src, cfg) for src in cfg.sources)
    return itertools.islice(((g, d) for g, d in docs if d and d.strip()), cfg.max_docs)


def _labelled(src: str, cfg: CorpusConfig) -> Iterator[tuple[str, str]]:
    for row in _rows(src, cfg):
        lang = row.get("lang")
        yield (f"{src}:{lang}" if isinstance(lang, str) else src), row_text(row)


def _rows(src: str, cfg: CorpusConfig) -> Iterator[dict]:
    if src == "sharegpt":
        return sharegpt_train()
    if src == "slimpajama":
        return stream_rows(cfg.slimpajama_id)
    if src == python_stubs.NAME:
        return python_stubs.stub_rows()
    if src in debian_docs.CORPORA:
        return debian_docs.corpus_rows(src)
    path = Path(src).expanduser()
    if path.is_dir():
        return _saved_dataset_rows(path)
    if path.suffix == ".txt":
        return ({"text": line} for line in _txt_lines(path))
    return stream_rows(str(path))


def row_text(row: dict) -> str:
    """The text of one corpus row: ``text``, else its conversation turns."""
    text = row.get("text")
    return text if isinstance(text, str) else conversation_text(row)


def first_turns(cfg: CorpusConfig) -> Iterator[list[dict]]:
    """Each row's messages up to its first user turn (system turns before it kept), in corpus order; a plain-text
    row is one user turn, and a conversation that opens with the assistant is skipped. At most ``cfg.max_docs``."""
    check_sources(cfg)
    count = 0
    for src in cfg.sources:
        for row in _rows(src, cfg):
            text = row.get("text")
            messages = [{"role": "user", "content": text}] if isinstance(text, str) else to_messages(row)
            user = next((k for k, m in enumerate(messages) if m["role"] == "user" and m["content"].strip()), None)
            if user is None or any(m["role"] == "assistant" for m in messages[:user]):
                continue
            yield messages[: user + 1]
            count += 1
            if count >= cfg.max_docs:
                return


# ---- token ids (the router and train-draft read documents as a model sees them) ------------------------


def encode_documents(corpus: CorpusConfig, tokenizer, max_tokens: int) -> Iterator[list[int]]:
    """Token ids of each corpus document, at most ``max_tokens`` each, at most ``corpus.max_docs`` documents.

    ShareGPT conversations (training split only) are encoded with the tokenizer's chat template, as the runtime
    encodes prompts; other sources are plain text.
    """
    check_sources(corpus)
    count = 0
    for src in corpus.sources:
        for ids in _source_ids(src, corpus, tokenizer, max_tokens):
            if len(ids) < 2:
                continue
            yield ids
            count += 1
            if count >= corpus.max_docs:
                return


def _source_ids(src: str, corpus: CorpusConfig, tokenizer, max_tokens: int) -> Iterator[list[int]]:
    chars = max_tokens * 16  # enough text for max_tokens tokens; spares tokenizing whole long conversations
    if src == "sharegpt" and getattr(tokenizer, "chat_template", None):
        for record in sharegpt_train():
            messages = to_messages(record)
            if messages:
                text = tokenizer.apply_chat_template(messages, tokenize=False)
                yield tokenizer(text[:chars], add_special_tokens=False)["input_ids"][:max_tokens]
        return
    one = CorpusConfig(sources=(src,), max_docs=corpus.max_docs, slimpajama_id=corpus.slimpajama_id)
    for text in iter_documents(one):
        yield tokenizer(text[:chars], add_special_tokens=False)["input_ids"][:max_tokens]


# ---- datasets streaming (SlimPajama and local json/parquet) -----------------------------------------------


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers (a quick TCP connect; offline env vars mean no)."""
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def stream_texts(source: str) -> Iterator[str]:
    """Stream the documents of a hub dataset id or a local .jsonl/.json/.parquet file with ``datasets``."""
    return (row_text(row) for row in stream_rows(source))


def stream_rows(source: str) -> Iterator[dict]:
    """Stream the rows of a hub dataset id or a local .jsonl/.json/.parquet file with ``datasets``."""
    import datasets

    local = Path(source).expanduser()
    if local.is_file():
        args, kwargs = (_STREAMED.get(local.suffix, "json"),), {"data_files": str(local)}
    else:
        if not hub_reachable():
            raise DynvocabError(
                f"cannot reach the Hugging Face hub to stream {source}; "
                "connect to the internet or pass local corpus files (--corpus FILE.jsonl)"
            )
        args, kwargs = (source,), {}
    try:
        stream = datasets.load_dataset(*args, split="train", streaming=True, **kwargs)
        yield from stream
    except DynvocabError:
        raise
    except Exception as exc:  # datasets raises many types (network, format, schema)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise DynvocabError(f"cannot read corpus {source}: {first}; check the path or your connection") from exc


def _saved_dataset_rows(path: Path) -> Iterator[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DynvocabError(f"cannot load the saved dataset {path} ({type(exc).__name__}); re-save it with save_to_disk") from exc
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    yield from ds


def _txt_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.strip():
                yield line
