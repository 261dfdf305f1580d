"""Check that a draft and a target share a tokenizer, and find the vocabulary rows they share."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from dynvocab.errors import DynvocabError


def tokenizer_fingerprint(tokenizer) -> str:
    """A SHA-256 over the token -> id map (added tokens included); equal maps give equal fingerprints."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class VocabMatch:
    """How the two vocabularies line up: ids ``[0, shared)`` mean the same token in both models."""

    target_size: int
    draft_size: int
    tokenizer_size: int
    shared: int


def match_vocabularies(target_tokenizer, draft_tokenizer, target_rows: int, draft_rows: int) -> VocabMatch:
    """Match draft and target vocabularies; refuse a pair whose tokenizers disagree on any shared id.

    Models often pad their embedding matrices past the tokenizer (151,936 vs 152,064 rows for the same
    Qwen tokenizer); those padding rows carry no token, so the draft may only propose ids below both sizes.
    """
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    t_by_id = {i: tok for tok, i in t_vocab.items()}
    d_by_id = {i: tok for tok, i in d_vocab.items()}
    common = set(t_by_id) & set(d_by_id)
    disagree = [i for i in common if t_by_id[i] != d_by_id[i]]
    missing = len(set(t_by_id) ^ set(d_by_id))
    if disagree or missing > 0.01 * max(len(t_by_id), 1):
        raise DynvocabError(
            f"draft and target tokenizers do not match ({len(disagree)} ids disagree, {missing} ids only in one); "
            "pick a draft from the same model family as the target"
        )
    tokenizer_size = max(max(t_by_id, default=-1), max(d_by_id, default=-1)) + 1
    shared = min(target_rows, draft_rows)
    if shared < min(len(t_by_id), len(d_by_id)) * 0.99:
        raise DynvocabError(
            f"draft vocabulary ({draft_rows} rows) and target vocabulary ({target_rows} rows) cannot be matched; "
            "pick a draft from the same model family as the target"
        )
    return VocabMatch(target_rows, draft_rows, tokenizer_size, shared)


END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


def end_token_ids(tokenizer, *eos_values) -> set[int]:
    """EOS ids: the tokenizer's, any given (int or list, e.g. a generation config's), and known end-of-turn tokens."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, *eos_values):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN if t in vocab)
    return ids
