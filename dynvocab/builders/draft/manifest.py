"""The manifest of a cache folder (self-distilled documents, extracted features): its format version, the target's
fingerprint and the settings the cached files depend on, so that a cache serves only the runs it was made for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from dynvocab.artifacts import ModelFingerprint
from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic

MANIFEST = "manifest.json"


def open_manifest(folder: Path, version: int, fingerprint: ModelFingerprint, settings: dict, *,
                  changed: Callable[[dict, dict], list[str] | None], cached: str, outs: str, old_format: str,
                  other_target: str) -> dict:
    """The manifest of ``folder`` (created, with no documents yet, when absent). A manifest of another format
    version is refused with ``old_format``, one of another target with ``other_target`` (``{folder}`` and, there,
    ``{diff}``, the first difference, filled in), and one whose settings ``changed(recorded, settings)`` names (None:
    the cache serves this run) in one line saying what the folder holds (``cached``) and which options pick
    another (``outs``)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / MANIFEST
    if path.is_file():
        old = json.loads(path.read_text())
        if old.get("format_version") != version:
            raise DynvocabError(old_format.format(folder=folder))
        diffs = ModelFingerprint.from_dict(old["target"]).differences(fingerprint)
        if diffs:
            raise DynvocabError(other_target.format(folder=folder, diff=diffs[0]))
        names = changed(old["settings"], settings)
        if names is not None:
            raise DynvocabError(
                f"{folder} holds {cached} made with other settings ({', '.join(names)}); "
                f"rerun with the same options, use another {outs}, or delete that folder"
            )
        return old
    manifest = {"format_version": version, "target": fingerprint.as_dict(), "settings": settings, "docs": 0,
                "exhausted": False}
    write_manifest(folder, manifest)
    return manifest


def bos_differs(have: dict, want: dict) -> bool:
    """Whether recorded corpus settings (``have``) and a run's (``want``) differ in the BOS token before each document
    (recorded as ``bos`` where the tokenizer adds one)."""
    return have.get("bos") != want.get("bos")


def corpus_change(have: dict, want: dict) -> str:
    """A corpus difference as a refusal names it: the BOS token where that differs, else just the corpus."""
    return "corpus (a BOS token before each document)" if bos_differs(have, want) else "corpus"


def write_manifest(folder: Path, manifest: dict) -> None:
    """Write ``manifest`` into ``folder`` (atomically: never a half-written file)."""
    write_atomic(folder / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=2) + "\n"))


def finished_docs(shard_docs, per_shard: int, max_docs: int) -> int:
    """Documents of the first ``max_docs`` already in whole shards (``shard_docs(i)``: the documents shard ``i``
    holds, 0 when absent), so that a resumed run's progress counts only the work left."""
    return sum(n for i in range(-(-max_docs // per_shard)) if (n := shard_docs(i)) == min(per_shard, max_docs - i * per_shard))
