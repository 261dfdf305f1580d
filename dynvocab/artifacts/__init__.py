"""The bundle: the one place where builders and runtime meet (read, write, validate, export)."""

from dynvocab.artifacts.bundle import FORMAT_VERSION, Bundle, Stage, load_bundle, write_bundle
from dynvocab.artifacts.export import (
    FORMATS,
    ExportRequest,
    eagle3_mapping,
    export_bundle,
    formats,
    save_torch_atomic,
    sglang_token_map,
)
from dynvocab.artifacts.fingerprint import ModelFingerprint
from dynvocab.artifacts.hnsw import (
    HnswParams,
    StoredIndex,
    augment_queries,
    augment_rows,
    load_hnsw,
    mips_search,
)
from dynvocab.artifacts.stages import BundleStage, find_stage, read_stage, stage_names
from dynvocab.artifacts.tables import ClusterTable, FreqTable, GraphTable

__all__ = [
    "FORMATS",
    "FORMAT_VERSION",
    "Bundle",
    "BundleStage",
    "ExportRequest",
    "ClusterTable",
    "FreqTable",
    "GraphTable",
    "HnswParams",
    "ModelFingerprint",
    "Stage",
    "StoredIndex",
    "augment_queries",
    "augment_rows",
    "eagle3_mapping",
    "export_bundle",
    "find_stage",
    "formats",
    "load_bundle",
    "load_hnsw",
    "mips_search",
    "read_stage",
    "save_torch_atomic",
    "sglang_token_map",
    "stage_names",
    "write_bundle",
]
