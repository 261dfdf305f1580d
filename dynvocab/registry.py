"""One named-entry registry, the shape behind every extension point: strategies, draft kinds, export formats, EAGLE
checkpoint layouts, bundle stages and their builders each keep one :class:`Registry` and add what only they know
(priorities, validation, their own listings). It sits at the bottom of the package, beside :mod:`dynvocab.errors`,
so that every layer may import it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypeVar

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
