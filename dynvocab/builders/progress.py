"""How builders report progress without knowing who renders it (the CLI draws rich bars)."""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Iterator, Protocol

Advance = Callable[..., None]  # advance(n, description=None): n more units done; a new description (live figures)


class Reporter(Protocol):
    """Receives progress of long work and one-line messages."""

    def task(self, description: str, total: int | None = None) -> AbstractContextManager[Advance]:
        """A unit of work with an optional known total; the context yields the advance function."""
        ...

    def log(self, message: str) -> None:
        """A one-line message (stage summaries, recall)."""
        ...


class SilentReporter:
    """Reports nothing (tests, library use)."""

    @contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Advance]:
        yield lambda n=1, description=None: None

    def log(self, message: str) -> None:
        pass
