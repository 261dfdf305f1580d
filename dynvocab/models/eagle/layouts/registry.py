"""One registry of EAGLE checkpoint layouts: a layout's name maps to how it is recognised, read and written.

A :class:`Layout` says, for one published form of an EAGLE head: which kind of head it holds, how a checkpoint
folder is recognised as it (from ``config.json`` and the weight names, nothing loaded), how its ``config.json``
reads and writes, how its tensor names map onto :class:`~dynvocab.models.eagle.EagleModel`'s, and what its explicit
``eagle_aux_hidden_state_layer_ids`` mean. :mod:`..checkpoint` reads and writes every layout through these answers
and never asks which layout it has. Adding a layout is one module (a :class:`Layout` subclass and its instance) and
one :func:`register` call; the built-ins are registered by :mod:`dynvocab.models.eagle.layouts`, so import the API
from there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from dynvocab.errors import DynvocabError
from dynvocab.models.eagle.config import EAGLE1, EAGLE3, EagleConfig
from dynvocab.registry import Registry

KIND_LABELS = {EAGLE1: "EAGLE-1/2", EAGLE3: "EAGLE-3"}
DEFAULT_FAMILY = "eagle"  # what save_eagle writes when no layout is named: the EAGLE repo's form of the head's kind

Names = Callable[[], set[str]]  # the checkpoint's tensor names without a ``model.`` prefix, read when first asked


@dataclass(frozen=True)
class Layout(ABC):
    """One registry entry: a published checkpoint layout of EAGLE heads of one ``kind``.

    ``family``: the name ``train-draft --format`` knows it by; one family holds one layout per kind (``eagle``:
    ``eagle`` for EAGLE-1/2, ``eagle3`` for EAGLE-3). Recognisers are asked in ``priority`` order (highest first),
    so a layout recognised from its ``config.json`` alone sits above those recognised by their weight names.
    ``aux_offset``: an explicit layer id i in the config names ``hidden_states[i + aux_offset]`` (``eagle3``: 1,
    "the output of layer i"; ``speculators``: 0, "the input of layer i"). ``renames_in`` / ``renames_out``: tensor
    name prefixes mapped on reading (checkpoint -> model) and on writing (model -> checkpoint).
    ``always_embeddings``: ``embed_tokens`` is written even when the caller leaves it out.
    ``full_vocab_without_map``: a full-vocabulary EAGLE-3 head is written without ``d2t``/``t2d``.
    ``scaled_embeddings``: the layout's readers embed tokens as the target does (Gemma's sqrt(d) scale); False:
    they embed unscaled, and ``train-draft`` refuses a head in it for such a target.
    """

    name: str
    kind: str
    family: str
    priority: int = 0
    aux_offset: int = 0
    aux_means: str = "the input of layer i"  # what an explicit id i names, for messages
    norm_before_residual: bool = False  # read when the config does not say
    renames_in: tuple[tuple[str, str], ...] = ()
    renames_out: tuple[tuple[str, str], ...] = ()
    always_embeddings: bool = False
    full_vocab_without_map: bool = False
    scaled_embeddings: bool = True
    help: str = ""  # one line for --help listings

    @abstractmethod
    def recognize(self, config: dict, names: Names) -> bool:
        """Whether a folder with this ``config.json`` and these tensor names is in this layout (refuses, in one
        line, a folder that is plainly this layout's but of a form dynvocab cannot run)."""

    def layer_of(self, config: dict) -> dict:
        """The part of ``config.json`` that describes the decoder layer (the whole of it unless nested)."""
        return config

    def arch(self, layer: dict) -> str:
        """The decoder layer family (:data:`~dynvocab.models.eagle.config.ARCHS`) of the layer config ``layer``."""
        return "llama"

    @abstractmethod
    def config_json(self, cfg: EagleConfig, layer: dict, target_name: str | None) -> dict:
        """``config.json`` of ``cfg`` in this layout, given the decoder layer's fields ``layer``; refuses, in one line
        naming the field, what the layout's readers cannot hold. ``target_name``: the verifier, where recorded."""

    def read_aux(self, ids) -> tuple[int, ...] | None:
        """The layout's explicit layer ids as target hidden-state indices (None: none given)."""
        if not ids:
            return None
        return tuple(int(i) + self.aux_offset for i in ids)

    def write_aux(self, cfg: EagleConfig) -> list[int] | None:
        """The head's target hidden-state indices as this layout writes its layer ids."""
        if cfg.aux_hidden_states is None:
            return None
        low = min(cfg.aux_hidden_states)
        if low < self.aux_offset:
            others = [lay.name for lay in layouts() if lay.kind == cfg.kind and lay.aux_offset <= low]
            raise DynvocabError(
                f"this EAGLE-3 head reads hidden_states[{low}]{' (the embeddings)' if low == 0 else ''}, which the "
                f"{self.name} layout's ids ({self.aux_means}) cannot name; write it as "
                f"{' or '.join(others) or 'another layout'}"
            )
        return [i - self.aux_offset for i in cfg.aux_hidden_states]

    def to_model(self, name: str) -> str:
        """A checkpoint tensor name (``model.`` prefix stripped) as the model's state dict names it."""
        return _rename(name, self.renames_in)

    def to_file(self, name: str) -> str:
        """A model state-dict name as this layout writes it."""
        return _rename(name, self.renames_out)


def _rename(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def eagle3_fields(cfg: EagleConfig, layout: Layout) -> dict:
    """The fields every EAGLE-3 ``config.json`` carries: the draft vocabulary, the target's width, the residual's
    norm, and the explicit layer ids as ``layout`` writes them (only when the head has them)."""
    fields = {
        "draft_vocab_size": cfg.draft_vocab,
        "target_hidden_size": cfg.target_hidden,
        "norm_before_residual": cfg.norm_before_residual,
    }
    aux = layout.write_aux(cfg)
    if aux is not None:
        fields["eagle_aux_hidden_state_layer_ids"] = aux
    return fields


_REGISTRY: Registry[Layout] = Registry("EAGLE layout")
register = _REGISTRY.register  # add a layout (refuses a name already registered); returns it
unregister = _REGISTRY.unregister  # remove a layout (tests, plugins replacing a layout)


def layouts() -> list[Layout]:
    """Every registered layout, in the order registered (the order help texts and errors list them)."""
    return list(_REGISTRY.values())


def layout_names() -> tuple[str, ...]:
    """The registered layouts' names: what :func:`~dynvocab.models.eagle.save_eagle` writes."""
    return _REGISTRY.names()


def families() -> tuple[str, ...]:
    """The registered families (``train-draft --format``'s values), in the order first registered."""
    return tuple(dict.fromkeys(lay.family for lay in layouts()))


def describe_families() -> str:
    """One line per family for ``--format``'s help: ``family: what each of its layouts is``."""
    return "; ".join(
        f"{family}: " + ", or ".join(lay.help or lay.name for lay in layouts() if lay.family == family)
        for family in families()
    )


def lookup_layout(layout: str | Layout) -> Layout:
    """The layout registered as ``layout`` (a :class:`Layout` is returned as it is); one line naming the
    registered layouts otherwise."""
    if isinstance(layout, Layout):
        return layout
    return _REGISTRY.lookup(layout)


def layout_for(family: str, kind: str) -> Layout | None:
    """The layout of ``family`` that holds heads of ``kind``, or None when the family holds none."""
    return next((lay for lay in layouts() if lay.family == family and lay.kind == kind), None)


def recognize(config: dict, names: Names) -> Layout | None:
    """The layout whose recogniser accepts a folder with ``config`` and tensor ``names`` (highest priority first),
    or None: not an EAGLE checkpoint."""
    for layout in sorted(layouts(), key=lambda lay: -lay.priority):
        if layout.recognize(config, names):
            return layout
    return None


def check_kind(layout: Layout, kind: str) -> None:
    """Refuse, in one line naming the layouts that hold it, a head of ``kind`` for ``layout``."""
    if kind != layout.kind:
        others = " or ".join(lay.name for lay in layouts() if lay.kind == kind)
        raise DynvocabError(
            f"layout '{layout.name}' holds {KIND_LABELS[layout.kind]} heads; write an {KIND_LABELS[kind]} head as {others}"
        )
