"""The built-in draft kinds, each one entry in the draft registry (:mod:`dynvocab.runtime.draft_registry`), and
those installed packages bring (entry points in the ``dynvocab.drafts`` group, :mod:`dynvocab.runtime.plugins`).

Adding a kind: its proposer (:class:`~dynvocab.runtime.draft.Proposer`), a loader and a recogniser in one module,
and one ``register(DraftKind(…))`` call (below, or in the module or package that brings it). Import the registry's
API from here, so that the built-in kinds are in it.
"""

from __future__ import annotations

from dynvocab.runtime import draft_model, eagle_draft
from dynvocab.runtime.draft_registry import (
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
from dynvocab.runtime.plugins import DRAFTS, load_plugins

for _kind in (eagle_draft.EAGLE1_KIND, eagle_draft.EAGLE3_KIND, draft_model.KIND):
    register(_kind)
load_plugins(DRAFTS, register, DraftKind)

__all__ = [
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
