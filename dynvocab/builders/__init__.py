"""Offline builders: one module per bundle stage, each a frozen config plus ``build(cfg, …)``.

``freq`` (FR-Spec ranking), ``clusters`` (DynaSpec k-means), ``hnsw`` (EvoSpec MIPS index), ``graph``
(EvoSpec bigram successors); :mod:`dynvocab.builders.pipeline` runs them into a bundle. Builders never
import the runtime; both meet in :mod:`dynvocab.artifacts`.
"""
