"""One named-entry registry, the shape behind every extension point: strategies, draft kinds, export formats, EAGLE
checkpoint layouts, bundle stages and their builders each keep one :class:`Registry` and add what only they know
(priorities, validation, their own listings). It sits at the bottom of the package, beside :mod:`dynvocab.errors`,
so that every layer may import it.

Entries may also come from installed packages, through entry points (:func:`load_plugins`): a group per registry,
named where that registry lives (``dynvocab.strategies``, ``dynvocab.drafts``, ``dynvocab.export_formats``), so an
upper floor (a serving adapter) adds an entry to a lower one's registry without the lower one importing it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib import metadata
from typing import Callable, TypeVar

from dynvocab.errors import DynvocabError

T = TypeVar("T")


class Registry(Mapping[str, T]):
    """Entries (anything with a ``name``) by name, in registration order; a read-only mapping name -> entry.

    ``noun`` names an entry in messages ("export format"); ``duplicate`` is the refusal of a name already taken,
    with ``{noun}`` and ``{name}`` filled in.
    """

    def __init__(self, noun: str, duplicate: str = "{noun} '{name}' is already registered"):
        self.noun = noun
        self._duplicate = duplicate
        self._entries: dict[str, T] = {}

    def check_new(self, entry: T) -> None:
        """Refuse (ValueError) ``entry`` when its name is registered already."""
        if entry.name in self._entries:
            raise ValueError(self._duplicate.format(noun=self.noun, name=entry.name))

    def register(self, entry: T) -> T:
        """Add ``entry`` (refuses a name already registered); returns it."""
        self.check_new(entry)
        self._entries[entry.name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove the entry ``name`` (tests, plugins replacing an entry); unknown names are ignored."""
        self._entries.pop(name, None)

    def pop(self, name: str, *default):
        """Remove the entry ``name`` and return it, as ``dict.pop`` does (KeyError unless a default is given)."""
        return self._entries.pop(name, *default)

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order."""
        return tuple(self._entries)

    def lookup(self, name: str) -> T:
        """The entry ``name``; a one-line error naming the registered entries otherwise."""
        if name not in self._entries:
            raise DynvocabError(f"unknown {self.noun} '{name}'; use one of {', '.join(self._entries)}")
        return self._entries[name]

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.noun!r}, {list(self._entries)})"


_LOADED: dict[str, list[str]] = {}


def load_plugins(group: str, register: Callable, kind: type) -> list[str]:
    """Register every ``kind`` entry that the installed packages declare in entry-point ``group`` with ``register``;
    returns the names of the entry points loaded (once per group: later calls return the same).

    A package declares one in its ``pyproject.toml`` (``[project.entry-points."dynvocab.strategies"] mine =
    "my_pkg.policy:STRATEGY"``); each names an entry, a sequence of them, or a function returning either. A plugin
    that fails to load is refused in one line naming it.
    """
    if group in _LOADED:
        return _LOADED[group]
    names = []
    for point in metadata.entry_points(group=group):
        try:
            found = point.load()
            if callable(found) and not isinstance(found, kind):
                found = found()
        except Exception as exc:
            raise DynvocabError(f"plugin '{point.name}' ({point.value}, group {group}) failed to load: {exc}") from exc
        entries = found if isinstance(found, (list, tuple)) else [found]
        for entry in entries:
            if not isinstance(entry, kind):
                raise DynvocabError(
                    f"plugin '{point.name}' ({point.value}) gave a {type(entry).__name__}, not a {kind.__name__}"
                )
            register(entry)
        names.append(point.name)
    _LOADED[group] = names
    return names


def forget_plugins(group: str) -> None:
    """Let :func:`load_plugins` read ``group`` again (tests)."""
    _LOADED.pop(group, None)
