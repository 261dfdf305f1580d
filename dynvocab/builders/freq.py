"""Stage ``freq``: FR-Spec token frequencies and their ranking."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from dynvocab.artifacts import FreqTable, Stage
from dynvocab.artifacts.stages import FREQ
from dynvocab.artifacts.tables import COVERAGE_SIZES
from dynvocab.builders.models import end_token_ids
from dynvocab.builders.stage_registry import COUNTS, TARGET, BuildInputs, Built, StageBuilder, Synthetic


@dataclass(frozen=True)
class FreqConfig:
    """FR-Spec ranking: tokens sorted by corpus count, end tokens forced to the front."""

    share_sizes: tuple[int, ...] = COVERAGE_SIZES  # top-K sizes whose corpus share is reported

    def as_dict(self) -> dict:
        """The config as bundles store it (``share_sizes`` under its stored name, ``coverage_sizes``)."""
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        out["coverage_sizes"] = out.pop("share_sizes")
        return out


def build(cfg: FreqConfig, counts: np.ndarray, eos_ids: list[int]) -> FreqTable:
    """Rank all ids by count (descending, ties by id) after the end tokens, which any top-K must contain.

    ``counts`` is int64 [V]; the ranking is a permutation of ``[0, V)``, so every K up to V can be exported.
    """
    vocab = counts.shape[0]
    eos = np.array(sorted({int(i) for i in eos_ids if 0 <= int(i) < vocab}), dtype=np.int64)  # [E]
    order = np.lexsort((np.arange(vocab), -counts))  # by count desc, then id
    rest = order[~np.isin(order, eos)]
    ranking = np.concatenate([eos, rest])  # [V]
    return FreqTable(
        counts=torch.from_numpy(counts.astype(np.int64)),
        ranking=torch.from_numpy(ranking),
        eos_ids=torch.from_numpy(eos),
    )


def summary(cfg: FreqConfig, table: FreqTable, groups: dict[str, np.ndarray] | None = None) -> dict:
    """Statistics stored with the stage: total tokens, distinct ids seen, and the corpus share of each top-K
    (stored under ``coverage``, the bundle's key for it); with several corpus ``groups`` (files, or a corpus's
    languages), the share of the largest top-K in each group's own tokens, under ``top_<K>_share_by_group``."""
    out = {
        "total_tokens": int(table.counts.sum()),
        "distinct_tokens": int((table.counts > 0).sum()),
        "coverage": {str(k): round(table.top_k_share(k), 6) for k in cfg.share_sizes},
    }
    if groups and len(groups) > 1:
        k = max(cfg.share_sizes)
        out[f"top_{k}_share_by_group"] = group_shares(table.ranking[:k].numpy(), groups)
    return out


def group_shares(kept: np.ndarray, groups: dict[str, np.ndarray]) -> dict[str, float]:
    """The share of each group's tokens whose id is in ``kept`` [K]: how well one static set serves each part of
    the corpus it was built from (a language, a file)."""
    out = {}
    for name, counts in groups.items():
        total = int(counts.sum())
        out[name] = round(float(counts[kept].sum()) / total, 6) if total else 0.0
    return out


def _build_stage(inputs: BuildInputs, cfg: FreqConfig) -> Built:
    table = build(cfg, inputs.counts.unigrams, end_token_ids(inputs.target, inputs.target_tokenizer))
    return Built(table.to_tensors(), summary(cfg, table, inputs.counts.groups), {"corpus": inputs.corpus_info})


def _synthetic(spec: Synthetic, made: dict) -> Stage:
    """A random ranking with counts falling along it; the last id is the end token."""
    ranking = torch.randperm(spec.vocab, generator=spec.generator)  # [V]
    counts = torch.empty(spec.vocab, dtype=torch.long)
    counts[ranking] = torch.arange(spec.vocab, 0, -1)
    return Stage(FREQ.name, {"counts": counts, "ranking": ranking, "eos_ids": torch.tensor([spec.vocab - 1])}, {})


STAGE = StageBuilder(FREQ, FreqConfig, _build_stage, needs=(COUNTS, TARGET), synthetic=_synthetic)
