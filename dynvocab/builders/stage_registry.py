"""How each bundle stage is made: one :class:`StageBuilder` entry per stage, the builders' half of the stage registry.

An entry names its :class:`~dynvocab.artifacts.stage_registry.BundleStage` (what readers know of the stage), the
frozen config dataclass whose defaults are the stage's defaults, the function ``build-index`` runs to make it (None
for a stage another command makes: ``train-router``'s), what that function reads (:data:`NEEDS`), and how to make a
random stand-in of demo sizes for ``microbench policy-steps``. ``build-index`` (:mod:`dynvocab.builders.pipeline`),
its ``--stages`` option and the bench's synthetic bundle read it, so adding a stage is one builder module and one
:func:`register` call.

The built-in builders are registered by :mod:`dynvocab.builders.stages`; import the API from there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from dynvocab.artifacts import ModelFingerprint, Stage
from dynvocab.artifacts import stage_registry as kinds
from dynvocab.artifacts.stage_registry import BundleStage
from dynvocab.builders.corpus import CorpusConfig
from dynvocab.builders.counting import CorpusCounts
from dynvocab.errors import DynvocabError
from dynvocab.models import ModelSpec
from dynvocab.progress import Reporter
from dynvocab.registry import Registry

COUNTS = "counts"  # token counts of the corpus, from the one tokenization pass (BuildInputs.counts.unigrams)
BIGRAMS = "bigrams"  # bigram counts, counted in the same pass (BuildInputs.counts.bigram_keys / bigram_counts)
DOCUMENTS = "documents"  # corpus documents, read by the builder itself (iter_documents(inputs.corpus))
TARGET = "target"  # the target model: its tokenizer, head or hidden states
DRAFT = "draft"  # the draft model: its head or hidden states
NEEDS = (COUNTS, BIGRAMS, DOCUMENTS, TARGET, DRAFT)
CORPUS_PASS = (COUNTS, BIGRAMS)  # needs served by the shared tokenization pass


@dataclass
class BuildInputs:
    """What a stage's builder reads: the resolved pair, the corpus, the device, the progress reporter, and the
    counts of the shared corpus pass once it has run (the pipeline runs it before the first stage that needs it)."""

    target: ModelSpec
    draft: ModelSpec
    target_tokenizer: object
    target_fp: ModelFingerprint
    draft_fp: ModelFingerprint
    corpus: CorpusConfig
    device: str
    reporter: Reporter
    counts: CorpusCounts | None = None
    corpus_info: dict | None = None  # the corpus as the counting stages store it: sources, docs, tokens, seconds

    def spec(self, role: str) -> ModelSpec:
        """The model of ``role`` (``"target"`` or ``"draft"``)."""
        return self.target if role == TARGET else self.draft


@dataclass(frozen=True)
class Built:
    """What a builder made: the stage's tensors (names without the prefix), its statistics (logged and stored in
    its info) and other info to store (not logged)."""

    tensors: dict[str, torch.Tensor]
    stats: dict
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Synthetic:
    """What a random stand-in is made to fit: the vocabulary, the target head's stand-in rows ``rows`` [n, d]."""

    vocab: int
    rows: torch.Tensor  # [n, d]
    generator: torch.Generator

    @property
    def dim(self) -> int:
        return int(self.rows.shape[1])


@dataclass(frozen=True)
class StageBuilder:
    """How stage ``kind`` is made. ``build(inputs, config) -> Built``; ``synthetic(spec, made) -> Stage`` makes a
    random stage of demo sizes (``made``: the synthetic stages made before it, in registry order)."""

    kind: BundleStage
    config: type | None  # its frozen config dataclass (BuildConfig.config finds the instance in force)
    build: Callable[[BuildInputs, Any], Built] | None = None  # None: made by kind.made_by, not build-index
    needs: tuple[str, ...] = ()  # of NEEDS
    synthetic: Callable[[Synthetic, dict[str, Stage]], Stage] | None = None

    @property
    def name(self) -> str:
        return self.kind.name


def config_dict(config) -> dict:
    """A stage config as the bundle stores it (its ``as_dict`` where it has one)."""
    return config.as_dict() if hasattr(config, "as_dict") else asdict(config)


_REGISTRY: Registry[StageBuilder] = Registry("stage builder")
_ADDED_KINDS: set[str] = set()  # kinds registered through a builder (removed with it)


def register(entry: StageBuilder) -> StageBuilder:
    """Add a stage builder, and its kind to the stage registry when it is not there yet; returns the entry."""
    unknown = [n for n in entry.needs if n not in NEEDS]
    if unknown:
        raise ValueError(f"stage '{entry.name}' needs {', '.join(unknown)}; a builder may need {', '.join(NEEDS)}")
    if entry.build is not None and entry.config is None:
        raise ValueError(f"stage '{entry.name}' is built by build-index and so needs a config dataclass")
    _REGISTRY.check_new(entry)
    if kinds.find_stage(entry.name) is None:
        kinds.register(entry.kind)
        _ADDED_KINDS.add(entry.name)
    return _REGISTRY.register(entry)


def unregister(name: str) -> None:
    """Remove a stage builder (and its kind, when registering the builder added it); unknown names are ignored."""
    _REGISTRY.unregister(name)
    if name in _ADDED_KINDS:
        _ADDED_KINDS.discard(name)
        kinds.unregister(name)


def stage_builders() -> tuple[StageBuilder, ...]:
    """Every registered builder, in bundle order (the stage registry's)."""
    order = {name: i for i, name in enumerate(kinds.stage_names())}
    return tuple(sorted(_REGISTRY.values(), key=lambda e: order.get(e.name, len(order))))


def build_stage_names() -> tuple[str, ...]:
    """The stages ``build-index`` makes, in bundle order."""
    return tuple(e.name for e in stage_builders() if e.build is not None)


def lookup_builder(name: str) -> StageBuilder:
    """The builder of a stage ``build-index`` makes; a one-line error naming them otherwise."""
    entry = _REGISTRY.get(name)
    if entry is None or entry.build is None:
        raise DynvocabError(f"unknown stage '{name}'; use a comma-separated subset of {','.join(build_stage_names())}")
    return entry
