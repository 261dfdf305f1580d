"""The full draft head: speculative decoding without vocabulary pruning."""

from dynvocab.runtime.heads.active_set import ActiveSet
from dynvocab.runtime.selection.base import VocabPolicy


class FullPolicy(VocabPolicy):
    """Every draft step uses the whole (shared) vocabulary."""

    name = "full"

    def __init__(self, vocab_size: int):
        self.all = ActiveSet.full(vocab_size)

    def active_ids(self, step: int, hidden=None, token=None) -> ActiveSet:
        """Always the full vocabulary."""
        return self.all
