"""Model resolution and loading, shared by the builders and the runtime."""

from dynvocab.models.loading import (
    ModelSpec,
    default_device,
    default_dtype,
    load_model,
    load_tokenizer,
    parse_dtype,
    resolve_model,
)
from dynvocab.models.vocab import VocabMatch, match_vocabularies, tokenizer_fingerprint

__all__ = [
    "ModelSpec",
    "VocabMatch",
    "default_device",
    "default_dtype",
    "load_model",
    "load_tokenizer",
    "match_vocabularies",
    "parse_dtype",
    "resolve_model",
    "tokenizer_fingerprint",
]
