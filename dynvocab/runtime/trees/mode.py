"""``--tree auto``'s choice per cycle, tree or chain, and what the generations learn.

Both modes are tried, then auto drafts the chain until the tree's rate (tokens per second of its cycles) beats the
chain's by :data:`SWITCH`, and then trees until the chain's beats theirs by as much (hysteresis). A rate is a moving
average over its mode's cycles: a cycle weighs half as much after :data:`HALF_LIFE` more of that mode. The other
mode drafts one cycle after :data:`EXPLORE` cycles, twice as many each time it stays behind (up to
:data:`EXPLORE_MAX`), counted across generations, so its rate keeps being refreshed.

What the generations learn (the rates and mode, when to look next, the calibration, the growth's times) lives in a
:class:`TreeMemory` that whoever runs them owns and passes in (a :class:`~dynvocab.runtime.session.Session` keeps
one), an :class:`AutoState` per strategy, sampling and lookup; without one each generation starts afresh. Times are
read with ``perf_counter``, after ``torch.cuda.synchronize`` on a CUDA target (:func:`clock_for`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

EXPLORE = 8  # auto drafts the mode it is not drafting one cycle in this many, to see whether it is still slower,
EXPLORE_MAX = 32  # … one in twice as many each time it still was, up to this many (counted across generations)
SWITCH = 1.03  # auto changes mode only where the other's rate beats the current one's by this factor (hysteresis)
HALF_LIFE = 4  # a cycle weighs half as much in its mode's rate after this many more cycles of that mode
DECAY = 0.5 ** (1 / HALF_LIFE)  # … so each cycle of a mode, its earlier tokens and seconds count this much less


@dataclass
class AutoState:
    """What ``--tree auto`` has learned over the generations of one strategy, sampling and lookup on one draft, each
    a running figure: the calibration of the draft's confidence (accepted tokens per unit of predicted acceptance),
    tokens per tree cycle, the seconds of one growth depth and of one tree cycle, each mode's decayed (tokens,
    seconds), the mode drafted (True: trees), the cycles between looks at the other mode and those since the last."""

    calibration: float = 1.0
    per_cycle: float = 2.0
    depth_s: float | None = None
    cycle_s: float | None = None
    totals: dict[str, tuple[float, float]] = field(default_factory=dict)  # "tree"/"chain" -> (tokens, seconds)
    tree_mode: bool = False
    explore_every: int = EXPLORE
    since_look: int = 0

    def wants_tree(self) -> bool:
        """Whether this cycle drafts a tree or the chain: the tree, then the chain, each tried once; then the mode
        drafted (:attr:`tree_mode`), the other one cycle in ``explore_every``, counted across generations
        (:data:`EXPLORE` cycles after a switch, twice as many after each look that left it behind, up to
        :data:`EXPLORE_MAX`)."""
        if "tree" not in self.totals or "chain" not in self.totals:
            return "tree" not in self.totals
        self.since_look += 1
        if self.since_look < self.explore_every:
            return self.tree_mode
        self.since_look = 0
        self.explore_every = min(2 * self.explore_every, EXPLORE_MAX)  # a switch after the look resets it
        return not self.tree_mode

    def record(self, tree: bool, emitted: int, seconds: float) -> None:
        """A cycle that drafted a ``tree`` (else the chain) made ``emitted`` tokens in ``seconds``: they join that
        mode's rate (a moving average, :data:`HALF_LIFE`); then the mode switches where the other's rate beats it by
        :data:`SWITCH`."""
        mode = "tree" if tree else "chain"
        tokens, total_s = self.totals.get(mode, (0.0, 0.0))
        self.totals[mode] = (DECAY * tokens + emitted, DECAY * total_s + seconds)
        tree_rate, chain_rate = self.rate("tree"), self.rate("chain")
        if tree_rate is None or chain_rate is None:
            return
        current, other = (tree_rate, chain_rate) if self.tree_mode else (chain_rate, tree_rate)
        if other > SWITCH * current:  # hysteresis: a near tie keeps the mode drafted
            self.tree_mode = not self.tree_mode
            self.explore_every, self.since_look = EXPLORE, 0

    def rate(self, mode: str) -> float | None:
        """Tokens per second of ``"tree"`` or ``"chain"`` cycles, recent ones weighing more (None before the
        first)."""
        if mode not in self.totals:
            return None
        tokens, seconds = self.totals[mode]
        return tokens / max(seconds, 1e-9)


@dataclass
class TreeMemory:
    """``--tree auto``'s memory across generations, owned by whoever runs them on one draft (a
    :class:`~dynvocab.runtime.session.Session` keeps one): an :class:`AutoState` per key (strategy, sampling,
    lookup), and the clock its budgets read (None: :func:`clock_for` the target's device)."""

    states: dict[tuple, AutoState] = field(default_factory=dict)
    clock: Callable[[], float] | None = None

    def state(self, key: tuple) -> AutoState:
        """The state of ``key``: new at its first generation, the last one's after that."""
        return self.states.setdefault(key, AutoState())


def clock_for(device) -> Callable[[], float]:
    """Seconds for ``--tree auto``'s timings on ``device``: ``perf_counter``, after a ``torch.cuda.synchronize`` on a
    CUDA device (whose launches are not waited for otherwise, so an unsynchronised clock times the launches)."""
    device = torch.device(device)
    return functools.partial(_synced_clock, device) if device.type == "cuda" else time.perf_counter


def _synced_clock(device: torch.device) -> float:
    """``perf_counter`` once ``device``'s queued work has finished."""
    torch.cuda.synchronize(device)
    return time.perf_counter()


__all__ = ["DECAY", "EXPLORE", "EXPLORE_MAX", "HALF_LIFE", "SWITCH", "AutoState", "TreeMemory", "clock_for"]
