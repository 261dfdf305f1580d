"""One registry of bundle stages: a name maps to what every reader of a bundle knows of that stage.

A :class:`BundleStage` entry says which command makes the stage (``build-index`` or ``train-router``), which other
stages it was made from (it is dropped when one of them is rebuilt), how its table is read, and what ``inspect``
adds about it. The order of registration is the order stages are listed and written in. The bundle's own messages
(a missing stage, a failed checksum), the strategies' stage check and ``inspect`` read it, so the runtime knows a
stage without importing the builders. How a stage is *made* is the builders' half
(:mod:`dynvocab.builders.stage_registry`), whose entries name one of these.

The built-in stages are registered by :mod:`dynvocab.artifacts.stages` (imported with :mod:`dynvocab.artifacts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from dynvocab.errors import DynvocabError
from dynvocab.registry import Registry


class BundleLike(Protocol):
    """What this registry asks of a bundle (:class:`dynvocab.artifacts.bundle.Bundle` is one): the bundle reads the
    registry for its stage order and messages, so the registry names the bundle only by what it calls."""

    def require(self, stage: str) -> None:
        """Raise a one-line error when ``stage`` is missing."""


@dataclass(frozen=True)
class Maker:
    """A command that writes stages into a bundle, and how it is told which stages and which bundle."""

    command: str
    names_option: str  # the option that takes a comma-separated list of stages
    bundle_option: str  # the option that takes the bundle's path

    def line(self, stages: Iterable[str], path) -> str:
        """The command line that (re)makes ``stages`` in the bundle at ``path``."""
        return f"dynvocab {self.command} {self.names_option} {','.join(stages)} {self.bundle_option} {path}"


BUILD_INDEX = Maker("build-index", "--stages", "--out")
TRAIN_ROUTER = Maker("train-router", "--selector", "--bundle")


@dataclass(frozen=True)
class BundleStage:
    """One kind of bundle stage: its tensors live under ``<name>.``, its config and info in the metadata."""

    name: str
    help: str  # one line: what the stage holds
    made_by: Maker = BUILD_INDEX
    made_from: tuple[str, ...] = ()  # stages it was made from: it is dropped when one of them is rebuilt
    table: Callable[[BundleLike], object] | None = None  # its typed reader (None: read by a function that needs more)
    describe: Callable[[BundleLike], dict] | None = None  # fields ``inspect`` adds to the stage's entry (JSON-ready)
    headline: Callable[[dict], str] | None = None  # ``inspect``'s closing line about it, from its described entry


_REGISTRY: Registry[BundleStage] = Registry("bundle stage")
unregister = _REGISTRY.unregister  # remove a stage kind (tests, plugins); unknown names are ignored


def register(kind: BundleStage) -> BundleStage:
    """Add a stage kind (refuses a name already registered or one a tensor name cannot start with); returns it."""
    if not kind.name or "." in kind.name:
        raise ValueError(f"bad stage name {kind.name!r}")
    return _REGISTRY.register(kind)


def stage_kinds() -> tuple[BundleStage, ...]:
    """Every registered stage kind, in bundle order."""
    return tuple(_REGISTRY.values())


def stage_names() -> tuple[str, ...]:
    """Every registered stage name, in bundle order."""
    return _REGISTRY.names()


def find_stage(name: str) -> BundleStage | None:
    """The stage kind ``name``, or None for a stage this dynvocab does not know (it is still read and kept)."""
    return _REGISTRY.get(name)


def read_stage(bundle: BundleLike, name: str):
    """Stage ``name``'s table, read from ``bundle`` by its entry (a one-line error when the bundle lacks it)."""
    bundle.require(name)
    kind = find_stage(name)
    if kind is None or kind.table is None:
        raise DynvocabError(f"stage '{name}' has no table reader")
    return kind.table(bundle)


def maker(name: str) -> Maker:
    """The command that makes stage ``name`` (``build-index`` for a name no entry claims)."""
    kind = find_stage(name)
    return BUILD_INDEX if kind is None else kind.made_by


def remake_command(name: str, path) -> str:
    """The command line that (re)makes stage ``name`` in the bundle at ``path``."""
    return maker(name).line([name], path)


def adding_commands(stages: Iterable[str], path) -> str:
    """The commands that add ``stages`` to the bundle at ``path``, one per command that makes them, build-index
    first, each quoted in backticks and joined by "and"."""
    groups: dict[Maker, list[str]] = {BUILD_INDEX: []}
    for name in stages:
        groups.setdefault(maker(name), []).append(name)
    return " and ".join(f"`{m.line(names, path)}`" for m, names in groups.items() if names)
