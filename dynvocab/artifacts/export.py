"""Export a bundle in the formats other systems read: one table, :data:`FORMATS`, name -> writer.

- ``sglang``: SGLang's ``--speculative-token-map`` / FR-Spec token map, a ``torch.save``d Python list of K
  distinct token ids, most frequent first (end tokens always inside).
- ``eagle3``: EAGLE-3 / vLLM / SpecForge draft-vocabulary mapping, a ``torch.save``d dict with
  ``d2t`` (int64 [K]: the kept target ids sorted ascending, minus their draft index, so
  ``target_id = draft_index + d2t[draft_index]``) and ``t2d`` (bool [V]: which target ids are kept).

Formats written above this floor come from installed packages, through entry points in the :data:`ENTRY_POINTS`
group, loaded the first time the formats are read (:func:`formats`, :func:`lookup_format`): dynvocab's own ``vllm``
(a draft folder vLLM loads as it is, whose head runs a dynvocab selector) is declared by
:mod:`dynvocab.serving.vllm.folder`, so nothing here imports a serving adapter.

Adding a format is one writer and one :func:`register` call (or one entry point).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import torch

from dynvocab.artifacts.tables import FreqTable
from dynvocab.budget import FR_SIZE
from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic
from dynvocab.registry import Registry, load_plugins

ENTRY_POINTS = "dynvocab.export_formats"  # the entry-point group of formats that installed packages bring


def _check_size(freq: FreqTable, size: int) -> None:
    vocab = int(freq.ranking.numel())
    if not 1 <= size <= vocab:
        raise DynvocabError(f"--size must be between 1 and the vocabulary size {vocab}, got {size}")
    if size < freq.eos_ids.numel():
        raise DynvocabError(f"--size {size} is smaller than the {freq.eos_ids.numel()} end tokens it must include")


def sglang_token_map(freq: FreqTable, size: int) -> list[int]:
    """The top ``size`` token ids as a Python list, in frequency order (end tokens included)."""
    _check_size(freq, size)
    return [int(i) for i in freq.top(size)]


def eagle3_mapping(freq: FreqTable, size: int) -> dict[str, torch.Tensor]:
    """EAGLE-3's ``{"d2t": int64 [size], "t2d": bool [V]}`` for the top ``size`` ids."""
    _check_size(freq, size)
    kept = torch.sort(freq.top(size)).values  # [size], ascending target ids = draft order
    d2t = kept - torch.arange(size, dtype=torch.int64)  # [size]
    t2d = torch.zeros(freq.ranking.numel(), dtype=torch.bool)  # [V]
    t2d[kept] = True
    return {"d2t": d2t, "t2d": t2d}


def save_torch_atomic(obj, path: str | Path) -> Path:
    """``torch.save`` to a temp file in the same folder, then rename: never a half-written file."""
    path = Path(path)
    if not path.parent.is_dir():
        raise DynvocabError(f"folder {path.parent} does not exist; create it or pick another --out")
    return write_atomic(path, lambda tmp: torch.save(obj, tmp))


@dataclass(frozen=True)
class ExportRequest:
    """What ``dynvocab export`` was given besides the bundle and ``--out``; each format reads the fields it takes."""

    size: int | None = None  # sglang, eagle3: ids K (None: FR-Spec's, budget.FR_SIZE)
    strategy: str | None = None  # vllm: the selector the draft's head runs
    draft: str | None = None  # vllm: the draft folder (or demo:draft)
    budget: int | None = None  # vllm: the selector's size (None: the bundle's default)
    copy: bool = False  # vllm: copy the draft's files instead of linking them
    gamma: int | None = None  # vllm: num_speculative_tokens in the speculative_config it prints (None: not printed)
    schedule: str | None = None  # vllm: a batch-size schedule, START:K,… or a `bench --vllm --schedule` JSON


@dataclass(frozen=True)
class Exported:
    """What a writer wrote: the path and a short description for the CLI's one line."""

    path: Path
    summary: str  # e.g. "sglang, 32,768 ids"
    notes: tuple[str, ...] = ()  # lines the CLI prints after its one line (what to pass the reader)


@dataclass(frozen=True)
class ExportFormat:
    """One export format: its writer ``(bundle, out, request) -> Exported``, the request fields it takes (and
    needs), whether ``out`` is a folder, and one line for ``--help``."""

    name: str
    write: Callable[[Path, Path, ExportRequest], Exported]
    help: str
    takes: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    folder: bool = False


FORMATS: Registry[ExportFormat] = Registry("export format")  # a read-only mapping name -> format
register = FORMATS.register  # add an export format (refuses a name already registered); returns it


def formats() -> Registry[ExportFormat]:
    """Every export format: the built-ins and those the installed packages declare (loaded on the first call)."""
    load_plugins(ENTRY_POINTS, register, ExportFormat)
    return FORMATS


def lookup_format(name: str) -> ExportFormat:
    """The format ``name``; a one-line error naming the formats otherwise."""
    return formats().lookup(name)


def check_request(fmt: ExportFormat, request: ExportRequest) -> None:
    """Refuse, in one line, an option the format does not take or a needed one left out."""
    default = ExportRequest()
    for f in fields(ExportRequest):
        given = getattr(request, f.name) != getattr(default, f.name)
        if given and f.name not in fmt.takes:
            raise DynvocabError(f"--{f.name} does not apply to --format {fmt.name}")
        if not given and f.name in fmt.needs:
            raise DynvocabError(f"--format {fmt.name} needs --{f.name}")


def export_bundle(bundle: str | Path, out: str | Path, fmt: str, request: ExportRequest = ExportRequest()) -> Exported:
    """Write ``bundle`` as format ``fmt`` to ``out``; unknown formats and misplaced options are one line."""
    writer = lookup_format(fmt)
    check_request(writer, request)
    return writer.write(Path(bundle), Path(out), request)


def _freq_writer(name: str, make: Callable[[FreqTable, int], object]):
    def write(bundle: Path, out: Path, request: ExportRequest) -> Exported:
        from dynvocab.artifacts.bundle import load_bundle
        from dynvocab.artifacts.stages import FREQ, read_stage

        size = FR_SIZE if request.size is None else request.size
        with load_bundle(bundle, verify=True) as opened:
            obj = make(read_stage(opened, FREQ.name), size)
        return Exported(save_torch_atomic(obj, out), f"{name}, {size:,} ids")

    return write


register(ExportFormat("sglang", _freq_writer("sglang", sglang_token_map),
                      "a list of token ids (FR-Spec / SGLang --speculative-token-map)", takes=("size",)))
register(ExportFormat("eagle3", _freq_writer("eagle3", eagle3_mapping),
                      "EAGLE-3's {d2t, t2d} draft-vocabulary map", takes=("size",)))
