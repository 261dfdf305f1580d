"""Read FR-Spec / SGLang token maps: a ``torch.save``d list (or 1-D tensor) of token ids in frequency order."""

from __future__ import annotations

from pathlib import Path

import torch

from dynvocab.errors import DynvocabError


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """Load and validate a token map; returns a LongTensor [K] of distinct ids in ``[0, vocab_size)``."""
    path = Path(path)
    if not path.is_file():
        raise DynvocabError(f"token map {path} does not exist; build one with `dynvocab export` or pass an existing file")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DynvocabError(
            f"token map {path} is not readable by torch.load ({type(exc).__name__}); "
            "it must be a torch.save'd list or 1-D tensor of token ids"
        ) from exc
    if isinstance(raw, torch.Tensor):
        if raw.dim() != 1 or raw.dtype.is_floating_point or raw.dtype == torch.bool:
            raise DynvocabError(f"token map {path} must be a 1-D integer tensor, got shape {tuple(raw.shape)} {raw.dtype}")
        ids = raw.long()
    elif isinstance(raw, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        ids = torch.tensor(list(raw), dtype=torch.long)
    else:
        raise DynvocabError(f"token map {path} must hold a list of integer token ids")
    if ids.numel() == 0:
        raise DynvocabError(f"token map {path} is empty")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise DynvocabError(
            f"token map {path} has ids out of range [0, {vocab_size}) (e.g. {int(bad[0])}); "
            "it was built for another vocabulary"
        )
    if torch.unique(ids).numel() != ids.numel():
        raise DynvocabError(f"token map {path} repeats token ids; a token map lists distinct ids")
    return ids
