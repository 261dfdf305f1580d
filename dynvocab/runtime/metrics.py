"""Per-generation metrics as data (the CLI renders them) and their aggregation."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class Metrics:
    """What one generation measured; field names are the JSON contract in DESIGN.md."""

    new_tokens: int = 0
    cycles: int = 0
    mean_accepted_length: float = 0.0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    head_s: float = 0.0
    mean_active_vocab: float | None = None
    coverage: float | None = None
    accept_by_position: list[float] = field(default_factory=list)
    draft_steps: int = 0
    head_rows_copied: int = 0

    def as_dict(self) -> dict:
        """A JSON-ready dict (floats rounded for readability)."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 5)
        out["accept_by_position"] = [round(v, 4) for v in self.accept_by_position]
        return out


def summarize(rows: list[dict]) -> dict:
    """Aggregate metric dicts of several generations: token-weighted rates, means and request-level std."""
    if not rows:
        return {}
    tokens = sum(r["new_tokens"] for r in rows)
    cycles = sum(r["cycles"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    tps = [r["tokens_per_s"] for r in rows]
    mal = [r["mean_accepted_length"] for r in rows]
    out = {
        "generations": len(rows),
        "new_tokens": tokens,
        "cycles": cycles,
        "mean_accepted_length": round(tokens / cycles, 4) if cycles else 0.0,
        "mean_accepted_length_std": round(statistics.pstdev(mal), 4) if len(mal) > 1 else 0.0,
        "tokens_per_s": round(tokens / wall, 4) if wall else 0.0,
        "tokens_per_s_std": round(statistics.pstdev(tps), 4) if len(tps) > 1 else 0.0,
        "wall_s": round(wall, 3),
    }
    for key in ("prefill_s", "draft_s", "verify_s", "head_s"):
        out[key] = round(sum(r[key] for r in rows), 4)
    active = [r["mean_active_vocab"] for r in rows if r["mean_active_vocab"] is not None]
    out["mean_active_vocab"] = round(statistics.fmean(active), 1) if active else None
    cover = [r["coverage"] for r in rows if r["coverage"] is not None]
    out["coverage"] = round(statistics.fmean(cover), 4) if cover else None
    width = max(len(r["accept_by_position"]) for r in rows)
    out["accept_by_position"] = [
        round(statistics.fmean([r["accept_by_position"][j] for r in rows if len(r["accept_by_position"]) > j]), 4)
        for j in range(width)
    ]
    return out
