"""The built-in bundle stages, each one entry in the stage registry (:mod:`dynvocab.artifacts.stage_registry`),
registered in bundle order.

Adding a stage: its table (a frozen dataclass with ``to_tensors`` and ``from_bundle``) in an ``artifacts`` module
when the runtime reads it, one ``register(BundleStage(…))`` call here, and its builder in ``builders/`` with one
entry in :mod:`dynvocab.builders.stages`. Import the registry's API from here, so that the built-ins are in it.
"""

from __future__ import annotations

from dynvocab.artifacts.bundle import Bundle
from dynvocab.artifacts.router import RouterTable
from dynvocab.artifacts.selectors import CENTROIDS as CENTROIDS_NAME
from dynvocab.artifacts.selectors import LOWRANK as LOWRANK_NAME
from dynvocab.artifacts.selectors import SelectorTable
from dynvocab.artifacts.stage_registry import (
    BUILD_INDEX,
    TRAIN_ROUTER,
    BundleStage,
    Maker,
    adding_commands,
    find_stage,
    read_stage,
    register,
    remake_command,
    stage_kinds,
    stage_names,
    unregister,
)
from dynvocab.artifacts.tables import COVERAGE_SIZES, ClusterTable, FreqTable, GraphTable


def _coverage(bundle: Bundle) -> dict:
    """The corpus share of each top-K the stage was built to report (``coverage_sizes``, as stored)."""
    table = FreqTable.from_bundle(bundle)
    sizes = bundle.config("freq").get("coverage_sizes", COVERAGE_SIZES)
    return {"coverage": {str(k): round(table.top_k_share(int(k)), 6) for k in sizes}}


def _coverage_line(entry: dict) -> str:
    corpus = entry["info"].get("corpus", {})
    shares = " · ".join(f"top-{int(k):,} {v:.2%}" for k, v in entry["coverage"].items())
    sources = ", ".join(corpus.get("sources", []))
    return f"freq coverage of {corpus.get('tokens', 0):,} corpus tokens ({sources}): {shares}"


FREQ = register(BundleStage("freq", "FR-Spec's ranking of the target's ids by corpus count",
                            table=FreqTable.from_bundle, describe=_coverage, headline=_coverage_line))
CLUSTERS = register(BundleStage("clusters", "DynaSpec's k-means clusters of the draft head's rows",
                                table=ClusterTable.from_bundle))
HNSW = register(BundleStage("hnsw", "an HNSW index over the target head's rows (EvoSpec's retrieval; "
                                    "read with load_hnsw, which needs the head)"))
GRAPH = register(BundleStage("graph", "EvoSpec's bigram successor graph", table=GraphTable.from_bundle))
DRAFT_HNSW = register(BundleStage("draft_hnsw", "an HNSW index over the draft head's rows (the hybrid's per-step "
                                                "retrieval; read with load_hnsw)"))
ROUTER = register(BundleStage("router", "DynaSpec's cluster router", made_by=TRAIN_ROUTER, made_from=("clusters",),
                              table=RouterTable.from_bundle))
CENTROIDS = register(BundleStage(CENTROIDS_NAME, "centroid blocks of the draft's vocabulary (Gemma-4's selector)",
                                 made_by=TRAIN_ROUTER, table=lambda b: SelectorTable.from_bundle(b, CENTROIDS_NAME)))
LOWRANK = register(BundleStage(LOWRANK_NAME, "a low-rank scorer of every draft id (SpecVocab's selector)",
                               made_by=TRAIN_ROUTER, table=lambda b: SelectorTable.from_bundle(b, LOWRANK_NAME)))

__all__ = [
    "BUILD_INDEX",
    "CENTROIDS",
    "CLUSTERS",
    "DRAFT_HNSW",
    "FREQ",
    "GRAPH",
    "HNSW",
    "LOWRANK",
    "ROUTER",
    "TRAIN_ROUTER",
    "BundleStage",
    "Maker",
    "adding_commands",
    "find_stage",
    "read_stage",
    "register",
    "remake_command",
    "stage_kinds",
    "stage_names",
    "unregister",
]
