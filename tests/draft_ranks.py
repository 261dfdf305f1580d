"""One rank of a ``train-draft`` run under ``torchrun`` (tests/test_train_draft.py launches it).

``python -m torch.distributed.run --nproc_per_node N tests/draft_ranks.py SPEC.json``; SPEC holds the target, the
output folder and the config's fields. With ``"die_after_checkpoint": true`` rank 0 kills itself (SIGKILL) right
after its first checkpoint is written, as a crashed machine would, and torchrun ends the other ranks.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

from dynvocab.builders.corpus import CorpusConfig
from dynvocab.builders.draft import OptimConfig, TrainDraftConfig, trainer, training
from dynvocab.builders.draft.features import FeatureConfig


def config(spec: dict) -> TrainDraftConfig:
    return TrainDraftConfig(
        arch=spec["arch"], draft_vocab=spec["draft_vocab"], device="cpu", features_dir=spec.get("features_dir"),
        corpus=CorpusConfig(sources=tuple(spec["corpus"]), max_docs=spec["max_docs"]),
        features=FeatureConfig(**spec["features"]), optim=OptimConfig(**spec["optim"]), train_dtype="float32",
    )


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(1)
    if spec.get("die_after_checkpoint"):
        real = training._checkpoint

        def checkpoint_then_die(*args, **kwargs):
            real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        training._checkpoint = checkpoint_then_die
    trainer.train_draft(spec["target"], spec["out"], config(spec))


if __name__ == "__main__":
    main()
