"""Vocabulary policies: the only thing that differs between strategies."""

from dynvocab.runtime.policies.base import CycleReport, VocabPolicy
from dynvocab.runtime.policies.frequency import FrequencyPolicy, PositionAwareFrequencyPolicy
from dynvocab.runtime.policies.full import FullPolicy

__all__ = [
    "CycleReport",
    "FrequencyPolicy",
    "FullPolicy",
    "PositionAwareFrequencyPolicy",
    "VocabPolicy",
]
