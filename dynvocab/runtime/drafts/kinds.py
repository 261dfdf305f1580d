"""The built-in draft kinds, each one entry in the draft registry (:mod:`dynvocab.runtime.drafts.registry`), and
those installed packages bring (entry points in the :data:`ENTRY_POINTS` group, :func:`dynvocab.registry.load_plugins`).

Adding a kind: its proposer (:class:`~dynvocab.runtime.drafts.draft.Proposer`), a loader and a recogniser in one
module, and one ``register(DraftKind(…))`` call (below, or in the module or package that brings it). Import the
registry's API from here, so that the built-in kinds are in it.
"""

from __future__ import annotations

from dynvocab.registry import load_plugins
from dynvocab.runtime.drafts import draft_model, eagle_draft
from dynvocab.runtime.drafts.registry import (
    DraftKind,
    LoadedDraft,
    LoadRequest,
    draft_kinds,
    find_kind,
    kind_names,
    lookup_kind,
    register,
    unregister,
)

ENTRY_POINTS = "dynvocab.drafts"  # the entry-point group of draft kinds that installed packages bring

for _kind in (eagle_draft.EAGLE1_KIND, eagle_draft.EAGLE3_KIND, draft_model.KIND):
    register(_kind)
load_plugins(ENTRY_POINTS, register, DraftKind)

__all__ = [
    "ENTRY_POINTS",
    "DraftKind",
    "LoadRequest",
    "LoadedDraft",
    "draft_kinds",
    "find_kind",
    "kind_names",
    "lookup_kind",
    "register",
    "unregister",
]
