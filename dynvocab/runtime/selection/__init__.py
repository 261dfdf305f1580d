"""One selection package: each strategy's selector (one for dynvocab's loop, its tree depths and a batched host such
as the vLLM plugin), the loop's context policies, and what they share."""

from dynvocab.runtime.selection.base import CycleReport, FullPolicy, SelectorPolicy, VocabPolicy

__all__ = ["CycleReport", "FullPolicy", "SelectorPolicy", "VocabPolicy"]
