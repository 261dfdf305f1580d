"""``--tree auto``: a draft tree fitted to the machine's own verification cost, or the chain where no tree pays.

The target's pass over ``1 + N`` tokens (the root and N drafted nodes) is timed once per target, dtype, device, CPU
and thread count at the sizes that matter (:data:`SIZES`) and kept in the model cache
(``$DYNVOCAB_CACHE/verify-cost/``, written whole or not at all). On a GPU a 60-token pass costs what a 1-token one
does; on two CPU cores it does not (shared/DESIGN.md, "Draft trees on a CPU"), so the tree must be sized to the
curve.

The growth shape (:attr:`TreeBudget.shape`): depth :data:`AUTO_DEPTH` (the chain's γ), top-k 4 where the curve is
flat up to 16 tokens, else 2, and at most the largest N whose pass costs :data:`FLAT` × a 1-token pass or less
(never fewer than the depth). Within a cycle, growth stops before a depth whose frontier's calibrated probability
mass would add tokens more slowly than the generation's cycles make them (:meth:`TreeBudget.keep_growing`), and the
cycle verifies the N best candidates that maximise the expected tokens per second,
``(1 + a · Σ_{i ≤ N} p_i) / (g + c(N))``, where ``p_i`` is the draft's cumulative probability of the i-th best
node (EAGLE-2: a good estimate of its acceptance), ``a`` the calibration of those estimates against the
acceptances seen so far in the generation, ``c(N)`` the measured pass and ``g`` the growth's time.

And per cycle, tree or chain (:meth:`TreeBudget.wants_tree`): both are tried, then the chain drafts unless tree
cycles made tokens :data:`MARGIN` × faster (over this generation and the last ones of the same strategy on the same
draft), the other again after :data:`EXPLORE` cycles, twice as many each time it is still slower (up to
:data:`EXPLORE_MAX`); a cycle whose n-gram lookup found a continuation (``X+ngram``) drafts it alone, as a chain
row does. So where no tree pays (a head whose k rows cost k times one, a lookup that already drafts well), auto
drafts chains. Timings are read with ``perf_counter``: on a GPU,
whose launches are not waited for, name a fixed shape instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dynvocab.files import write_atomic
from dynvocab.models.loading import cpu_name
from dynvocab.runtime.host import to_host
from dynvocab.runtime.tree_shape import TreeShape

SIZES = (1, 2, 4, 8, 16, 32, 64)  # drafted tokens N per pass timed (the pass holds the root too)
AUTO_DEPTH = 6  # the chain's γ (loop.DEFAULT_GAMMA)
FLAT = 1.5  # the largest tree auto grows: its pass costs at most this many 1-token passes
CONTEXT = 256  # tokens in the cache while the curve is timed
REPEATS = 5  # timed passes per size (the median counts)
EXPLORE = 8  # auto drafts with the slower of tree and chain after this many cycles, to see whether it still is,
EXPLORE_MAX = 64  # … and after twice as many each time it still was, up to this many
MARGIN = 1.10  # auto drafts trees only where their cycles made tokens this much faster than the chain's
DECAY = 0.85  # each cycle, a mode's earlier tokens and seconds count this much less


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
class TreeBudget:
    """Chooses ``--tree auto``'s growth shape once, when to stop growing, and each cycle's tokens (see the module's
    docstring). ``curve``: seconds of a pass by drafted tokens N. The running figures (the calibration of the
    draft's confidence, tokens per cycle, the seconds of a growth depth and of a cycle, each mode's rate) carry over
    from the last generation of the same strategy on the same draft (:func:`budget_for`); they are read with
    ``perf_counter``: a GPU's launches are not waited for, so there name a fixed shape."""

    curve: dict[int, float]
    calibration: float = 1.0  # accepted tokens per unit of predicted acceptance (running)
    per_cycle: float = 2.0  # tokens per cycle (running)
    depth_s: float | None = None  # one growth depth (running)
    cycle_s: float | None = None  # one cycle, growth to verdict (running)
    trees: int = 0  # cycles that drafted a tree
    chains: int = 0  # cycles that drafted the chain (a found n-gram continuation not counted)
    chosen: list[int] = field(default_factory=list)  # each cycle's N
    depths: list[int] = field(default_factory=list)  # each cycle's depth grown
    _predicted: float = 0.0
    _marks: list[float] = field(default_factory=list)
    _cycle: int = 0
    _totals: dict = field(default_factory=dict)  # mode -> (tokens, seconds), decayed
    explore_every: int = EXPLORE  # cycles between looks at the slower mode (running)
    _leader: bool = False  # whether trees led at the last look

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
                f"pass of N drafted tokens costs {points} a 1-token pass here), and drafts the chain instead where "
                f"chain cycles made tokens faster")

    def start(self) -> None:
        """A cycle's growth begins."""
        self._marks = [time.perf_counter()]

    def keep_growing(self, frontier: torch.Tensor) -> bool:
        """After a depth: whether one more is worth its time, given the frontier's cumulative scores ``frontier``
        [k] (log-probabilities; one host read). Another depth adds at most the calibrated probability mass of the
        frontier to the cycle's expected tokens and costs a depth's time; it pays while that rate is at least the
        rate of this generation's cycles so far."""
        self._marks.append(time.perf_counter())
        marks = self._marks
        if len(marks) > 2:
            depth_s = (marks[-1] - marks[1]) / (len(marks) - 2)
            self.depth_s = depth_s if self.depth_s is None else 0.8 * self.depth_s + 0.2 * depth_s
        if self.depth_s is None or self.cycle_s is None:
            return True
        gain = self.calibration * sum(math.exp(v) for v in to_host(frontier.double()))
        return gain * self.cycle_s >= self.per_cycle * self.depth_s

    def tokens(self, candidates, extra: int = 0) -> int:
        """This cycle's N: the count of best candidates that maximises expected tokens per second, the growth's
        time so far counted in (``extra``: tokens verified beside them, an n-gram branch)."""
        now = time.perf_counter()
        grown_s = now - self._marks[0] if self._marks else 0.0
        self.depths.append(max(1, len(self._marks) - 1))
        scores = sorted((s for s in candidates.scores if math.isfinite(s)), reverse=True)[: self.shape.tokens]
        best, best_rate, total, predicted = 1, -1.0, 0.0, 0.0
        for n, score in enumerate(scores, start=1):
            total += math.exp(score)
            rate = (1.0 + self.calibration * total) / (grown_s + self.verify_s(n + extra))
            if rate > best_rate:
                best, best_rate, predicted = n, rate, total
        self._predicted = predicted
        self.chosen.append(best)
        return best

    def wants_tree(self) -> bool:
        """Whether this cycle drafts a tree or the chain: each is tried first, then the one whose cycles made
        tokens faster in this generation, the other again every :data:`EXPLORE` cycles."""
        self._cycle += 1
        tree, chain = self.rate("tree"), self.rate("chain")
        if tree is None or chain is None:
            return tree is None
        better = tree > MARGIN * chain  # the chain unless the tree is clearly faster
        if better != self._leader:  # the other mode took the lead: look back at the loser soon
            self._leader, self.explore_every = better, EXPLORE
        if self._cycle % self.explore_every:
            return better
        self.explore_every = min(2 * self.explore_every, EXPLORE_MAX)  # it stayed behind: look less often
        return not better

    def finish(self, tree: bool, emitted: int, accepted: int) -> None:
        """A cycle that drafted a ``tree`` (else the chain) ended with ``emitted`` tokens, ``accepted`` of them
        drafted: its tokens and time join that mode's running totals (older cycles weigh less: :data:`DECAY`); a
        tree's calibrates the draft's confidence too."""
        cycle_s = time.perf_counter() - self._marks[0]
        mode = "tree" if tree else "chain"
        tokens, seconds = self._totals.get(mode, (0.0, 0.0))
        self._totals[mode] = (DECAY * tokens + emitted, DECAY * seconds + cycle_s)
        if not tree:
            self.chains += 1
            return
        self.trees += 1
        self.cycle_s = cycle_s if self.cycle_s is None else 0.8 * self.cycle_s + 0.2 * cycle_s
        self.per_cycle = 0.9 * self.per_cycle + 0.1 * (accepted + 1)
        if self._predicted > 0:
            ratio = accepted / self._predicted
            self.calibration = min(2.0, max(0.05, 0.9 * self.calibration + 0.1 * ratio))

    def rate(self, mode: str) -> float | None:
        """Tokens per second of this generation's ``"tree"`` or ``"chain"`` cycles (None before the first)."""
        if mode not in self._totals:
            return None
        tokens, seconds = self._totals[mode]
        return tokens / max(seconds, 1e-9)

    def summary(self) -> dict:
        """What auto chose over the generation: the shape, the median N and depth, the calibration."""
        def median(values):
            return sorted(values)[len(values) // 2] if values else None

        return {"shape": str(self.shape), "tree_cycles": self.trees, "chain_cycles": self.chains,
                "tree_rate": _rounded(self.rate("tree")), "chain_rate": _rounded(self.rate("chain")),
                "median_tokens": median(self.chosen), "median_depth": median(self.depths),
                "calibration": round(self.calibration, 3), "curve_ms": {n: round(s * 1000, 2) for n, s in self.curve.items()}}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


_LEARNED: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()  # draft -> {key: TreeBudget}


def budget_for(target, draft=None, key: tuple = ()) -> TreeBudget:
    """The :class:`TreeBudget` of ``target`` on this machine (its curve measured once and cached). With a ``draft``,
    what the last generation of the same ``key`` (strategy, sampling, lookup) learned on this draft carries over:
    the modes' rates, the calibration and the growth's times (a new generation starts where the last left off)."""
    curve, _ = load_curve(target)
    learned = None if draft is None else _LEARNED.setdefault(draft, {})
    old = None if learned is None else learned.get(key)
    budget = TreeBudget(curve) if old is None else TreeBudget(
        curve, old.calibration, old.per_cycle, old.depth_s, old.cycle_s, _totals=dict(old._totals),
        explore_every=old.explore_every, _leader=old._leader)
    if learned is not None:
        learned[key] = budget
    return budget


__all__ = ["SIZES", "TreeBudget", "budget_for", "curve_key", "load_curve", "measure_curve"]
