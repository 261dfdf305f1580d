"""Converted-model cache entries that are whole or absent.

An entry is a folder (``config.json``, ``*.safetensors``, tokenizer files) built into a temp folder beside it and
renamed into place in one step, under an ``fcntl`` lock so that two processes filling an empty cache convert once
and both get the entry. A ``.complete.json`` marker records every file's size; an entry whose files do not match
it, or whose safetensors file is cut short, is named as damaged and rebuilt instead of loaded. An entry written
before markers existed is accepted once its safetensors headers agree with the file sizes, and then marked.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Callable

from dynvocab.files import file_lock, publish_dir, temp_dir_for, write_atomic

MARKER = ".complete.json"
log = logging.getLogger(__name__)


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file at ``path`` is not whole (its header promises more or fewer bytes), or None.

    Reads only the header: 8 bytes of little-endian length, then the JSON tensor table
    (format: https://github.com/huggingface/safetensors, ``safetensors/src/tensor.rs``).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path.name} is {size} bytes, shorter than a safetensors header"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"{path.name} header says {n} header bytes, the file has {size - 8}"
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return f"{path.name} has an unreadable header"
    ends = [spec["data_offsets"][1] for name, spec in header.items() if name != "__metadata__"]
    expected = 8 + n + max(ends, default=0)
    if expected != size:
        return f"{path.name} should be {expected} bytes, found {size}"
    return None


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name != MARKER)


def write_marker(folder: Path) -> None:
    """Record the size of every file in ``folder`` as its completion marker."""
    sizes = {p.name: p.stat().st_size for p in _files(folder)}
    write_atomic(folder / MARKER, lambda tmp: tmp.write_text(json.dumps({"sizes": sizes}, indent=1)))


def entry_problem(folder: Path) -> str | None:
    """Why the cache entry ``folder`` cannot be loaded as it is, or None when it is whole."""
    if not folder.is_dir():
        return "missing"
    marker = folder / MARKER
    if marker.is_file():
        try:
            sizes = json.loads(marker.read_text())["sizes"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"its marker {MARKER} is unreadable"
        for name, size in sizes.items():
            path = folder / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != size:
                return f"{name} should be {size} bytes, found {path.stat().st_size}"
    elif not (folder / "config.json").is_file():
        return "config.json is missing"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return "it has no .safetensors file"
    for path in weights:
        problem = safetensors_problem(path)
        if problem:
            return problem
    if not marker.is_file():
        write_marker(folder)  # a whole entry from before markers existed: accept it and mark it
    return None


def ensure_entry(final: Path, convert: Callable[[Path], None], label: str) -> Path:
    """The whole cache entry ``final``, made by ``convert(folder)`` into a temp folder when it is missing or damaged.

    Concurrent callers serialize on a lock beside the entry; the loser of the race finds the winner's entry whole.
    """
    if entry_problem(final) is None:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        problem = entry_problem(final)
        if problem is None:
            return final  # another process built it while we waited
        if final.exists():
            log.warning(f"note: {label} cache entry {final} is damaged ({problem}); rebuilding it")
            shutil.rmtree(final)
        staged = temp_dir_for(final)
        try:
            convert(staged)
            write_marker(staged)
            publish_dir(staged, final)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
    return final
