"""Strategies and draft kinds from installed packages, found through entry points.

A package registers a strategy by declaring an entry point in the ``dynvocab.strategies`` group and a draft kind in
the ``dynvocab.drafts`` group (``pyproject.toml``: ``[project.entry-points."dynvocab.strategies"] mine =
"my_pkg.policy:STRATEGY"``). Each entry point names a registry entry (a
:class:`~dynvocab.runtime.registry.Strategy`, a :class:`~dynvocab.runtime.draft_registry.DraftKind`), a sequence of
them, or a function returning either; it is loaded once, when the registry's built-ins are registered, so that
``generate``'s and ``bench``'s options and help list it beside them. A plugin that fails to load is refused in one
line naming it.
"""

from __future__ import annotations

from importlib import metadata
from typing import Callable

from dynvocab.errors import DynvocabError

STRATEGIES = "dynvocab.strategies"
DRAFTS = "dynvocab.drafts"

_LOADED: dict[str, list[str]] = {}


def load_plugins(group: str, register: Callable, kind: type) -> list[str]:
    """Register every ``kind`` entry that the installed packages declare in entry-point ``group`` with
    ``register``; returns the names of the entry points loaded (once per group: later calls return the same)."""
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
