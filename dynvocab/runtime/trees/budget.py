"""``--tree auto``: a draft tree fitted to the machine's own verification cost
(:mod:`dynvocab.runtime.trees.curve`), or the chain where no tree pays (:mod:`dynvocab.runtime.trees.mode`).

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

Per cycle, tree or chain: :meth:`~dynvocab.runtime.trees.mode.AutoState.wants_tree`. A cycle whose n-gram lookup
found a continuation (``X+ngram``) drafts it alone, as a chain row does. So where no tree pays (a head whose k rows
cost k times one, a lookup that already drafts well), auto drafts chains.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dynvocab.runtime.host import to_host
from dynvocab.runtime.trees.curve import load_curve, pass_seconds, relative
from dynvocab.runtime.trees.growth import rank_scores
from dynvocab.runtime.trees.mode import AutoState, TreeMemory, clock_for
from dynvocab.runtime.trees.shape import TreeShape

AUTO_DEPTH = 6  # the chain's γ (loop.DEFAULT_GAMMA)
FLAT = 1.5  # the largest tree auto grows: its pass costs at most this many 1-token passes


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
        return relative(self.curve)

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
        """Seconds of a pass over ``n`` drafted tokens (:func:`~dynvocab.runtime.trees.curve.pass_seconds`)."""
        return pass_seconds(self.curve, n)

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
        (:func:`~dynvocab.runtime.trees.growth.rank_scores`) and the running figures as earlier cycles left them (a
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
        """Whether this cycle drafts a tree or the chain
        (:meth:`~dynvocab.runtime.trees.mode.AutoState.wants_tree`)."""
        return self.state.wants_tree()

    def finish(self, tree: bool, emitted: int, accepted: int) -> None:
        """A cycle that drafted a ``tree`` (else the chain) ended with ``emitted`` tokens, ``accepted`` of them
        drafted: its tokens and time join that mode's rate (:meth:`~dynvocab.runtime.trees.mode.AutoState.record`);
        a tree's calibrate the draft's confidence and the times of its growth too."""
        state = self.state
        cycle_s = self.clock() - self._marks[0]
        if tree:
            self.trees += 1
            state.cycle_s = cycle_s if state.cycle_s is None else 0.8 * state.cycle_s + 0.2 * cycle_s
            state.per_cycle = 0.9 * state.per_cycle + 0.1 * (accepted + 1)
            if self._predicted > 0:
                ratio = accepted / self._predicted
                state.calibration = min(2.0, max(0.05, 0.9 * state.calibration + 0.1 * ratio))
        else:
            self.chains += 1
        state.record(tree, emitted, cycle_s)

    def rate(self, mode: str) -> float | None:
        """Tokens per second of ``"tree"`` or ``"chain"`` cycles
        (:meth:`~dynvocab.runtime.trees.mode.AutoState.rate`)."""
        return self.state.rate(mode)

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


__all__ = ["AUTO_DEPTH", "FLAT", "TreeBudget", "budget_for"]
