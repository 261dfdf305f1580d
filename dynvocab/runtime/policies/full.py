"""The full draft head: speculative decoding without vocabulary pruning."""

from dynvocab.runtime.policies.base import VocabPolicy


class FullPolicy(VocabPolicy):
    """Every draft step uses the whole (shared) vocabulary."""

    name = "full"

    def active_ids(self, step: int, hidden=None, token=None):
        """Always the full vocabulary."""
        return None
