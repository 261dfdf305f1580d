"""Finished stages of a build, kept beside its output so that a build killed half-way resumes where it stopped.

Each finished stage is written (atomically, as a one-stage bundle) into ``.<out>.stages/`` next to the output,
under a name keyed by everything its content depends on: the stage's config, the corpus, the models' fingerprints
and the dynvocab version. A rerun of the same command loads those stages instead of building them again; a run
with other settings never picks them up. The folder is removed once the bundle is written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from dynvocab.version import __version__
from dynvocab.artifacts import ModelFingerprint, Stage, load_bundle, write_bundle
from dynvocab.errors import DynvocabError


class StageCheckpoints:
    """The finished stages of one build of ``out``."""

    def __init__(self, out: Path, target: ModelFingerprint, draft: ModelFingerprint, corpus: dict):
        self.folder = out.parent / f".{out.name}.stages"
        self._target, self._draft = target, draft
        self._common = {"target": target.as_dict(), "draft": draft.as_dict(), "corpus": corpus, "version": __version__}

    def _path(self, name: str, config: dict) -> Path:
        key = json.dumps({**self._common, "stage": name, "config": config}, sort_keys=True, default=str)
        return self.folder / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"

    def load(self, name: str, config: dict) -> Stage | None:
        """The stage ``name`` built with ``config`` by an earlier, interrupted run, or None."""
        path = self._path(name, config)
        if not path.is_file():
            return None
        try:
            with load_bundle(path, verify=True) as bundle:
                return bundle.load_stage(name)
        except DynvocabError:
            path.unlink(missing_ok=True)
            return None

    def save(self, stage: Stage, config: dict) -> None:
        """Keep a finished stage until the bundle is written."""
        self.folder.mkdir(exist_ok=True)
        write_bundle(self._path(stage.name, config), [stage], self._target, self._draft)

    def clear(self) -> None:
        """Drop every kept stage (the bundle holds them now)."""
        shutil.rmtree(self.folder, ignore_errors=True)
