"""Vocabulary policies: the only thing that differs between strategies."""

from dynvocab.runtime.selection.base import CycleReport, VocabPolicy
from dynvocab.runtime.selection.frequency import FrequencyPolicy, PositionAwareFrequencyPolicy
from dynvocab.runtime.selection.full import FullPolicy

__all__ = [
    "CycleReport",
    "FrequencyPolicy",
    "FullPolicy",
    "PositionAwareFrequencyPolicy",
    "VocabPolicy",
]
