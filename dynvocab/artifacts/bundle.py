"""The bundle: one safetensors file holding every offline table, described by its own metadata.

Layout. Tensors live under a stage prefix (``freq.counts``, ``clusters.assign``, ``hnsw.index``,
``graph.indptr``, later ``router.*``). ``__metadata__`` (string -> string, JSON inside) holds:

- ``format`` / ``format_version``: what this file is;
- ``fingerprint``: ``{"target": ModelFingerprint, "draft": ModelFingerprint}`` of the models it was built for;
- ``stages``: ``{stage: {"config": …, "info": …, "sha256": …}}`` (``info`` has the build time, seconds, corpus,
  stats; ``sha256`` is the stage's checksum, over its tensors' names and checksums);
- ``checksums``: SHA-256 of every tensor's bytes (so of every stage's), checked when a tensor is first read or by
  :meth:`Bundle.verify`; a mismatch names the stage to rebuild. Bundles written before checksums existed load
  unchecked, and ``inspect`` says so;
- ``written_at`` and ``dynvocab_version``.

Nothing is read from the file name. Writes go to a temp file in the same folder and are renamed into place,
so an interrupted build leaves the previous bundle (or nothing), never a damaged one.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dynvocab.version import __version__
from dynvocab.artifacts.fingerprint import ModelFingerprint
from dynvocab.artifacts.stage_registry import remake_command, stage_names
from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic

FORMAT = "dynvocab-bundle"
FORMAT_VERSION = 1
_MAX_HEADER = 100 * 1024 * 1024
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass
class Stage:
    """One stage as stored: tensors (names without the stage prefix), its config and its build info."""

    name: str
    tensors: dict[str, torch.Tensor]
    config: dict
    info: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors of the stage."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's raw bytes in row-major order (what safetensors stores)."""
    flat = t.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


def stage_sha256(stage: str, checksums: dict[str, str]) -> str:
    """One SHA-256 for a stage: over its tensors' names and SHA-256s, in name order."""
    lines = sorted(f"{name} {sha}" for name, sha in checksums.items() if name.split(".", 1)[0] == stage)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _damaged(path: Path, why: str) -> DynvocabError:
    return DynvocabError(
        f"bundle {path} is damaged ({why}); rebuild it with `dynvocab build-index … --out {path}`"
    )


class Bundle:
    """A validated bundle on disk. Tensors are read on demand and checked against their checksums."""

    def __init__(self, path: Path, metadata: dict, entries: dict[str, TensorEntry], file):
        self.path = path
        # Reads go through the file opened at load time: if the path is replaced later (a rebuild), this
        # object keeps reading the bundle it validated.
        self._file = file
        self.metadata = metadata
        self.entries = entries
        self.fingerprints = {
            role: ModelFingerprint.from_dict(fp) for role, fp in metadata["fingerprint"].items() if fp is not None
        }
        self.stage_meta: dict[str, dict] = metadata["stages"]
        self._checksums: dict[str, str] | None = metadata["checksums"]
        self._verified: set[str] = set()
        self._loaded: dict[str, object] = {}

    def loaded(self, key: str, load):
        """``load()``'s result, computed once per ``key`` for this bundle object (e.g. an HNSW index rebuilt
        from its bytes, which takes seconds), so every generation of a session shares it."""
        if key not in self._loaded:
            self._loaded[key] = load()
        return self._loaded[key]

    @property
    def stages(self) -> list[str]:
        """Stage names present: registered ones in registry order, then any others by name."""
        order = stage_names()
        known = [s for s in order if s in self.stage_meta]
        return known + sorted(s for s in self.stage_meta if s not in order)

    def has(self, stage: str) -> bool:
        """Whether the bundle holds ``stage``."""
        return stage in self.stage_meta

    def require(self, stage: str) -> None:
        """Raise a one-line error when ``stage`` is missing."""
        if not self.has(stage):
            have = ", ".join(self.stages) or "none"
            raise DynvocabError(
                f"bundle {self.path} has no '{stage}' stage (it has: {have}); "
                f"add it with `{remake_command(stage, self.path)}`"
            )

    def config(self, stage: str) -> dict:
        """The config a stage was built with."""
        self.require(stage)
        return self.stage_meta[stage]["config"]

    def info(self, stage: str) -> dict:
        """Build information of a stage (time, seconds, corpus, statistics)."""
        self.require(stage)
        return self.stage_meta[stage].get("info", {})

    def tensor_names(self, stage: str) -> list[str]:
        """Names (without prefix) of a stage's tensors."""
        prefix = f"{stage}."
        return [k[len(prefix):] for k in self.entries if k.startswith(prefix)]

    def stage_checksum(self, stage: str) -> str | None:
        """The stage's SHA-256 (over its tensors' checksums), or None for a bundle written without checksums."""
        return None if self._checksums is None else stage_sha256(stage, self._checksums)

    def stage_nbytes(self, stage: str) -> int:
        """Bytes the stage's tensors take in the file."""
        return sum(self.entries[f"{stage}.{n}"].nbytes for n in self.tensor_names(stage))

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (full name, e.g. ``freq.ranking``); its checksum is verified on first read."""
        if name not in self.entries:
            stage = name.split(".", 1)[0]
            self.require(stage)
            raise DynvocabError(f"bundle {self.path} has no tensor '{name}'; rebuild stage '{stage}'")
        entry = self.entries[name]
        raw = bytearray(entry.nbytes)
        if entry.nbytes and os.preadv(self._file.fileno(), [raw], entry.begin) != entry.nbytes:
            raise _damaged(self.path, f"tensor {name} is cut short")
        if name not in self._verified:
            self._check(name, hashlib.sha256(raw).hexdigest())
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(_DTYPES[entry.dtype]).reshape(entry.shape)

    def stage_tensors(self, stage: str) -> dict[str, torch.Tensor]:
        """All tensors of a stage, keyed without the prefix."""
        self.require(stage)
        return {n: self.tensor(f"{stage}.{n}") for n in self.tensor_names(stage)}

    def load_stage(self, stage: str) -> Stage:
        """A stage with its tensors in memory (used to keep stages when others are rebuilt)."""
        meta = self.stage_meta[stage]
        return Stage(stage, self.stage_tensors(stage), meta["config"], meta.get("info", {}))

    def verify(self) -> None:
        """Check every tensor's checksum (one pass over the file)."""
        with mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for name, entry in self.entries.items():
                if name in self._verified:
                    continue
                self._check(name, hashlib.sha256(memoryview(mm)[entry.begin : entry.end]).hexdigest())

    @property
    def has_checksums(self) -> bool:
        """False for a bundle written before bundles carried checksums: its tensors are read unchecked."""
        return self._checksums is not None

    def _check(self, name: str, digest: str) -> None:
        """Compare one tensor's SHA-256 with the stored one; a mismatch names the stage to rebuild."""
        if self._checksums is not None and digest != self._checksums.get(name):
            stage = name.split(".", 1)[0]
            raise DynvocabError(
                f"bundle {self.path} is damaged: stage '{stage}' fails its checksum (tensor {name}); "
                f"rebuild the stage with `{remake_command(stage, self.path)}`"
            )
        self._verified.add(name)

    def close(self) -> None:
        """Release the file (also done when the object is garbage-collected)."""
        self._file.close()

    def __enter__(self) -> "Bundle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_models(self, target: ModelFingerprint, draft: ModelFingerprint | None = None) -> None:
        """Raise a one-line error naming the model (target or draft) the bundle was not built for."""
        for role, given in (("target", target), ("draft", draft)):
            if given is None or role not in self.fingerprints:
                continue
            diffs = self.fingerprints[role].differences(given)
            if diffs:
                built = self.fingerprints[role].source or "another model"
                raise DynvocabError(
                    f"bundle {self.path} was built for a different {role} ({built}; {', '.join(diffs)}); "
                    f"rebuild it with `dynvocab build-index --{role} {given.source or '…'} …`"
                )


def _read_header(path: Path, f) -> tuple[dict, dict[str, TensorEntry]]:
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise _damaged(path, "file too short")
    n = int.from_bytes(head, "little")
    if n <= 0 or n > min(_MAX_HEADER, size - 8):
        raise _damaged(path, "bad header length")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _damaged(path, "header is not valid JSON") from None
    if not isinstance(header, dict):
        raise _damaged(path, "header is not a JSON object")
    raw_meta = header.pop("__metadata__", None)
    if not isinstance(raw_meta, dict) or raw_meta.get("format") != FORMAT:
        raise DynvocabError(f"{path} is not a dynvocab bundle (no '{FORMAT}' metadata); build one with `dynvocab build-index`")
    data_start, data_len = 8 + n, size - 8 - n
    entries, end_max = {}, 0
    try:
        for name, spec in header.items():
            begin, end = (int(x) for x in spec["data_offsets"])
            if spec["dtype"] not in _DTYPES or not (0 <= begin <= end <= data_len):
                raise ValueError(name)
            shape = tuple(int(s) for s in spec["shape"])
            if math.prod(shape) * _DTYPES[spec["dtype"]].itemsize != end - begin or min(shape, default=0) < 0:
                raise ValueError(name)
            entries[name] = TensorEntry(spec["dtype"], shape, data_start + begin, data_start + end)
            end_max = max(end_max, end)
    except (KeyError, TypeError, ValueError):
        raise _damaged(path, "tensor table is inconsistent or the file is truncated") from None
    if end_max != data_len:
        raise _damaged(path, f"expected {end_max} data bytes, found {data_len}; the file is truncated or padded")
    return raw_meta, entries


def _parse_metadata(path: Path, raw: dict, entries: dict[str, TensorEntry]) -> dict:
    try:
        version = int(raw["format_version"])
    except (KeyError, ValueError):
        raise _damaged(path, "no format version") from None
    if version > FORMAT_VERSION:
        raise DynvocabError(
            f"bundle {path} has format version {version}, newer than this dynvocab ({FORMAT_VERSION}); upgrade dynvocab"
        )
    meta = {"format_version": version, "checksums": None}
    for key in ("fingerprint", "stages", "checksums"):
        if key == "checksums" and key not in raw:
            continue  # written before bundles carried checksums: still readable, unchecked
        try:
            meta[key] = json.loads(raw[key])
        except (KeyError, TypeError, json.JSONDecodeError):
            raise _damaged(path, f"metadata '{key}' is missing or not JSON") from None
        if not isinstance(meta[key], dict):
            raise _damaged(path, f"metadata '{key}' is not a JSON object")
    if "target" not in meta["fingerprint"]:
        raise _damaged(path, "no target fingerprint")
    for name in entries:
        if name.split(".", 1)[0] not in meta["stages"]:
            raise _damaged(path, f"tensor {name} belongs to no stage")
        if meta["checksums"] is not None and name not in meta["checksums"]:
            raise _damaged(path, f"tensor {name} has no checksum")
    for stage, sm in meta["stages"].items():
        if not isinstance(sm, dict) or "config" not in sm:
            raise _damaged(path, f"stage '{stage}' has no config")
        stored = sm.get("sha256")
        if stored is not None and meta["checksums"] is not None and stored != stage_sha256(stage, meta["checksums"]):
            raise _damaged(path, f"stage '{stage}' disagrees with its tensors' checksums")
    meta["written_at"] = raw.get("written_at", "")
    meta["dynvocab_version"] = raw.get("dynvocab_version", "")
    return meta


def load_bundle(path: str | Path, verify: bool = False) -> Bundle:
    """Open and validate a bundle; ``verify=True`` also checks every tensor checksum up front.

    A missing, truncated or damaged file, or one that is not a dynvocab bundle, raises a one-line
    :class:`DynvocabError`.
    """
    path = Path(path)
    if not path.is_file():
        raise DynvocabError(f"bundle {path} does not exist; build one with `dynvocab build-index --out {path}`")
    f = open(path, "rb")
    try:
        raw, entries = _read_header(path, f)
        bundle = Bundle(path, _parse_metadata(path, raw, entries), entries, f)
        if verify:
            bundle.verify()
    except BaseException:
        f.close()
        raise
    return bundle


def write_bundle(
    path: str | Path,
    stages: list[Stage],
    target: ModelFingerprint,
    draft: ModelFingerprint | None,
) -> Path:
    """Write ``stages`` as a bundle at ``path`` atomically (temp file in the same folder, then rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    if not path.parent.is_dir():
        raise DynvocabError(f"folder {path.parent} does not exist; create it or pick another --out")
    tensors: dict[str, torch.Tensor] = {}
    stage_meta: dict[str, dict] = {}
    for stage in stages:
        if "." in stage.name or not stage.name:
            raise ValueError(f"bad stage name {stage.name!r}")
        stage_meta[stage.name] = {"config": stage.config, "info": stage.info}
        for name, t in stage.tensors.items():
            tensors[f"{stage.name}.{name}"] = t.detach().contiguous().cpu()
    checksums = {name: tensor_sha256(t) for name, t in tensors.items()}
    for name, meta in stage_meta.items():
        meta["sha256"] = stage_sha256(name, checksums)
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "fingerprint": json.dumps({"target": target.as_dict(), "draft": draft.as_dict() if draft else None}),
        "stages": json.dumps(stage_meta),
        "checksums": json.dumps(checksums),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dynvocab_version": __version__,
    }
    return write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
