"""The machine's load around each bench row, and the warnings that say when figures cannot be trusted.

A speed figure measured while another process holds a core is not the method's: on two cores one busy process
made ``ar`` print a quarter of its speed, and nothing said so. Each row is bracketed by two :class:`LoadSample`
readings of ``/proc`` (Linux; elsewhere nothing is recorded and nothing is warned): the load averages, and the CPU
time the whole machine and this process tree (vLLM's engine and workers included) spent between them. What the
rest of the machine spent is the *other processes' share*, in cores.

Two rules, anchored on pyperf's ``check`` (the benchmark tool of Python's own core developers, which warns when
"the standard deviation is greater than 10% of the mean" or "the minimum or the maximum is 50% smaller or greater
than the mean"):

- **busy**: other processes used at least :data:`BUSY_SHARE` (10%) of the machine during a row. Our rows use every
  core, so whatever others take comes off our speed about one for one: 10% is pyperf's own bound for an unstable
  result.
- **spread**: a row's time per target pass (wall minus prefill, over verification passes: the unit of work that is
  the same on every prompt, where tokens/s is not, since acceptance differs by prompt) has a maximum or minimum
  :data:`SPREAD` (50%) away from its mean, pyperf's outlier rule. Where a row ran several rounds of the same prompts
  (``bench --vllm``), the rounds are repeats of one measurement and pyperf's 10% standard-deviation rule applies to
  their tokens/s.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

BUSY_SHARE = 0.10  # others' share of the machine's CPU during a row that makes its figures suspect
SPREAD = 0.50  # pyperf: the minimum or maximum this far from the mean is an outlier
ROUNDS_STD = 0.10  # pyperf: a standard deviation above this share of the mean is an unstable result
PROC = Path("/proc")


@dataclass(frozen=True)
class LoadSample:
    """One reading of the machine: monotonic time, load averages, CPU ticks of the machine and of this tree."""

    at: float
    loadavg: tuple[float, float, float]
    busy_ticks: int  # all CPUs, every state but idle and iowait
    total_ticks: int  # all CPUs, every state
    own_ticks: int  # this process, its reaped children, and its living descendants (user + system)


def sample(proc: Path = PROC) -> LoadSample | None:
    """Read the load now; None where ``/proc`` cannot be read (not Linux)."""
    try:
        fields = (proc / "stat").read_text().splitlines()[0].split()[1:]
        loadavg = tuple(float(x) for x in (proc / "loadavg").read_text().split()[:3])
    except (OSError, ValueError, IndexError):
        return None
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    total = sum(ticks)
    return LoadSample(time.monotonic(), loadavg, total - ticks[3] - ticks[4], total, _tree_ticks(proc, os.getpid()))


def _tree_ticks(proc: Path, root: int) -> int:
    """CPU ticks of ``root`` and of every living descendant, each with its reaped children's."""
    parents: dict[int, int] = {}
    ticks: dict[int, tuple[int, int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone between the listing and the read
        rest = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid ... utime stime cutime cstime
        pid = int(entry.name)
        parents[pid] = int(rest[1])
        ticks[pid] = (int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14]))
    if root not in ticks:
        return 0
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    return sum(own + reaped for own, reaped in (ticks[pid] for pid in tree))


def window(before: LoadSample | None, after: LoadSample | None) -> dict | None:
    """The load over one row, for the JSON: load averages before and after, and the cores other processes used
    (``others_cores``) and their share of the machine (``others_share``); None where nothing was read."""
    if before is None or after is None:
        return None
    total = after.total_ticks - before.total_ticks
    cpus = os.cpu_count() or 1
    others = max(after.busy_ticks - before.busy_ticks - (after.own_ticks - before.own_ticks), 0)
    share = others / total if total > 0 else 0.0
    return {
        "loadavg_before": list(before.loadavg),
        "loadavg_after": list(after.loadavg),
        "others_cores": round(share * cpus, 3),
        "others_share": round(share, 4),
        "seconds": round(after.at - before.at, 3),
    }


class Probe:
    """Brackets rows: ``start()`` before a row, ``stop()`` after it returns the row's :func:`window`."""

    def __init__(self) -> None:
        self._before: LoadSample | None = None

    def start(self) -> None:
        """Read the load before a row."""
        self._before = sample()

    def stop(self) -> dict | None:
        """The load since :meth:`start`."""
        return window(self._before, sample())


def machine(loads: list[dict | None]) -> dict | None:
    """The run's machine figures: cores, the largest and mean share other processes took over the rows, and the
    highest 1-minute load average seen; None where no row was measured."""
    seen = [w for w in loads if w]
    if not seen:
        return None
    shares = [w["others_share"] for w in seen]
    return {
        "cpus": os.cpu_count(),
        "rows_measured": len(seen),
        "others_share_max": max(shares),
        "others_share_mean": round(statistics.fmean(shares), 4),
        "loadavg_1m_max": max(max(w["loadavg_before"][0], w["loadavg_after"][0]) for w in seen),
    }


def busy_warning(rows: dict[str, list[dict | None]]) -> str | None:
    """The **busy** rule over ``{row name: [its windows]}``: one line naming the rows during which other
    processes used :data:`BUSY_SHARE` or more of the machine, or None."""
    hit = {name: max(w["others_share"] for w in ws if w) for name, ws in rows.items() if any(ws)}
    hit = {name: share for name, share in hit.items() if share >= BUSY_SHARE}
    if not hit:
        return None
    worst = max(hit.values())
    return (
        f"the machine was busy: other processes used up to {worst:.0%} of its CPU (≥ {BUSY_SHARE:.0%}) during "
        f"{', '.join(hit)}; these speeds are not the method's, rerun on a quiet machine"
    )


def spread_warning(rows: dict[str, list[float]]) -> str | None:
    """The **spread** rule over ``{row name: [seconds per target pass of each of its generations]}``: one line
    naming the rows with a value :data:`SPREAD` or more away from the row's mean, or None."""
    wide = []
    for name, values in rows.items():
        values = [v for v in values if v > 0]
        if len(values) < 2:
            continue
        mean = statistics.fmean(values)
        far = max(max(values) - mean, mean - min(values)) / mean
        if far >= SPREAD:
            wide.append(f"{name} ({far:.0%})")
    if not wide:
        return None
    return (
        f"spread too wide to compare: time per target pass strays ≥ {SPREAD:.0%} from its mean in "
        f"{', '.join(wide)}; rerun when nothing else runs"
    )


def rounds_warning(rows: dict[str, list[float]]) -> str | None:
    """pyperf's standard-deviation rule over ``{row name: [tokens/s of each round]}`` (rounds repeat the same
    prompts): one line naming the rows whose rounds' std exceeds :data:`ROUNDS_STD` of their mean, or None."""
    wide = []
    for name, values in rows.items():
        if len(values) < 2 or statistics.fmean(values) <= 0:
            continue
        cv = statistics.stdev(values) / statistics.fmean(values)
        if cv > ROUNDS_STD:
            wide.append(f"{name} ({cv:.0%})")
    if not wide:
        return None
    return (
        f"rounds disagree: the std of tokens/s over rounds exceeds {ROUNDS_STD:.0%} of the mean in "
        f"{', '.join(wide)}; the medians are not comparable, rerun when nothing else runs"
    )


def per_pass_seconds(metrics: dict) -> float | None:
    """A generation's wall time after prefill over its target passes (None where it made none)."""
    cycles = metrics.get("cycles") or 0
    wall = metrics.get("wall_s")
    if not cycles or wall is None:
        return None
    return max(wall - (metrics.get("prefill_s") or 0.0), 0.0) / cycles


def bench_warnings(generations: list[dict]) -> list[str]:
    """The busy and spread warnings of our own bench's generations (each with ``strategy``, ``metrics`` and the
    ``load`` window of its row)."""
    loads: dict[str, list[dict | None]] = {}
    passes: dict[str, list[float]] = {}
    for g in generations:
        loads.setdefault(g["strategy"], []).append(g.get("load"))
        seconds = per_pass_seconds(g["metrics"])
        if seconds is not None:
            passes.setdefault(g["strategy"], []).append(seconds)
    return [w for w in (busy_warning(loads), spread_warning(passes)) if w]
