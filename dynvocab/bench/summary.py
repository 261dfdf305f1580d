"""Bench summaries: aggregating per-generation metrics dicts (:class:`dynvocab.runtime.metrics.Metrics`)."""

from __future__ import annotations

import statistics

RECALL_KS = (1, 5, 10, 256)  # Recall@k of the target's top-k inside the active set (EvoSpec Table 6: k = 256)
# --coverage figures: mean target probability mass inside the active set, per verified position, and Recall@k.
COVERAGE_KEYS = ("target_mass", *(f"recall_at_{k}" for k in RECALL_KS))
# Per-generation figures that bench adds to the metrics dict (None where a row has no such figure).
EXTRA_KEYS = (
    "max_active_vocab",  # the largest active set of any draft step
    *COVERAGE_KEYS,
    "scored_positions",  # verified positions the coverage figures average over
    "analysis_s",  # --coverage scoring time, already taken out of wall_s / tokens_per_s
)
TIME_KEYS = ("prefill_s", "draft_s", "verify_s", "head_s", "policy_s")


def _sum(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) if values else None


def _mean(values, digits: int) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), digits) if values else None


def _std(values: list[float]) -> float:
    return round(statistics.pstdev(values), 4) if len(values) > 1 else 0.0


def summarize(rows: list[dict]) -> dict:
    """Aggregate metric dicts of several generations: token-weighted rates, means and request-level std.

    Keys a row lacks or holds as None (the hf rows have no active vocabulary, …) are skipped; a figure no row has
    is None. ``*_share`` are shares of the total wall time (``head_share_of_draft``: of the draft time);
    ``policy_ms_per_step`` / ``head_ms_per_step`` divide the policy's and the head's time by the draft steps.
    """
    if not rows:
        return {}
    tokens = sum(r["new_tokens"] for r in rows)
    cycles = sum(r["cycles"] or 0 for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    tps = [r["tokens_per_s"] for r in rows]
    mal = [r["mean_accepted_length"] for r in rows]
    out = {
        "generations": len(rows),
        "new_tokens": tokens,
        "cycles": cycles,
        "mean_accepted_length": round(tokens / cycles, 4) if cycles else 0.0,
        "mean_accepted_length_std": _std(mal),
        "tokens_per_s": round(tokens / wall, 4) if wall else 0.0,
        "tokens_per_s_std": _std(tps),
        "wall_s": round(wall, 3),
    }
    for key in TIME_KEYS:
        total = _sum(r.get(key) for r in rows)
        out[key] = None if total is None else round(total, 4)
    for key in TIME_KEYS:
        share = key.replace("_s", "_share")
        out[share] = None if out[key] is None or not wall else round(out[key] / wall, 4)
    draft = out["draft_s"]
    out["head_share_of_draft"] = round(out["head_s"] / draft, 4) if draft and out["head_s"] is not None else None
    steps = _sum(r.get("draft_steps") for r in rows)
    out["draft_steps"] = steps
    for key in ("policy", "head"):  # ms per draft step: what a policy and the head cost one step
        total = out[f"{key}_s"]
        out[f"{key}_ms_per_step"] = round(1e3 * total / steps, 4) if steps and total is not None else None
    out["mean_active_vocab"] = _mean((r["mean_active_vocab"] for r in rows), 1)
    maxima = [r.get("max_active_vocab") for r in rows if r.get("max_active_vocab") is not None]
    out["max_active_vocab"] = max(maxima) if maxima else None
    out["active_hit_rate"] = _mean((r.get("active_hit_rate", r.get("coverage")) for r in rows), 4)
    out["coverage"] = out["active_hit_rate"]  # the old name, kept for readers of earlier JSON
    out["leaves"] = sum(r.get("leaves") or 0 for r in rows)
    out["leaf_hits"] = sum(r.get("leaf_hits") or 0 for r in rows)
    for key in COVERAGE_KEYS:
        out[key] = _mean((r.get(key) for r in rows), 4)
    positions = [r.get("accept_by_position") or [] for r in rows]
    width = max(len(p) for p in positions)
    out["accept_by_position"] = [
        round(statistics.fmean([p[j] for p in positions if len(p) > j]), 4) for j in range(width)
    ]
    return out
