"""The EAGLE checkpoint layouts: the built-in ones, each one entry in the layout registry
(:mod:`.registry`), one module each: :mod:`.eagle` (EAGLE-1/2, the EAGLE repo's), :mod:`.eagle3` (EAGLE-3, the
EAGLE repo's and SGLang's), :mod:`.speculators` (EAGLE-3, vllm-project/speculators').

Adding a layout: a :class:`Layout` subclass answering ``recognize`` and ``config_json`` (and ``layer_of`` /
``arch`` where its config differs) with its fields set, in one module, and one :func:`register` call (below, or in
the module that brings it). ``tests/test_layout_registry.py`` registers a toy layout and runs a head written in it.
Import the registry's API from here, so that the built-in layouts are in it.
"""

from __future__ import annotations

from dynvocab.models.eagle.layouts import eagle, eagle3, speculators
from dynvocab.models.eagle.layouts.registry import (
    DEFAULT_FAMILY,
    KIND_LABELS,
    Layout,
    Names,
    check_kind,
    describe_families,
    eagle3_fields,
    families,
    layout_for,
    layout_names,
    layouts,
    lookup_layout,
    recognize,
    register,
    unregister,
)

for _layout in (eagle.LAYOUT, eagle3.LAYOUT, speculators.LAYOUT):
    register(_layout)

__all__ = [
    "DEFAULT_FAMILY",
    "KIND_LABELS",
    "Layout",
    "Names",
    "check_kind",
    "describe_families",
    "eagle3_fields",
    "families",
    "layout_for",
    "layout_names",
    "layouts",
    "lookup_layout",
    "recognize",
    "register",
    "unregister",
]
