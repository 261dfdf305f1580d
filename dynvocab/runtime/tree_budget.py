"""``--tree auto``: a draft tree fitted to the machine's own verification cost, or the chain where no tree pays.

The target's pass over ``1 + N`` tokens (the root and N drafted nodes) is timed once per target, dtype, device, CPU
and thread count at the sizes that matter (:data:`SIZES`) and kept in the model cache
(``$DYNVOCAB_CACHE/verify-cost/``, written whole or not at all). On a GPU a 60-token pass costs what a 1-token one
does; on two CPU cores it does not (shared/DESIGN.md, "Draft trees on a CPU"), so the tree must be sized to the
curve.

The growth shape (:attr:`TreeBudget.shape`): depth :data:`AUTO_DEPTH` (the chain's γ), top-k 4 where the curve is
flat up to 16 tokens, else 2, and at most the largest N whose pass costs :data:`FLAT` × a 1-token pass or less
(never fewer than the depth). Within a cycle, growth stops before a depth whose frontier's calibrated probability
mass would add tokens more slowly than tree cycles make them (:meth:`TreeBudget.keep_growing`), and the
cycle verifies the N best candidates that maximise the expected tokens per second,
``(1 + a · Σ_{i ≤ N} p_i) / (g + c(N))``, where ``p_i`` is the draft's cumulative probability of the i-th best
node (EAGLE-2: a good estimate of its acceptance), ``a`` the calibration of those estimates against the
acceptances seen so far, ``c(N)`` the measured pass and ``g`` the growth's time.

Under sampling a cycle's depth and N are fixed before its first draw (:meth:`TreeBudget.plan`), by the same rules
over the rank-fixed scores a sampled growth gives its nodes and the times earlier cycles took: which nodes are
verified never depends on a token drawn in the cycle, nor on how long drawing it took, so the tree stays exact.

And per cycle, tree or chain (:meth:`TreeBudget.wants_tree`): both are tried, then auto drafts the chain until the
tree's rate (tokens per second of its cycles) beats the chain's by :data:`SWITCH`, and then trees until the chain's
beats theirs by as much (hysteresis). A rate is a moving average over its mode's cycles: a cycle weighs half as
much after :data:`HALF_LIFE` more of that mode. The other mode drafts one cycle after :data:`EXPLORE` cycles, twice
as many each time it stays behind (up to :data:`EXPLORE_MAX`), counted across generations, so its rate keeps being
refreshed. A cycle whose n-gram lookup found a continuation (``X+ngram``) drafts it alone, as a chain row does. So
where no tree pays (a head whose k rows cost k times one, a lookup that already drafts well), auto drafts chains.

What the generations learn (the rates and mode, when to look next, the calibration, the growth's times) lives in a
:class:`TreeMemory` that whoever runs them owns and passes in (a :class:`~dynvocab.runtime.session.Session` keeps
one), an :class:`AutoState` per strategy, sampling and lookup; without one each generation starts afresh. Times are
read with ``perf_counter``, after ``torch.cuda.synchronize`` on a CUDA target (:func:`clock_for`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dynvocab.files import write_atomic
from dynvocab.models.loading import cpu_name
from dynvocab.runtime.host import to_host
from dynvocab.runtime.tree_draft import rank_scores
from dynvocab.runtime.tree_shape import TreeShape

SIZES = (1, 2, 4, 8, 16, 32, 64)  # drafted tokens N per pass timed (the pass holds the root too)
AUTO_DEPTH = 6  # the chain's γ (loop.DEFAULT_GAMMA)
FLAT = 1.5  # the largest tree auto grows: its pass costs at most this many 1-token passes
CONTEXT = 256  # tokens in the cache while the curve is timed
REPEATS = 5  # timed passes per size (the median counts)
EXPLORE = 8  # auto drafts the mode it is not drafting one cycle in this many, to see whether it is still slower,
EXPLORE_MAX = 32  # … one in twice as many each time it still was, up to this many (counted across generations)
SWITCH = 1.03  # auto changes mode only where the other's rate beats the current one's by this factor (hysteresis)
HALF_LIFE = 4  # a cycle weighs half as much in its mode's rate after this many more cycles of that mode
DECAY = 0.5 ** (1 / HALF_LIFE)  # … so each cycle of a mode, its earlier tokens and seconds count this much less


def curve_key(target) -> dict:
    """What the verification curve depends on: the target, its dtype and device, the CPU and the thread count."""
    config = target.model.config
    return {
        "target": str(getattr(config, "_name_or_path", "") or type(target.model).__name__),
        "layers": getattr(config.get_text_config(), "num_hidden_layers", None),
        "vocab": target.vocab_size, "hidden": target.hidden_size, "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(target.device), "cpu": cpu_name(), "threads": torch.get_num_threads(),
        "prepacked": target.head is not None and type(target.head).__name__ != "Linear",
    }


def curve_path(key: dict) -> Path:
    """Where the curve of ``key`` is kept."""
    from dynvocab.models.demo import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "verify-cost" / f"{digest}.json"


@torch.inference_mode()
def measure_curve(target, sizes=SIZES, context: int = CONTEXT, repeats: int = REPEATS) -> dict[int, float]:
    """Seconds of one target pass (body and full head) over ``1 + N`` new tokens after ``context`` cached ones,
    for each N in ``sizes`` (median of ``repeats``, after one untimed pass). Leaves the target reset."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(target.vocab_size, (context + 1 + max(sizes),), generator=g).to(target.device)
    target.reset()
    target.step(ids[:context])
    out = {}
    for n in sizes:
        times = []
        for r in range(repeats + 1):
            start = time.perf_counter()
            target.logits(target.step(ids[context : context + 1 + n]))
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            if r:
                times.append(time.perf_counter() - start)
            target.rollback(context)
        out[n] = sorted(times)[len(times) // 2]
    target.reset()
    return out


def load_curve(target, status=None) -> tuple[dict[int, float], bool]:
    """The target's verification curve from the cache, or measured now and kept; (curve, whether it was
    measured now)."""
    key = curve_key(target)
    path = curve_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key:
            return {int(n): float(s) for n, s in data["seconds"].items()}, False
    except (OSError, ValueError, KeyError):
        pass
    if status is not None:
        status(f"timing the target's verification passes of {', '.join(map(str, SIZES))} tokens (once per machine)")
    curve = measure_curve(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps({"key": key, "seconds": curve}, indent=1)))
    return curve, True


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


@dataclass
class TreeBudget:
    """One generation's ``--tree auto`` (see the module's docstring): the growth shape, chosen from ``curve``
    (seconds of a pass by drafted tokens N), when to stop growing, each cycle's tokens and its mode. ``greedy``:
    greedy decoding (else each cycle's depth and N are fixed before its draws, :meth:`plan`); ``state``: the running
    figures, carried over from earlier generations where it came from a :class:`TreeMemory`; ``clock``: seconds,
    read at each mark (:func:`clock_for`)."""

    curve: dict[int, float]
    greedy: bool = True
    state: AutoState = field(default_factory=AutoState)
    clock: Callable[[], float] = time.perf_counter
    trees: int = 0  # this generation's cycles that drafted a tree
    chains: int = 0  # … that drafted the chain (a found n-gram continuation not counted)
    chosen: list[int] = field(default_factory=list)  # each tree cycle's N
    depths: list[int] = field(default_factory=list)  # each tree cycle's depth grown
    _predicted: float = 0.0
    _marks: list[float] = field(default_factory=list)
    _grown: int = 0  # depths the cycle's growth has grown
    _planned: TreeShape | None = None

    @functools.cached_property
    def relative(self) -> dict[int, float]:
        """The curve relative to a 1-token pass."""
        one = self.curve[min(self.curve)]
        return {n: s / one for n, s in sorted(self.curve.items())}

    @functools.cached_property
    def shape(self) -> TreeShape:
        """The growth shape: depth :data:`AUTO_DEPTH`, top-k 4 where 16 tokens cost at most :data:`FLAT` passes
        (else 2), and up to the largest N within :data:`FLAT` (at least the depth)."""
        rel = self.relative
        flat = max([n for n, r in rel.items() if r <= FLAT], default=1)
        topk = 4 if rel.get(16, math.inf) <= FLAT else 2
        most = TreeShape(AUTO_DEPTH, topk, 1).candidates
        return TreeShape(AUTO_DEPTH, topk, min(most, max(flat, AUTO_DEPTH)))

    def verify_s(self, n: int) -> float:
        """Seconds of a pass over ``n`` drafted tokens (linear between the timed sizes)."""
        sizes = sorted(self.curve)
        if n <= sizes[0]:
            return self.curve[sizes[0]]
        for lo, hi in zip(sizes, sizes[1:]):
            if n <= hi:
                return self.curve[lo] + (self.curve[hi] - self.curve[lo]) * (n - lo) / (hi - lo)
        return self.curve[sizes[-1]] * n / sizes[-1]

    def describe(self) -> str:
        """One line: the shape chosen and why."""
        rel, shape = self.relative, self.shape
        points = ", ".join(f"{n}: {rel[n]:.2f}×" for n in (4, 8, 16, 32, 64) if n in rel)
        return (f"tree auto: grow up to {shape.depth}x{shape.topk}, verify up to {shape.tokens} tokens; each cycle "
                f"stops growing and picks N where the draft's calibrated confidence no longer pays for the time (a "
                f"pass of N drafted tokens costs {points} a 1-token pass here), and drafts the chain instead while "
                f"chain cycles make tokens faster")

    def start(self) -> None:
        """A cycle begins (before its draft, tree or chain)."""
        self._marks, self._grown = [self.clock()], 1

    def plan(self, shape: TreeShape) -> TreeShape:
        """The shape this tree cycle grows, within ``shape`` (the growth shape, cut to the generation's end).
        Greedy: ``shape`` itself (growth stops and N is picked during the cycle, from the draft's own scores).
        Sampling: the depth and N fixed now, before the cycle's first draw, by the rules of :meth:`keep_growing` and
        :meth:`tokens` over the rank-fixed scores a sampled growth gives its candidates
        (:func:`~dynvocab.runtime.tree_draft.rank_scores`) and the running figures as earlier cycles left them (a
        growth of d depths estimated at d depths' time), so nothing drawn in the cycle, nor the time it took,
        changes which nodes are verified."""
        if self.greedy:
            return shape
        by_depth = rank_scores(shape)
        depth = 1
        while depth < shape.depth and self._pays(sorted(by_depth[depth - 1], reverse=True)[: shape.topk]):
            depth += 1
        scores = sorted((s for level in by_depth[:depth] for s in level), reverse=True)[: shape.tokens]
        grown_s = depth * (self.state.depth_s or 0.0)
        n, self._predicted = self._best_n(scores, grown_s, 0)
        self._planned = TreeShape(depth, shape.topk, n)
        return self._planned

    def keep_growing(self, frontier: torch.Tensor) -> bool:
        """After a depth: whether one more is worth its time, given the frontier's cumulative scores ``frontier``
        [k] (log-probabilities; one host read, greedy only). Another depth adds at most the calibrated probability
        mass of the frontier to the cycle's expected tokens and costs a depth's time; it pays while that rate is at
        least the rate of tree cycles so far. Sampling: always (the depth was fixed by :meth:`plan`); the depth's
        time is recorded either way, for later cycles."""
        self._marks.append(self.clock())
        marks, state = self._marks, self.state
        if len(marks) > 2:
            depth_s = (marks[-1] - marks[1]) / (len(marks) - 2)
            state.depth_s = depth_s if state.depth_s is None else 0.8 * state.depth_s + 0.2 * depth_s
        known = state.depth_s is not None and state.cycle_s is not None  # else no host read: it grows
        grows = not self.greedy or not known or self._pays(to_host(frontier.double()))
        self._grown += grows
        return grows

    def _pays(self, frontier) -> bool:
        """Whether a depth after a frontier of cumulative scores ``frontier`` adds tokens at least as fast as tree
        cycles make them (True until both times are known)."""
        state = self.state
        if state.depth_s is None or state.cycle_s is None:
            return True
        gain = state.calibration * sum(math.exp(v) for v in frontier)
        return gain * state.cycle_s >= state.per_cycle * state.depth_s

    def tokens(self, candidates, extra: int = 0) -> int:
        """This cycle's N. Greedy: the count of best candidates that maximises expected tokens per second, the
        growth's time so far counted in (``extra``: tokens verified beside them, an n-gram branch). Sampling: the
        N :meth:`plan` fixed before the cycle's draws."""
        self.depths.append(self._grown)
        if not self.greedy:
            self.chosen.append(self._planned.tokens)
            return self._planned.tokens
        grown_s = self.clock() - self._marks[0] if self._marks else 0.0
        scores = sorted((s for s in candidates.scores if math.isfinite(s)), reverse=True)[: self.shape.tokens]
        best, self._predicted = self._best_n(scores, grown_s, extra)
        self.chosen.append(best)
        return best

    def _best_n(self, scores: list[float], grown_s: float, extra: int) -> tuple[int, float]:
        """The count of the best ``scores`` (descending) that maximises ``(1 + a · Σ p_i) / (g + c(N))``, and its
        predicted acceptance ``Σ p_i``."""
        best, best_rate, total, predicted = 1, -1.0, 0.0, 0.0
        for n, score in enumerate(scores, start=1):
            total += math.exp(score)
            rate = (1.0 + self.state.calibration * total) / (grown_s + self.verify_s(n + extra))
            if rate > best_rate:
                best, best_rate, predicted = n, rate, total
        return best, predicted

    def wants_tree(self) -> bool:
        """Whether this cycle drafts a tree or the chain: the tree, then the chain, each tried once; then the mode
        drafted (:attr:`AutoState.tree_mode`), the other one cycle in ``explore_every``, counted across
        generations (:data:`EXPLORE` cycles after a switch, twice as many after each look that left it behind, up
        to :data:`EXPLORE_MAX`)."""
        state = self.state
        if "tree" not in state.totals or "chain" not in state.totals:
            return "tree" not in state.totals
        state.since_look += 1
        if state.since_look < state.explore_every:
            return state.tree_mode
        state.since_look = 0
        state.explore_every = min(2 * state.explore_every, EXPLORE_MAX)  # a switch after the look resets it
        return not state.tree_mode

    def finish(self, tree: bool, emitted: int, accepted: int) -> None:
        """A cycle that drafted a ``tree`` (else the chain) ended with ``emitted`` tokens, ``accepted`` of them
        drafted: its tokens and time join that mode's rate (a moving average, :data:`HALF_LIFE`), a tree's
        calibrate the draft's confidence too; then the mode switches where the other's rate beats it by
        :data:`SWITCH`."""
        state = self.state
        cycle_s = self.clock() - self._marks[0]
        mode = "tree" if tree else "chain"
        tokens, seconds = state.totals.get(mode, (0.0, 0.0))
        state.totals[mode] = (DECAY * tokens + emitted, DECAY * seconds + cycle_s)
        if tree:
            self.trees += 1
            state.cycle_s = cycle_s if state.cycle_s is None else 0.8 * state.cycle_s + 0.2 * cycle_s
            state.per_cycle = 0.9 * state.per_cycle + 0.1 * (accepted + 1)
            if self._predicted > 0:
                ratio = accepted / self._predicted
                state.calibration = min(2.0, max(0.05, 0.9 * state.calibration + 0.1 * ratio))
        else:
            self.chains += 1
        tree_rate, chain_rate = self.rate("tree"), self.rate("chain")
        if tree_rate is None or chain_rate is None:
            return
        current, other = (tree_rate, chain_rate) if state.tree_mode else (chain_rate, tree_rate)
        if other > SWITCH * current:  # hysteresis: a near tie keeps the mode drafted
            state.tree_mode = not state.tree_mode
            state.explore_every, state.since_look = EXPLORE, 0

    def rate(self, mode: str) -> float | None:
        """Tokens per second of ``"tree"`` or ``"chain"`` cycles, recent ones weighing more (None before the
        first)."""
        if mode not in self.state.totals:
            return None
        tokens, seconds = self.state.totals[mode]
        return tokens / max(seconds, 1e-9)

    def summary(self) -> dict:
        """What auto chose over the generation: the shape, the cycles of each mode, the rates, the median N and
        depth, the calibration."""
        def median(values):
            return sorted(values)[len(values) // 2] if values else None

        return {"shape": str(self.shape), "tree_cycles": self.trees, "chain_cycles": self.chains,
                "tree_rate": _rounded(self.rate("tree")), "chain_rate": _rounded(self.rate("chain")),
                "median_tokens": median(self.chosen), "median_depth": median(self.depths),
                "calibration": round(self.state.calibration, 3),
                "curve_ms": {n: round(s * 1000, 2) for n, s in self.curve.items()}}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def budget_for(target, key: tuple = (), memory: TreeMemory | None = None, greedy: bool = True) -> TreeBudget:
    """The :class:`TreeBudget` of one ``greedy`` (else sampled) generation on ``target``, its curve measured once on
    this machine and cached. With a ``memory`` it goes on from what the last generation of the same ``key``
    (strategy, sampling, lookup) learned there (the modes' rates, the mode, when to look at the other, the
    calibration and the growth's times) and reads the memory's clock where it has one; without one it starts afresh.
    Its clock otherwise: :func:`clock_for` the target's device."""
    curve, _ = load_curve(target)
    state = AutoState() if memory is None else memory.state(key)
    clock = memory.clock if memory is not None and memory.clock is not None else clock_for(target.device)
    return TreeBudget(curve, greedy, state, clock)


__all__ = ["SIZES", "AutoState", "TreeBudget", "TreeMemory", "budget_for", "clock_for", "curve_key", "load_curve",
           "measure_curve"]
