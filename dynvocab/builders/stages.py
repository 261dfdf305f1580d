"""The built-in stage builders, each one entry in the builders' stage registry
(:mod:`dynvocab.builders.stage_registry`): ``build-index``'s stages and, for the bench's synthetic bundle,
``train-router``'s.

Adding a stage ``build-index`` makes: its builder module under ``builders/`` (a frozen config, ``build(cfg, …)``
and a ``StageBuilder`` entry naming its :class:`~dynvocab.artifacts.stage_registry.BundleStage`) and one line
below. Import the registry's API from here, so that the built-ins are in it.
"""

from __future__ import annotations

from dynvocab.builders import clusters, freq, graph, hnsw
from dynvocab.builders.router import stage as router
from dynvocab.builders.stage_registry import (
    BIGRAMS,
    CORPUS_PASS,
    COUNTS,
    DOCUMENTS,
    DRAFT,
    NEEDS,
    TARGET,
    BuildInputs,
    Built,
    StageBuilder,
    Synthetic,
    build_stage_names,
    config_dict,
    lookup_builder,
    register,
    stage_builders,
    unregister,
)

for _entry in (freq.STAGE, clusters.STAGE, hnsw.STAGE, graph.STAGE, hnsw.DRAFT_STAGE,
               router.ROUTER_STAGE, router.CENTROIDS_STAGE, router.LOWRANK_STAGE):
    register(_entry)

__all__ = [
    "BIGRAMS",
    "CORPUS_PASS",
    "COUNTS",
    "DOCUMENTS",
    "DRAFT",
    "NEEDS",
    "TARGET",
    "BuildInputs",
    "Built",
    "StageBuilder",
    "Synthetic",
    "build_stage_names",
    "config_dict",
    "lookup_builder",
    "register",
    "stage_builders",
    "unregister",
]
