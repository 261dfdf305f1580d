"""Progress of long work (build stages, router and draft training, bench), reported without knowing who renders it.

Long work reports through a :class:`Reporter`: ``reporter.task(description, total)`` opens a stage and yields an
``advance(n=1, description=None)`` function (``n`` more units done; ``description`` replaces the live text, e.g.
the running loss), and ``reporter.log(message)`` passes a one-line message (a stage's summary). Three renderings:

- :class:`RichReporter`: live rich bars on a terminal (what the CLI draws when stderr is one);
- :class:`PlainReporter`: plain lines where no terminal is attached (CI jobs, ``nohup``, ``cmd 2>log``), one at
  the start and the end of each stage and one every ``interval`` seconds while it runs::

      [draft pass] 0/300 documents
      [draft pass] 12/300 documents · 1.20/s · ETA 4m 00s
      [draft pass] 300/300 documents · 1.18/s · done in 4m 14s

- :class:`SilentReporter`: nothing (the default of every builder).

:func:`make_reporter` makes the choice in one place: plain lines unless the console is a terminal; the environment
variable ``DYNVOCAB_PROGRESS`` forces one (``plain``, ``rich`` or ``off``) and ``DYNVOCAB_PROGRESS_INTERVAL`` sets
the seconds between plain lines (default 10).

From Python, pass any object with ``task`` and ``log`` as above, or wrap a plain function with
:func:`callback_reporter`::

    from dynvocab.progress import callback_reporter

    def show(stage: str, done: int, total: int | None) -> None:
        print(f"{stage}: {done}/{total}")

    reporter = callback_reporter(show)          # fn(stage, done, total) at start, each advance and the end
    build_bundle(target, draft, out, cfg, reporter)

:func:`as_reporter` turns what a caller passed as ``progress`` (None, a Reporter or such a function) into a
Reporter.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, TextIO, runtime_checkable

if TYPE_CHECKING:
    from rich.console import Console

Advance = Callable[..., None]  # advance(n, description=None): n more units done; a new description (live figures)
ProgressCallback = Callable[[str, int, "int | None"], None]  # fn(stage, done, total)

ENV_MODE = "DYNVOCAB_PROGRESS"
ENV_INTERVAL = "DYNVOCAB_PROGRESS_INTERVAL"
MODES = ("rich", "plain", "off")
DEFAULT_INTERVAL = 10.0


@runtime_checkable
class Reporter(Protocol):
    """Receives progress of long work and one-line messages."""

    def task(self, description: str, total: int | None = None) -> AbstractContextManager[Advance]:
        """A unit of work with an optional known total; the context yields the advance function."""
        ...

    def log(self, message: str) -> None:
        """A one-line message (stage summaries, recall)."""
        ...


class SilentReporter:
    """Reports nothing (tests, library use). Also a context manager, like the others."""

    def __enter__(self) -> "SilentReporter":
        return self

    def __exit__(self, *exc) -> None:
        pass

    @contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Advance]:
        """A stage nobody sees."""
        yield lambda n=1, description=None: None

    def log(self, message: str) -> None:
        """Drops the message."""


class CallbackReporter(SilentReporter):
    """Calls ``fn(stage, done, total)`` when a stage starts (``done`` 0), after each advance, and when it ends;
    the last call has ``done == total`` (``total`` is then what was done, also for a stage of unknown length or one
    that stopped early), so a callback can tell the end. ``stage`` is the description the stage opened with.
    Messages go to ``log`` when one is given."""

    def __init__(self, fn: ProgressCallback, log: Callable[[str], None] | None = None):
        self.fn = fn
        self.on_log = log

    @contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Advance]:
        """Report the stage to the callback."""
        stage, done = description, 0
        self.fn(stage, 0, total)

        def advance(n: int = 1, description: str | None = None) -> None:
            nonlocal done
            done += n
            self.fn(stage, done, total)

        try:
            yield advance
        finally:
            self.fn(stage, done, done)

    def log(self, message: str) -> None:
        """Pass the message on when a ``log`` function was given."""
        if self.on_log is not None:
            self.on_log(message)


def callback_reporter(fn: ProgressCallback, log: Callable[[str], None] | None = None) -> CallbackReporter:
    """A Reporter that calls ``fn(stage, done, total)`` (see :class:`CallbackReporter`) and ``log(message)``."""
    return CallbackReporter(fn, log)


def as_reporter(progress: "Reporter | ProgressCallback | None") -> Reporter:
    """What a caller passed as ``progress``: None reports nothing, a Reporter is used as it is, a function is
    called as ``fn(stage, done, total)``."""
    if progress is None:
        return SilentReporter()
    if isinstance(progress, Reporter):
        return progress
    if callable(progress):
        return callback_reporter(progress)
    raise TypeError(f"progress must be None, a Reporter or a function fn(stage, done, total); got {type(progress).__name__}")


def split_description(description: str) -> tuple[str, str]:
    """``"draft pass (documents)"`` -> ``("draft pass", "documents")``; ``"training (3 epochs, batches)"`` ->
    ``("training (3 epochs)", "batches")``: the stage's label and the unit it counts (empty when none is named).
    Plain lines split only the descriptions of stages with a known total; the others keep theirs whole."""
    match = re.fullmatch(r"(.*?)\s*\(([^()]*)\)", description.strip())
    if not match:
        return description.strip(), ""
    label, inside = match.groups()
    head, _, unit = inside.rpartition(",")
    return (f"{label} ({head.strip()})" if head else label), unit.strip()


def format_seconds(seconds: float) -> str:
    """``24s``, ``9m 36s``, ``1h 02m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def format_rate(rate: float) -> str:
    """Units per second with the digits that matter: ``0.0091/s``, ``0.21/s``, ``3.50/s``, ``42.0/s``, ``1,234/s``."""
    if rate < 0.1:
        return f"{rate:.2g}/s"
    if rate < 10:
        return f"{rate:.2f}/s"
    if rate < 100:
        return f"{rate:.1f}/s"
    return f"{rate:,.0f}/s"


class _PlainTask:
    """One open stage of a :class:`PlainReporter`."""

    def __init__(self, description: str, total: int | None, now: float):
        self.label, self.unit = split_description(description) if total is not None else (description.strip(), "")
        self.total = total
        self.done = 0
        self.live = ""
        self.started = now
        self.last_line = now

    def set_live(self, description: str) -> None:
        """A live description, less the stage's own label when it repeats it (``training · loss 2.1``)."""
        words = description.strip()
        base = self.label.split(" (")[0]
        if words.startswith(base):
            words = words[len(base):].lstrip(" ·:")
        self.live = words

    def line(self, now: float, end: bool = False) -> str:
        """``[stage] done/total unit · rate · ETA`` (at the end: ``done in``; before any time: no rate; a stage of
        unknown length that counts nothing says ``started``, then the time elapsed)."""
        parts = []
        if self.total is not None or self.done:
            count = f"{self.done:,}/{self.total:,}" if self.total is not None else f"{self.done:,}"
            parts.append(f"{count}{' ' + self.unit if self.unit else ''}")
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if self.done and elapsed > 0:
            parts.append(format_rate(rate))
        if end:
            parts.append(f"done in {format_seconds(elapsed)}")
        elif self.total is not None and rate > 0:
            parts.append(f"ETA {format_seconds(max(self.total - self.done, 0) / rate)}")
        elif elapsed > 0:
            parts.append(f"{format_seconds(elapsed)} elapsed")
        if self.live and not end:
            parts.append(self.live)
        return f"[{self.label}] " + (" · ".join(parts) or "started")


class PlainReporter:
    """Progress as plain lines on a text stream (default: stderr as it is at each write): one when a stage starts,
    one every ``interval`` seconds while it runs and one when it ends (``[stage] done/total unit · rate · ETA``).

    Lines come with advances that find the last line ``interval`` seconds old, and — while the reporter is entered
    as a context manager — from a heartbeat thread, so a stage that advances rarely (a model load, a slow bench row)
    still shows it is alive. ``clock`` and :meth:`tick` let tests drive it without sleeping.
    """

    def __init__(self, stream: TextIO | None = None, interval: float = DEFAULT_INTERVAL,
                 clock: Callable[[], float] = time.monotonic, heartbeat: bool = True):
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self.heartbeat = heartbeat
        self.tasks: list[_PlainTask] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PlainReporter":
        if self.heartbeat and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="dynvocab-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _beat(self) -> None:
        while not self._stop.wait(min(self.interval, 1.0)):
            self.tick()

    def _write(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(text + "\n")
        stream.flush()

    def tick(self) -> None:
        """Write a line for every open stage whose last line is ``interval`` seconds old."""
        with self._lock:
            now = self.clock()
            for task in self.tasks:
                if now - task.last_line >= self.interval:
                    task.last_line = now
                    self._write(task.line(now))

    @contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Advance]:
        """A stage: a line now, lines at the interval as it advances, a line at its end."""
        with self._lock:
            task = _PlainTask(description, total, self.clock())
            self.tasks.append(task)
            self._write(task.line(task.started))

        def advance(n: int = 1, description: str | None = None) -> None:
            with self._lock:
                task.done += n
                if description is not None:
                    task.set_live(description)
            self.tick()

        try:
            yield advance
        finally:
            with self._lock:
                self.tasks.remove(task)
                self._write(task.line(self.clock(), end=True))

    def log(self, message: str) -> None:
        """The message as one line."""
        with self._lock:
            self._write(message)


class RichReporter:
    """Draws progress as live rich bars on the console (stderr) and prints messages above them."""

    def __init__(self, console: "Console"):
        from rich.progress import (
            BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
        )

        self.progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True,
        )

    def __enter__(self) -> "RichReporter":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    @contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[Advance]:
        """A bar for the stage, removed when it ends."""
        task_id = self.progress.add_task(description, total=total)
        try:
            yield lambda n=1, description=None: self.progress.update(task_id, advance=n, description=description)
        finally:
            self.progress.remove_task(task_id)

    def log(self, message: str) -> None:
        """The message above the bars."""
        self.progress.console.print(message, highlight=False, soft_wrap=True)


def progress_mode(console: "Console | None" = None) -> str:
    """``rich``, ``plain`` or ``off``: ``DYNVOCAB_PROGRESS`` when set, else ``rich`` on a terminal (the console's
    view of one, which honours rich's ``FORCE_TERMINAL``; without a console, whether stderr is a tty)."""
    forced = os.environ.get(ENV_MODE, "").strip().lower()
    if forced:
        if forced not in MODES:
            from dynvocab.errors import DynvocabError

            raise DynvocabError(f"{ENV_MODE}={forced} is not one of {', '.join(MODES)}")
        return forced
    terminal = console.is_terminal if console is not None else sys.stderr.isatty()
    return "rich" if terminal else "plain"


def progress_interval() -> float:
    """Seconds between plain progress lines: ``DYNVOCAB_PROGRESS_INTERVAL`` or 10."""
    text = os.environ.get(ENV_INTERVAL, "").strip()
    if not text:
        return DEFAULT_INTERVAL
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        from dynvocab.errors import DynvocabError

        raise DynvocabError(f"{ENV_INTERVAL} must be a number of seconds > 0 (got '{text}')")
    return value


def make_reporter(console: "Console | None" = None) -> "RichReporter | PlainReporter | SilentReporter":
    """The reporter for a command's progress on stderr, chosen by :func:`progress_mode`; use it as a context
    manager (``with make_reporter(console) as reporter:``). ``console`` is the rich console the bars draw on
    (default: a new one on stderr)."""
    mode = progress_mode(console)
    if mode == "off":
        return SilentReporter()
    if mode == "plain":
        return PlainReporter(interval=progress_interval())
    if console is None:
        from rich.console import Console

        console = Console(stderr=True)
    return RichReporter(console)
