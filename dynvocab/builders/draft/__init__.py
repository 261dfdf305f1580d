"""``train-draft``: an EAGLE draft head for a target, built offline in two resumable phases.

- :mod:`.features`: the target's features over the training documents, cached in shards (phase 1).
- :mod:`.vocab`: EAGLE-3's draft vocabulary (``d2t`` offsets / ``t2d``) from a bundle or the training data.
- :mod:`.init`: an EAGLE-3 head started from its target where the shapes allow.
- :mod:`.recipe`: the EAGLE-1 and EAGLE-3 losses and the training-time-test unroll (phase 2).
- :mod:`.config`: the run's frozen configs and their one-line refusals.
- :mod:`.head`: the head to train: its shape from the target, EAGLE-3's draft vocabulary, its start.
- :mod:`.training`: phase 2 — the optimizer steps, checkpoints, held-out agreement.
- :mod:`.trainer`: the two phases in order, and the output folder (the head in a registered layout).
- :mod:`.ranks`: one process, or the ranks of a ``torchrun`` launch (who computes, who writes).
"""

from dynvocab.builders.draft.config import OptimConfig, TrainDraftConfig, TrainDraftReport
from dynvocab.builders.draft.trainer import train_draft

__all__ = ["OptimConfig", "TrainDraftConfig", "TrainDraftReport", "train_draft"]
