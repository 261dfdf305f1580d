"""One pass over the corpus: tokenize in batches and count unigrams (freq) and bigrams (graph) together.

Both stages read the same token stream, so the corpus is tokenized once. Bigrams never cross a document
boundary. Bigram counts are kept as sorted unique keys ``u * V + v`` with counts, compacted whenever the
buffer of new keys grows past ``flush_at``; memory stays proportional to the number of distinct bigrams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from dynvocab.errors import DynvocabError
from dynvocab.progress import Advance


@dataclass(frozen=True)
class CorpusCounts:
    """Counts over a tokenized corpus."""

    docs: int
    tokens: int
    unigrams: np.ndarray  # [V] int64, occurrences of each token id
    bigram_keys: np.ndarray | None  # [P] int64, sorted unique u * V + v (None when not counted)
    bigram_counts: np.ndarray | None  # [P] int64
    groups: dict[str, np.ndarray] | None = None  # group -> [V] int64 unigrams of its documents (labelled input)


MAX_GROUPS = 32  # groups counted apart; documents of later groups are counted under OTHER_GROUP
OTHER_GROUP = "other"


class BigramCounter:
    """Accumulates within-document bigram counts for a vocabulary of ``vocab`` ids."""

    def __init__(self, vocab: int, flush_at: int = 1 << 23):
        self.vocab = vocab
        self.flush_at = flush_at
        self.keys = np.zeros(0, dtype=np.int64)  # [P] sorted unique
        self.counts = np.zeros(0, dtype=np.int64)  # [P]
        self._pending: list[np.ndarray] = []
        self._pending_n = 0

    def add(self, ids: np.ndarray) -> None:
        """Count the bigrams of one document's ids [T]."""
        if ids.size < 2:
            return
        keys = ids[:-1] * self.vocab + ids[1:]  # [T - 1]
        self._pending.append(keys)
        self._pending_n += keys.size
        if self._pending_n >= self.flush_at:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        new_keys, new_counts = np.unique(np.concatenate(self._pending), return_counts=True)
        self._pending, self._pending_n = [], 0
        keys = np.concatenate([self.keys, new_keys])
        counts = np.concatenate([self.counts, new_counts.astype(np.int64)])
        order = np.argsort(keys, kind="stable")
        keys, counts = keys[order], counts[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        self.keys, self.counts = keys[starts], np.add.reduceat(counts, starts) if keys.size else counts

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """``(keys [P], counts [P])``: sorted unique bigram keys ``u * V + v`` and their counts."""
        self._flush()
        return self.keys, self.counts


def token_batches(texts: Iterable[str], tokenizer, batch_docs: int = 64) -> Iterator[list[np.ndarray]]:
    """Tokenize documents in batches with the (fast) tokenizer; yields lists of int64 id arrays [T]."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == batch_docs:
            yield _encode(tokenizer, batch)
            batch = []
    if batch:
        yield _encode(tokenizer, batch)


def _encode(tokenizer, batch: list[str]) -> list[np.ndarray]:
    enc = tokenizer(batch, add_special_tokens=False, return_attention_mask=False, verbose=False)
    return [np.asarray(ids, dtype=np.int64) for ids in enc["input_ids"]]


def count_corpus(
    texts: Iterable[str] | Iterable[tuple[str, str]],
    tokenizer,
    vocab_rows: int,
    bigrams: bool,
    advance: Advance = lambda n: None,
    batch_docs: int = 64,
    labelled: bool = False,
) -> CorpusCounts:
    """Tokenize ``texts`` and count unigrams (and bigrams when ``bigrams``) over ids ``[0, vocab_rows)``.

    With ``labelled``, ``texts`` are ``(group, text)`` pairs and each group's unigrams are also counted apart
    (at most :data:`MAX_GROUPS` groups by name; the rest together), so a ranking's share can be told per group.
    """
    unigrams = np.zeros(vocab_rows, dtype=np.int64)
    counter = BigramCounter(vocab_rows) if bigrams else None
    groups: dict[str, np.ndarray] | None = {} if labelled else None
    labels: list[str] = []
    if labelled:
        texts = _labels_aside(texts, labels)
    docs = tokens = 0
    for batch in token_batches(texts, tokenizer, batch_docs):
        flat = np.concatenate(batch) if batch else np.zeros(0, dtype=np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= vocab_rows):
            raise DynvocabError(
                f"the tokenizer produced id {int(flat.max())} outside the LM head's {vocab_rows} rows; "
                "the tokenizer does not belong to this model"
            )
        unigrams += np.bincount(flat, minlength=vocab_rows)
        if counter is not None:
            for ids in batch:
                counter.add(ids)
        if groups is not None:
            for label, ids in zip(labels[: len(batch)], batch):  # the batch's texts were read last
                name = label if label in groups or len(groups) < MAX_GROUPS else OTHER_GROUP
                groups.setdefault(name, np.zeros(vocab_rows, dtype=np.int64))
                groups[name] += np.bincount(ids, minlength=vocab_rows)
            del labels[: len(batch)]
        docs += len(batch)
        tokens += int(flat.size)
        advance(len(batch))
    if docs == 0:
        raise DynvocabError("the corpus has no documents; check --corpus and --max-docs")
    keys, counts = counter.result() if counter is not None else (None, None)
    return CorpusCounts(docs, tokens, unigrams, keys, counts, groups)


def _labels_aside(pairs: Iterable[tuple[str, str]], labels: list[str]) -> Iterator[str]:
    """The texts of ``(group, text)`` pairs, appending each group to ``labels`` as its text is read."""
    for group, text in pairs:
        labels.append(group)
        yield text
