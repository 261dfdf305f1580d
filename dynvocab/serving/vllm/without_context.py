"""Rows that drafted without their request's context: counted, logged and exported, never silent.

A context strategy (a window, a lookup, a request's own state) drafts a row from its shared sets only where the
plugin does not know the row's request or its tokens: a head call no proposal announced (:mod:`.proposal`), a batch
whose rows differ from the announced requests, a request whose tokens the runner's record does not hold and the
plugin cannot vouch for (each reason in :mod:`.proposal`), fed ids or target states of passes it did not see.
Output stays exact (the target verifies every drafted token); acceptance drops. Each such row is counted once per
proposal (:class:`Misses`), logged (the first time, then at most once per :data:`LOG_EVERY_S` per reason, naming the
strategy, why, and the total), and exported as the Prometheus counter ``dynvocab_rows_without_context_total`` in the
server's ``/metrics`` beside vLLM's spec-decode counters.

The draft runs in a worker process; ``/metrics`` is served by the API server's. :func:`install_exporter` runs in the
first process that registers the plugin (the one the user started): it makes a folder, names it in
:data:`DIR_ENV` (which the engine's and workers' processes inherit) and adds a collector to ``prometheus_client``'s
default registry, which ``/metrics`` serves, that sums the counts the workers write there (one small file per
process, replaced whole, at most once per :data:`PUBLISH_EVERY_S` and at exit). Where vLLM serves Prometheus in
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, several API servers), a worker also counts into a
``prometheus_client`` counter, which that mode collects across processes.

Where the counter cannot be exported (prometheus_client missing, an inherited :data:`DIR_ENV` that names no folder,
the folder removed while the server runs) ``/metrics`` has none, never a false 0, and the log says why once (a line
with :data:`ABSENT`); a process whose count cannot be written (a full disk) stops writing it (the sum keeps what it
wrote) and says so once. No error in exporting reaches the draft: the server keeps serving.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

METRIC = "dynvocab_rows_without_context"  # exported as METRIC + "_total"
HELP = "Draft rows of a dynvocab context strategy that drafted without their request's context"
DIR_ENV = "DYNVOCAB_VLLM_METRICS_DIR"
# Why nothing is exported, once the first process logged it: the engine's and workers' processes inherit it and stay
# quiet, so the line prints once per server or LLM.
NOT_EXPORTED_ENV = "DYNVOCAB_VLLM_METRICS_NOT_EXPORTED"
ABSENT = f"/metrics has no {METRIC}_total"  # in every line that says why the server exports no such counter
LOG_EVERY_S = 30.0
PUBLISH_EVERY_S = 1.0  # a process writes its count at most this often (the count in between at the interval's end)
logger = logging.getLogger("vllm.dynvocab")  # the plugin's logger (a child of vLLM's), as in the package's __init__
_SAID: set[str] = set()  # the one-time lines this process logged


def _warn_once(key: str, line: str, *args) -> None:
    """Log ``line % args`` the first time this process meets ``key``."""
    if key not in _SAID:
        _SAID.add(key)
        logger.warning(line, *args)


class Misses:
    """One draft's count of rows without context (``total``), by reason (``by_reason``)."""

    def __init__(self, strategy: str = ""):
        self.strategy = strategy
        self.total = 0
        self.by_reason: dict[str, int] = {}
        self._logged: dict[str, float] = {}
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            _SHARED.counter()  # multiprocess mode shows the counter (0) from the draft's start, not its first count

    def count(self, rows: int, why: str) -> None:
        """Count ``rows`` rows that drafted without their request's context, for the reason ``why``."""
        if rows <= 0:
            return
        self.total += rows
        self.by_reason[why] = self.by_reason.get(why, 0) + rows
        now = time.monotonic()
        if now - self._logged.get(why, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[why] = now
            where = f"not exported ({_FILE.stopped})" if _FILE.stopped else f"exported as {METRIC}_total"
            logger.warning("dynvocab: %s drafted %d row(s) without their request's context (%s); %d so far in this "
                           "worker, %s; output unchanged, fewer drafts accepted",
                           self.strategy or "the draft", rows, why, self.total, where)
        self._publish(rows)

    def _publish(self, rows: int) -> None:
        """Hand the new total to the API server's collector (:class:`_ProcessFile`) and to Prometheus's multiprocess
        mode, where on; neither raises."""
        _FILE.add(rows)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            _SHARED.inc(rows)


class _ProcessFile:
    """This process's rows without context (every draft's), written whole as ``<DIR_ENV>/<pid>.json`` for the API
    server's collector: at once where the last write is :data:`PUBLISH_EVERY_S` old, else when that interval ends
    (a timer), and at exit. A write that fails (the folder removed, a full disk) stops the export, logged once
    (``stopped`` says why); it never raises to the draft."""

    def __init__(self):
        self.total = 0  # what this process counted
        self.written = 0  # what its file says
        self.stopped = ""  # why its count is not written ("": it is)
        self.folder: str | None = None  # DIR_ENV at the first count
        self._pid = os.getpid()
        self._last = float("-inf")
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def add(self, rows: int) -> None:
        """Count ``rows`` more, and write them now or at the interval's end."""
        with self._lock:
            if self.total == 0:
                self.folder = os.environ.get(DIR_ENV)
                atexit.register(self.flush, True)
            self.total += rows
            if self.stopped or not self.folder or self._timer is not None:
                return
            wait = self._last + PUBLISH_EVERY_S - time.monotonic()
            if wait <= 0:
                self._write(False)
                return
            timer = threading.Timer(wait, self.flush)
            timer.daemon = True
            try:
                timer.start()
            except RuntimeError:  # no new thread at interpreter shutdown: the exit hook writes it
                return
            self._timer = timer

    def flush(self, final: bool = False) -> None:
        """Write what is not written yet (``final``: at exit, where a folder already removed is no error)."""
        if os.getpid() != self._pid:
            return  # a forked child's copy (its exit hook included): the child counts in an object of its own
        with self._lock:
            self._timer = None
            if not self.stopped and self.folder and self.written != self.total:
                self._write(final)

    def _write(self, final: bool) -> None:
        """The file, replaced whole (the lock held); an error stops the export, logged once."""
        self._last = time.monotonic()
        path = Path(self.folder) / f"{self._pid}.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"total": self.total}))
            os.replace(tmp, path)
        except Exception as error:  # an OSError, mostly: whatever it is, the draft goes on
            if final and not Path(self.folder).is_dir():
                return  # the API server removed it as it exited: nothing collects any more
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self.stopped = f"its count could not be written to {path}: {error}"
            _warn_once("file", "dynvocab: this process's count of rows drafted without their request's context "
                       "stopped being exported to %s_total: %s (%d of its %d rows so far written); such rows are "
                       "still logged, and serving goes on", METRIC, self.stopped, self.written, self.total)
            return
        self.written = self.total


class _SharedCounter:
    """This process's ``prometheus_client`` counter for multiprocess mode; where it cannot have one (prometheus_client
    missing, the name held by something else) or counting fails, it is skipped, logged once."""

    def __init__(self):
        self._counter = None
        self._looked = False

    def counter(self):
        """The counter (None: none here)."""
        if not self._looked:
            self._looked = True
            try:
                self._counter = _multiprocess_counter()
            except Exception as error:
                _warn_once("shared", "dynvocab: no multiprocess %s_total in this process (%s); rows are still "
                           "logged", METRIC, error)
        return self._counter

    def inc(self, rows: int) -> None:
        """Count ``rows`` (never raises)."""
        counter = self.counter()
        if counter is None:
            return
        try:
            counter.inc(rows)
        except Exception as error:  # its mmap file, mostly: the draft goes on
            self._counter = None
            _warn_once("shared", "dynvocab: this process's multiprocess %s_total stopped (%s); rows are still "
                       "logged, and serving goes on", METRIC, error)


def _multiprocess_counter():
    """The process's ``prometheus_client`` counter (None where prometheus_client is missing, or where the name is
    registered to something that is not a counter, such as the collector in the process that installed it: logged
    once)."""
    try:
        from prometheus_client import Counter
    except ImportError:
        return None
    try:
        return Counter(METRIC, HELP)
    except ValueError:  # registered already in this process
        from prometheus_client import REGISTRY

        found = REGISTRY._names_to_collectors.get(METRIC)
        if isinstance(found, Counter):
            return found
        _warn_once("shared", "dynvocab: %s is registered in this process as %s, not as a counter: this process "
                   "counts no multiprocess %s_total; rows are still logged", METRIC, type(found).__name__, METRIC)
        return None


_FILE = _ProcessFile()
_SHARED = _SharedCounter()


def _forked() -> None:
    """A forked child counts its own rows, in a file of its own (not its parent's total under its pid)."""
    global _FILE, _SHARED
    _FILE, _SHARED = _ProcessFile(), _SharedCounter()


os.register_at_fork(after_in_child=_forked)


def exported_total(folder: str | os.PathLike) -> int:
    """The sum of the counts the workers wrote into ``folder``."""
    total = 0
    for path in Path(folder).glob("*.json"):
        try:
            total += int(json.loads(path.read_text())["total"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return total


class _Collector:
    """A ``prometheus_client`` collector of the workers' counts; none once their folder is gone (logged once)."""

    def __init__(self, folder: str):
        self.folder = folder

    def collect(self):
        """The counter: the workers' counts summed (nothing, where the folder was removed: its counts are lost)."""
        from prometheus_client.core import CounterMetricFamily

        if not Path(self.folder).is_dir():
            _warn_once("collector", "dynvocab: %s from now on: %s, where the workers write their counts, was "
                       "removed while the server runs (their counts are lost, so no 0 stands in); rows drafted "
                       "without their request's context are still logged, and serving goes on", ABSENT, self.folder)
            return
        family = CounterMetricFamily(METRIC, HELP)
        family.add_metric([], exported_total(self.folder))
        yield family


class Export(NamedTuple):
    """What :func:`install_exporter` found: the folder this process's counts go to (None: none), and why the
    server's ``/metrics`` has no counter of them ("": it has one, served by this process or the parent that
    installed it)."""

    folder: str | None
    why_not: str = ""


def install_exporter() -> Export:
    """In the first process that registers the plugin: the folder the workers write their counts to, named in
    :data:`DIR_ENV`, and a collector of them in ``prometheus_client``'s default registry. In a process that
    inherits the folder (the engine's, the workers'), nothing more. Where nothing can be installed (prometheus_client
    missing; an inherited :data:`DIR_ENV` that names no folder) it logs why (once per server or ``LLM``) and says why
    in the result."""
    folder = os.environ.get(DIR_ENV)
    if folder:
        if Path(folder).is_dir():
            return Export(folder)
        return _not_installed(f"{DIR_ENV}={folder} was inherited but names no folder (a leftover of another "
                              "process: unset it before starting vLLM)")
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return _not_installed("prometheus_client is missing (install it beside vLLM)")
    folder = tempfile.mkdtemp(prefix="dynvocab-vllm-metrics-")
    atexit.register(shutil.rmtree, folder, True)
    os.environ[DIR_ENV] = folder
    REGISTRY.register(_Collector(folder))
    return Export(folder)


def _not_installed(why: str) -> Export:
    """No export, for the reason ``why``: logged by the first process of a server or ``LLM`` (:data:`NOT_EXPORTED_ENV`
    keeps its children quiet)."""
    _FILE.stopped = why
    if os.environ.get(NOT_EXPORTED_ENV) != why:
        os.environ[NOT_EXPORTED_ENV] = why
        logger.warning("dynvocab: %s: %s; rows drafted without their request's context are still logged", ABSENT, why)
    return Export(None, why)
