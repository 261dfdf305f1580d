"""How builders report progress without knowing who renders it: the names of :mod:`dynvocab.progress`, where the
reporters (rich bars, plain lines, callbacks) live."""

from dynvocab.progress import Advance, Reporter, SilentReporter

__all__ = ["Advance", "Reporter", "SilentReporter"]
