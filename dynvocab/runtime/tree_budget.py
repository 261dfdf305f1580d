"""``--tree auto``: a draft tree fitted to the machine's own verification cost.

The target's pass over ``1 + N`` tokens (the root and N drafted nodes) is timed once per target, dtype, device, CPU
and thread count at the sizes that matter (:data:`SIZES`) and kept in the model cache
(``$DYNVOCAB_CACHE/verify-cost/``, written whole or not at all). On a GPU a 60-token pass costs what a 1-token one
does; on two CPU cores it does not (shared/DESIGN.md, "Draft trees on a CPU"), so the tree must be sized to the
curve.

The growth shape (:attr:`TreeBudget.shape`): depth :data:`AUTO_DEPTH` (the chain's γ), top-k 4 where the curve is
flat up to 16 tokens, else 2, and at most the largest N whose pass costs :data:`FLAT` × a 1-token pass or less
(never fewer than the depth). Each cycle then verifies the N best candidates that maximise the expected tokens
per second, ``(1 + a · Σ_{i ≤ N} p_i) / (g + c(N))``, where ``p_i`` is the draft's cumulative probability of the
i-th best node (EAGLE-2: a good estimate of its acceptance), ``a`` the calibration of those estimates against the
acceptances seen so far in the generation, ``c(N)`` the measured pass cost and ``g`` the draft's growth time,
relative to a 1-token pass. Where a chain-sized tree is best, that is what is verified.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dynvocab.files import write_atomic
from dynvocab.runtime.tree_shape import TreeShape

SIZES = (1, 2, 4, 8, 16, 32, 64)  # drafted tokens N per pass timed (the pass holds the root too)
AUTO_DEPTH = 6  # the chain's γ (loop.DEFAULT_GAMMA)
FLAT = 1.5  # the largest tree auto grows: its pass costs at most this many 1-token passes
CONTEXT = 256  # tokens in the cache while the curve is timed
REPEATS = 3  # timed passes per size (the median counts)
GROWTH = 1.0  # the draft's growth time in 1-token passes, before a cycle has measured it


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    """Chooses ``--tree auto``'s growth shape once and each cycle's tokens (see the module's docstring).
    ``curve``: seconds of a pass by drafted tokens N."""

    curve: dict[int, float]
    calibration: float = 1.0  # accepted tokens per unit of predicted acceptance (running)
    growth: float = GROWTH  # the draft's growth time, in 1-token passes (running)
    chosen: list[int] = field(default_factory=list)
    _predicted: list[float] = field(default_factory=list)  # per verified node, in choose order, of the last cycle
    _started: float | None = None

    @property
    def relative(self) -> dict[int, float]:
        """The curve relative to a 1-token pass."""
        one = self.curve[min(self.curve)]
        return {n: s / one for n, s in sorted(self.curve.items())}

    @property
    def shape(self) -> TreeShape:
        """The growth shape: depth :data:`AUTO_DEPTH`, top-k 4 where 16 tokens cost at most :data:`FLAT` passes
        (else 2), and up to the largest N within :data:`FLAT` (at least the depth)."""
        rel = self.relative
        flat = max([n for n, r in rel.items() if r <= FLAT], default=1)
        topk = 4 if rel.get(16, math.inf) <= FLAT else 2
        shape = TreeShape(AUTO_DEPTH, topk, 1)
        return TreeShape(AUTO_DEPTH, topk, min(shape.candidates, max(flat, AUTO_DEPTH)))

    def cost(self, n: int) -> float:
        """A pass over ``n`` drafted tokens, in 1-token passes (linear between the timed sizes)."""
        rel = self.relative
        sizes = sorted(rel)
        if n <= sizes[0]:
            return rel[sizes[0]]
        for lo, hi in zip(sizes, sizes[1:]):
            if n <= hi:
                return rel[lo] + (rel[hi] - rel[lo]) * (n - lo) / (hi - lo)
        return rel[sizes[-1]] * n / sizes[-1]

    def describe(self) -> str:
        """One line: the shape chosen and why."""
        rel, shape = self.relative, self.shape
        points = ", ".join(f"{n}: {rel[n]:.2f}×" for n in (4, 8, 16, 32, 64) if n in rel)
        return (f"tree auto: grow {shape.depth}x{shape.topk}, verify up to {shape.tokens} tokens, the best N each "
                f"cycle by the draft's confidence: a pass of N drafted tokens costs ({points}) one token's here")

    def tokens(self, candidates, extra: bool = False) -> int:
        """This cycle's N: the count of best candidates that maximises expected tokens per unit of time."""
        if self._started is not None:
            self.growth = 0.8 * self.growth + 0.2 * (time.perf_counter() - self._started) / self.curve[min(self.curve)]
        limit = self.shape.tokens
        scores = sorted((s for s in candidates.scores if math.isfinite(s)), reverse=True)[:limit]
        best, best_rate, total = 1, -1.0, 0.0
        extra_cost = AUTO_DEPTH if extra else 0
        for n, score in enumerate(scores, start=1):
            total += math.exp(score)
            rate = (1.0 + self.calibration * total) / (self.growth + self.cost(n + extra_cost))
            if rate > best_rate:
                best, best_rate = n, rate
        self._predicted = [math.exp(s) for s in scores[:best]]
        self.chosen.append(best)
        return best

    def start(self) -> None:
        """Mark the start of a cycle's growth (its time updates :attr:`growth`)."""
        self._started = time.perf_counter()

    def observe(self, accepted: int) -> None:
        """Calibrate the draft's confidence against the ``accepted`` tokens of the tree just verified."""
        predicted = sum(self._predicted)
        if predicted > 0:
            self.calibration = min(2.0, max(0.05, 0.9 * self.calibration + 0.1 * accepted / predicted))


def budget_for(target, status=None) -> TreeBudget:
    """The :class:`TreeBudget` of ``target`` on this machine (its curve measured once and cached)."""
    curve, _ = load_curve(target, status)
    return TreeBudget(curve)


__all__ = ["SIZES", "TreeBudget", "budget_for", "curve_key", "load_curve", "measure_curve"]
