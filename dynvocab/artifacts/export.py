"""Export the frequency ranking in the formats other systems read.

- ``sglang``: SGLang's ``--speculative-token-map`` / FR-Spec token map, a ``torch.save``d Python list of K
  distinct token ids, most frequent first (end tokens always inside).
- ``eagle3``: EAGLE-3 / vLLM / SpecForge draft-vocabulary mapping, a ``torch.save``d dict with
  ``d2t`` (int64 [K]: the kept target ids sorted ascending, minus their draft index, so
  ``target_id = draft_index + d2t[draft_index]``) and ``t2d`` (bool [V]: which target ids are kept).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dynvocab.artifacts.tables import FreqTable
from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic

FORMATS = ("sglang", "eagle3")
DEFAULT_EXPORT_SIZE = 32768  # FR-Spec's K


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


def export_freq(freq: FreqTable, fmt: str, size: int):
    """The object to save for format ``fmt`` (``sglang`` or ``eagle3``)."""
    if fmt == "sglang":
        return sglang_token_map(freq, size)
    if fmt == "eagle3":
        return eagle3_mapping(freq, size)
    raise DynvocabError(f"unknown export format '{fmt}'; use one of {', '.join(FORMATS)}")


def save_torch_atomic(obj, path: str | Path) -> Path:
    """``torch.save`` to a temp file in the same folder, then rename: never a half-written file."""
    path = Path(path)
    if not path.parent.is_dir():
        raise DynvocabError(f"folder {path.parent} does not exist; create it or pick another --out")
    return write_atomic(path, lambda tmp: torch.save(obj, tmp))
