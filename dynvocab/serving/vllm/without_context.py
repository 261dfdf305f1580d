"""Rows that drafted without their request's context: counted, logged and exported, never silent.

A context strategy (a window, a lookup, a request's own state) drafts a row from its shared sets only where the
plugin does not know the row's request or its tokens: a head call no proposal announced (:mod:`.proposal`), a batch
whose rows differ from the announced requests, a request whose earlier tokens are placeholders the plugin never saw.
Output stays exact (the target verifies every drafted token); acceptance drops. Each such row is counted once per
proposal (:class:`Misses`), logged (the first time, then at most once per :data:`LOG_EVERY_S` per reason, naming the
strategy, why, and the total), and exported as the Prometheus counter ``dynvocab_rows_without_context_total`` in the
server's ``/metrics`` beside vLLM's spec-decode counters.

The draft runs in a worker process; ``/metrics`` is served by the API server's. :func:`install_exporter` runs in the
first process that registers the plugin (the one the user started): it makes a folder, names it in
:data:`DIR_ENV` (which the engine's and workers' processes inherit) and adds a collector to ``prometheus_client``'s
default registry, which ``/metrics`` serves, that sums the counts the workers write there (one small file per
process, replaced whole at each change). Where vLLM serves Prometheus in multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, several API servers), a worker also counts into a ``prometheus_client`` counter,
which that mode collects across processes.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

METRIC = "dynvocab_rows_without_context"  # exported as METRIC + "_total"
HELP = "Draft rows of a dynvocab context strategy that drafted without their request's context"
DIR_ENV = "DYNVOCAB_VLLM_METRICS_DIR"
LOG_EVERY_S = 30.0
_PROCESS = {"total": 0}  # every draft's rows in this process (what its file says)
logger = logging.getLogger("vllm.dynvocab")  # the plugin's logger (a child of vLLM's), as in the package's __init__


class Misses:
    """One draft's count of rows without context (``total``), by reason (``by_reason``)."""

    def __init__(self, strategy: str = ""):
        self.strategy = strategy
        self.total = 0
        self.by_reason: dict[str, int] = {}
        self._logged: dict[str, float] = {}
        self._counter = None

    def count(self, rows: int, why: str) -> None:
        """Count ``rows`` rows that drafted without their request's context, for the reason ``why``."""
        if rows <= 0:
            return
        self.total += rows
        self.by_reason[why] = self.by_reason.get(why, 0) + rows
        now = time.monotonic()
        if now - self._logged.get(why, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[why] = now
            logger.warning("dynvocab: %s drafted %d row(s) without their request's context (%s); %d so far in this "
                           "worker, exported as %s_total; output unchanged, fewer drafts accepted",
                           self.strategy or "the draft", rows, why, self.total, METRIC)
        self._publish(rows)

    def _publish(self, rows: int) -> None:
        """Hand the new total to the API server's collector (and to Prometheus's multiprocess mode, where on)."""
        _PROCESS["total"] += rows
        folder = os.environ.get(DIR_ENV)
        if folder and Path(folder).is_dir():
            path = Path(folder) / f"{os.getpid()}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(_PROCESS))
            os.replace(tmp, path)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            if self._counter is None:
                self._counter = _multiprocess_counter()
            if self._counter is not None:
                self._counter.inc(rows)


def _multiprocess_counter():
    """The process's ``prometheus_client`` counter (None where prometheus_client is missing)."""
    try:
        from prometheus_client import Counter
    except ImportError:
        return None
    try:
        return Counter(METRIC, HELP)
    except ValueError:  # registered already in this process
        from prometheus_client import REGISTRY

        return REGISTRY._names_to_collectors.get(METRIC)


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
    """A ``prometheus_client`` collector of the workers' counts."""

    def __init__(self, folder: str):
        self.folder = folder

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(METRIC, HELP)
        family.add_metric([], exported_total(self.folder))
        yield family


def install_exporter() -> str | None:
    """In the first process that registers the plugin: the folder the workers write their counts to, named in
    :data:`DIR_ENV`, and a collector of them in ``prometheus_client``'s default registry (None: a parent process
    installed it, or prometheus_client is missing)."""
    if os.environ.get(DIR_ENV):
        return None
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return None
    folder = tempfile.mkdtemp(prefix="dynvocab-vllm-metrics-")
    atexit.register(shutil.rmtree, folder, True)
    os.environ[DIR_ENV] = folder
    REGISTRY.register(_Collector(folder))
    return folder
