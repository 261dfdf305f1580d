"""One registry of draft kinds: a kind maps to how it is recognised, loaded and what it is.

A :class:`DraftKind` entry holds a recogniser (does this model argument name a draft of this kind? it reads config
and weight names, never loads weights), a loader that turns a :class:`LoadRequest` into a :class:`LoadedDraft` (the
:class:`~dynvocab.runtime.drafts.draft.Proposer` and what the session reports of it), and an optional stand-in that
``microbench policy-steps`` times policies against (random weights shaped as the kind's drafts are). ``Session`` asks
the registry which kind a ``--draft`` names and never asks a kind anything else; adding a draft kind is one module
(its proposer and loader) and one :func:`register` call, or an entry point in the ``dynvocab.drafts`` group of an
installed package (:mod:`dynvocab.runtime.plugins`).

The built-in kinds are registered by :mod:`dynvocab.runtime.drafts.kinds`; import the API from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from dynvocab.errors import DynvocabError
from dynvocab.registry import Registry
from dynvocab.runtime.drafts.draft import DraftInfo, Proposer


@dataclass(frozen=True)
class LoadRequest:
    """What a kind's loader is given: the draft argument, the loaded target and how the session runs.

    ``draft_weights``: what the user asked the draft's steps to read (``"int8"``, a dtype name, or None for the
    machine's default); the loader answers with the value in force (:attr:`LoadedDraft.weights`).
    """

    source: str  # the --draft argument as given
    spec: object  # its dynvocab.models.ModelSpec
    found: object  # what the kind's recogniser returned for it (e.g. the checkpoint folder)
    target_model: torch.nn.Module  # the target's transformers model
    target: object  # the target's CausalLM (its head rows, its features)
    tokenizer: object  # the target's tokenizer
    device: str
    dtype: str
    prepacked: bool  # the target's linears were given oneDNN packs: the draft's may be too
    draft_weights: str | None = None
    say: Callable[[str], None] = lambda msg: None


@dataclass(frozen=True)
class LoadedDraft:
    """A loaded draft: the proposer and what the session reports and checks of it."""

    proposer: Proposer
    weights: str  # the draft-weights value in force ("int8" or a dtype name)
    bytes: dict  # what it holds in memory: weights, prepared, total (see draft_weights.draft_bytes)
    match: object | None = None  # dynvocab.models.VocabMatch of a draft model's tokenizer, or None
    fingerprint: Callable[[], object] | None = None  # its ModelFingerprint for a bundle check, or None (no own model)


@dataclass(frozen=True)
class DraftKind:
    """One registry entry: a kind of draft.

    ``recognize(spec)`` returns something truthy (handed to ``load`` as ``found``) when the model argument names a
    draft of this kind, else None; entries are asked in ``priority`` order (highest first), so a catch-all kind
    (a draft model: any causal LM) sits last. ``stand_in(vocab, hidden, generator)``: a :class:`DraftInfo` with
    random weights for ``microbench policy-steps`` (None: the kind offers none).
    """

    name: str
    label: str  # for people: "draft model", "EAGLE-3 head"
    recognize: Callable[[object], object | None]
    load: Callable[[LoadRequest], LoadedDraft]
    priority: int = 0
    stand_in: Callable[[int, int, torch.Generator], DraftInfo] | None = None
    help: str = field(default="", compare=False)  # one line for --help listings
    trees: bool = False  # its proposer drafts EAGLE-2 trees (``tree_root`` and ``branch``; --tree)


_REGISTRY: Registry[DraftKind] = Registry("draft kind")
register = _REGISTRY.register  # add a draft kind (refuses a name already registered); returns it
unregister = _REGISTRY.unregister  # remove a draft kind (tests, plugins replacing a kind)


def draft_kinds() -> list[DraftKind]:
    """Every registered kind, in the order they are asked (highest priority first)."""
    return sorted(_REGISTRY.values(), key=lambda k: -k.priority)


def lookup_kind(name: str) -> DraftKind:
    """The kind registered as ``name``; a one-line error naming the registered kinds otherwise."""
    kind = _REGISTRY.get(name)
    if kind is None:
        raise DynvocabError(f"unknown draft kind '{name}'; registered: {kind_names()}")
    return kind


def find_kind(spec) -> tuple[DraftKind, object]:
    """The kind whose recogniser accepts ``spec`` (a ModelSpec), and what it found; refused in one line when none
    does."""
    for kind in draft_kinds():
        found = kind.recognize(spec)
        if found is not None:
            return kind, found
    raise DynvocabError(f"{spec.source} is no draft that dynvocab can run (kinds: {kind_names()})")


def check_tree_kind(spec) -> None:
    """Refuse ``--tree`` for the draft ``spec`` (a ModelSpec) in one line, before it loads, when its kind drafts
    chains only."""
    from dynvocab.runtime.trees.shape import chains_only

    kind, _ = find_kind(spec)
    if not kind.trees:
        raise chains_only(kind.label)


def kind_names() -> str:
    """The registered kinds' names, comma-separated (for help texts and errors)."""
    return ", ".join(k.name for k in draft_kinds())
