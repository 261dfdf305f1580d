"""The target's verification curve: seconds of one pass over ``1 + N`` tokens (the root and N drafted nodes), timed
once per target, dtype, device, CPU and thread count at the sizes that matter (:data:`SIZES`) and kept in the model
cache (``$DYNVOCAB_CACHE/verify-cost/``, written whole or not at all). On a GPU a 60-token pass costs what a 1-token
one does; on two CPU cores it does not (shared/DESIGN.md, "Draft trees on a CPU"), so ``--tree auto``
(:mod:`dynvocab.runtime.trees.budget`) sizes its trees to this curve.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from dynvocab.files import write_atomic
from dynvocab.models.loading import cpu_name

SIZES = (1, 2, 4, 8, 16, 32, 64)  # drafted tokens N per pass timed (the pass holds the root too)
CONTEXT = 256  # tokens in the cache while the curve is timed
REPEATS = 5  # timed passes per size (the median counts)


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


def relative(curve: dict[int, float]) -> dict[int, float]:
    """``curve`` relative to a 1-token pass."""
    one = curve[min(curve)]
    return {n: s / one for n, s in sorted(curve.items())}


def pass_seconds(curve: dict[int, float], n: int) -> float:
    """Seconds of a pass over ``n`` drafted tokens (linear between the timed sizes, proportional past the last)."""
    sizes = sorted(curve)
    if n <= sizes[0]:
        return curve[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if n <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)
    return curve[sizes[-1]] * n / sizes[-1]


__all__ = ["CONTEXT", "REPEATS", "SIZES", "curve_key", "curve_path", "load_curve", "measure_curve", "pass_seconds",
           "relative"]
