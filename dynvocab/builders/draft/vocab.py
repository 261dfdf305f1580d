"""EAGLE-3's draft vocabulary: which K target ids the head's own ``lm_head`` predicts.

The K most frequent target ids (end tokens always in), then sorted ascending: draft row i stands for the i-th
smallest kept id, and ``d2t[i] = kept[i] - i`` is an OFFSET (target id = draft id + d2t[draft id]), ``t2d`` the
bool mask of kept ids. This is how vllm-project/speculators builds it
(``src/speculators/train/vocab_mapping.py``, ``build_vocab_mappings_from_distribution``: sort by count desc then
id, keep K, ``selected_token_ids.sort()``, offsets) and how SafeAILab/EAGLE ``eagle/traineagle3/cnets.py``
(``Model.scandata``: top-N by count, ``used_tokens.sort()``, ``d2t = used_tokens - arange``) does.

The counts come from a bundle's ``freq`` stage (the same ranking FR-Spec and ``dynvocab export --format eagle3``
use) or are counted over the training documents' tokens (what both references do).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dynvocab.artifacts import FreqTable, ModelFingerprint, load_bundle
from dynvocab.artifacts.export import eagle3_mapping
from dynvocab.builders import freq as freq_stage
from dynvocab.errors import DynvocabError


def check_size(size: int, vocab: int) -> None:
    """Refuse a draft vocabulary that is empty or larger than the target's."""
    if not 1 <= size <= vocab:
        raise DynvocabError(f"--draft-vocab must be between 1 and the target's vocabulary size {vocab:,}, got {size:,}")


def from_bundle(path: str | Path, size: int, target: ModelFingerprint) -> tuple[torch.Tensor, dict]:
    """Kept target ids (ascending, LongTensor [K]) from the ``freq`` stage of the bundle at ``path``."""
    bundle = load_bundle(path, verify=True)
    bundle.require("freq")
    diffs = bundle.fingerprints["target"].differences(target) if "target" in bundle.fingerprints else []
    if diffs:
        raise DynvocabError(f"bundle {path} was built for another target ({diffs[0]}); pass its own bundle or none")
    table = FreqTable.from_bundle(bundle)
    check_size(size, int(table.ranking.numel()))
    return kept_ids(table, size), {"source": "bundle", "path": str(path), "coverage": round(table.top_k_share(size), 6)}


def from_counts(counts: np.ndarray, eos_ids: list[int], size: int) -> tuple[torch.Tensor, dict]:
    """Kept target ids (ascending, LongTensor [K]) from token counts over the training documents (int64 [V])."""
    check_size(size, int(counts.shape[0]))
    table = freq_stage.build(freq_stage.FreqConfig(), counts, eos_ids)
    return kept_ids(table, size), {"source": "training documents", "coverage": round(table.top_k_share(size), 6)}


def kept_ids(table: FreqTable, size: int) -> torch.Tensor:
    """The top ``size`` ids of the ranking in draft order (ascending): ``arange(K) + d2t``."""
    mapping = eagle3_mapping(table, size)
    return torch.arange(size, dtype=torch.long) + mapping["d2t"]  # [K]
