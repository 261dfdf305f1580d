"""``train-draft``'s configuration: how the head is trained (:class:`OptimConfig`), everything the run needs
besides the target and the output folder (:class:`TrainDraftConfig`), its one-line refusals, and what it reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dynvocab.builders.corpus import CorpusConfig, check_sources
from dynvocab.builders.draft import distill
from dynvocab.builders.draft import features as feats
from dynvocab.budget import FR_SIZE
from dynvocab.errors import DynvocabError
from dynvocab.models.eagle import EAGLE1, EAGLE3
from dynvocab.models.eagle.layouts import KIND_LABELS, families, layout_for

ARCHS = {"eagle1": EAGLE1, "eagle3": EAGLE3}
EVAL_NAMES = ("sharegpt-eval", "sharegpt:eval", "sharegpt_eval", "sharegpt:test", "eval")


@dataclass(frozen=True)
class OptimConfig:
    """How the head is trained. Defaults are sized for the 45-minute CPU budget (docs/train-draft.md)."""

    epochs: int = 1
    lr: float = 3e-4  # AdamW peak; linear warm-up then cosine decay to 10%
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.5  # EAGLE main.py: grad_clip 0.5
    ttt_steps: int | None = None  # chained steps per document; None: 1 for EAGLE-1 (paper), 3 for EAGLE-3
    feature_noise: float | None = None  # uniform noise width on input features; None: 0.2 EAGLE-1, 0 EAGLE-3
    holdout_every: int = 10  # every n-th training document is held out for the agreement report
    eval_docs: int = 24  # held-out documents scored at each evaluation
    eval_every: int = 100  # steps between held-out evaluations (and the progress bar's agreement)
    checkpoint_every: int = 25  # steps between checkpoints
    seed: int = 0
    batch_docs: int = 1  # documents per optimizer step, over all ranks together (the global batch)
    micro_docs: int = 8  # documents per forward pass on one rank (speed and memory only: not part of the recipe)
    negatives: int = 4096  # EAGLE-1: uniformly sampled ids its sampled cross-entropy scores beside the target's
    # cached top-k (recipe.candidate_rows), drawn anew each step; 0: the whole head at every position

    def steps_for(self, kind: str) -> int:
        """Chained training-time-test steps per document for a head of ``kind``."""
        return self.ttt_steps if self.ttt_steps is not None else (1 if kind == EAGLE1 else 3)

    def noise_for(self, kind: str) -> float:
        """The uniform noise width on a head of ``kind``'s input features."""
        return self.feature_noise if self.feature_noise is not None else (0.2 if kind == EAGLE1 else 0.0)

    def held_out(self, doc_id: int) -> bool:
        """Whether document ``doc_id`` is held out of training (every ``holdout_every``-th)."""
        return doc_id % self.holdout_every == self.holdout_every - 1


@dataclass(frozen=True)
class TrainDraftConfig:
    """Everything ``train-draft`` needs besides the target and the output folder."""

    arch: str = "eagle3"
    draft_vocab: int = FR_SIZE  # EAGLE-3 only: lm_head rows (FR-Spec's and the export's K)
    bundle: str | None = None  # a bundle whose freq stage gives the draft vocabulary (else: counted from the data)
    corpus: CorpusConfig = field(default_factory=lambda: CorpusConfig(max_docs=128))  # ~30k tokens: see docs/train-draft.md
    features: feats.FeatureConfig = field(default_factory=feats.FeatureConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    layout: str = "eagle"  # a layout family: eagle (the EAGLE repo's layout of its kind), speculators (EAGLE-3)
    device: str | None = None
    features_dir: str | None = None  # the feature cache (default OUT/work/features); heads may share one
    extra_features: tuple[str, ...] = ()  # finished caches of earlier runs for the same target, trained on beside this one
    distill: distill.DistillConfig | None = None  # train on the target's own continuations of the corpus's prompts
    save_dtype: str | None = None  # the head's weights on disk (None: float32, as trained; bfloat16 halves them)
    train_dtype: str | None = None  # the matmuls' dtype in training (autocast); None: the device's default dtype
    init_from: str | None = None  # continue training this head (a folder or a demo name) instead of starting from the target
    features_only: bool = False  # build (or resume) the feature cache and stop: a cache for other runs, no head

    @property
    def kind(self) -> str:
        """The head's kind (:data:`EAGLE1` or :data:`EAGLE3`) of ``arch``."""
        return ARCHS[self.arch]


@dataclass(frozen=True)
class TrainDraftReport:
    """What ``train-draft`` did (also written as ``OUT/training.json``); with ``features_only``, the cache it left."""

    path: Path  # the head's folder, or the feature cache's with features_only
    info: dict


def check_config(cfg: TrainDraftConfig) -> None:
    """One-line refusals before any model is loaded: unknown arch/format, the evaluation split, empty corpus, an
    ``--init-from`` that is no EAGLE head of the arch's kind."""
    if cfg.arch not in ARCHS:
        raise DynvocabError(f"unknown --arch '{cfg.arch}'; use eagle3 or eagle1")
    _check_layout(cfg)
    evals = [s for s in cfg.corpus.sources if s.lower() in EVAL_NAMES]
    if evals:
        raise DynvocabError(
            f"corpus '{evals[0]}' is the ShareGPT evaluation split, reserved for bench; train on sharegpt (its training split)"
        )
    check_sources(cfg.corpus)
    o = cfg.optim
    for flag, value, low in (("--epochs", o.epochs, 1), ("--max-tokens", cfg.features.max_tokens, 2),
                             ("--batch-docs", o.batch_docs, 1), ("--micro-docs", o.micro_docs, 1),
                             ("--feature-batch", cfg.features.batch_docs or 1, 1)):
        if value < low:
            raise DynvocabError(f"{flag} must be at least {low}, got {value}")
    if not o.lr > 0:
        raise DynvocabError(f"--lr must be positive, got {o.lr}")
    if cfg.save_dtype not in (None, "float32", "bfloat16", "float16"):
        raise DynvocabError(f"unknown --save-dtype '{cfg.save_dtype}'; use float32, bfloat16 or float16")
    if cfg.train_dtype not in (None, "float32", "bfloat16"):
        raise DynvocabError(f"unknown --train-dtype '{cfg.train_dtype}'; use float32 or bfloat16")
    if o.negatives < 0:
        raise DynvocabError(f"--negatives must be 0 (the whole head) or positive, got {o.negatives}")
    if cfg.distill is not None:
        cfg.distill.check()
        if cfg.features.max_tokens <= cfg.distill.prompt_tokens:
            raise DynvocabError(
                f"--max-tokens {cfg.features.max_tokens} would cut the target's answers after prompts of up to "
                f"{cfg.distill.prompt_tokens} tokens; pass --max-tokens of at least --distill-prompt-tokens + "
                f"--distill-new-tokens ({cfg.distill.prompt_tokens + cfg.distill.new_tokens})"
            )
    if cfg.features_only and cfg.extra_features:
        raise DynvocabError("--features-only trains nothing, so --extra-features has nothing to join; pass one or the other")
    for folder in cfg.extra_features:
        if not Path(folder).is_dir():
            raise DynvocabError(f"--extra-features {folder} is no folder; pass the --features folder of a finished run")
        if cfg.features_dir is not None and Path(folder).resolve() == Path(cfg.features_dir).resolve():
            raise DynvocabError(f"--extra-features {folder} is this run's own --features folder; pass another run's")
        feats.extra_manifest(Path(folder), cfg.features.topk)
    if cfg.init_from is not None:
        from dynvocab.builders.draft.init import check_init_head

        check_init_head(cfg.init_from, cfg.kind)


def _check_layout(cfg: TrainDraftConfig) -> None:
    """Refuse a ``--format`` that is no registered layout family, or a family without a layout of the arch's kind."""
    if cfg.layout not in families():
        raise DynvocabError(f"unknown --format '{cfg.layout}'; use {' or '.join(families())}")
    if layout_for(cfg.layout, cfg.kind) is None:
        held = [kind for kind in KIND_LABELS if layout_for(cfg.layout, kind) is not None]
        archs = " or ".join(arch for arch, kind in ARCHS.items() if kind in held)
        others = " or ".join(f for f in families() if layout_for(f, cfg.kind) is not None)
        raise DynvocabError(
            f"--format {cfg.layout} holds {' and '.join(KIND_LABELS[k] for k in held)} heads; "
            f"use --arch {archs} or --format {others}"
        )
