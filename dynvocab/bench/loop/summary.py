"""Bench summaries: every aggregation of bench results lives here.

:func:`summarize` aggregates per-generation metrics dicts (:class:`dynvocab.runtime.decoding.metrics.Metrics`);
:func:`summarize_bench` and :func:`oracle_summary` aggregate a run's generation records per strategy and task.
"""

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
SPEEDUP_BASES = ("ar", "full")
SEED_KEYS = ("tokens_per_s", "mean_accepted_length", "speedup_vs_ar", "speedup_vs_full")


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
    for key in ("lookup_cycles", "lookup_drafted", "lookup_accepted"):  # X+ngram rows' cycles drafted by lookup
        out[key] = sum(r.get(key) or 0 for r in rows)
    out.update(tree_figures(rows, cycles, out["head_s"]))
    for key in COVERAGE_KEYS:
        out[key] = _mean((r.get(key) for r in rows), 4)
    positions = [r.get("accept_by_position") or [] for r in rows]
    width = max(len(p) for p in positions)
    out["accept_by_position"] = [
        round(statistics.fmean([p[j] for p in positions if len(p) > j]), 4) for j in range(width)
    ]
    return out


def tree_figures(rows: list[dict], cycles: int, head_s: float | None) -> dict:
    """What a row's draft trees did (``--tree``, :mod:`dynvocab.runtime.trees.growth`): its tree cycles, drafted
    tokens verified per tree cycle, head calls and head ms per cycle (chain and tree cycles alike: a call per
    step or depth), the share of accepted tokens that lay off the draft's main path, and ``--tree auto``'s choices."""
    trees = sum(r.get("tree_cycles") or 0 for r in rows)
    calls = sum(r.get("draft_steps") or 0 for r in rows)  # one head call per chain step and per tree depth
    accepted = sum(r["new_tokens"] - (r["cycles"] or 0) for r in rows if r.get("tree_cycles"))
    autos = [r["tree_auto"] for r in rows if r.get("tree_auto")]
    shapes = sorted({r["tree"] for r in rows if r.get("tree")})
    return {
        "tree": ",".join(shapes) or None,
        "tree_cycles": trees,
        "tree_tokens_per_cycle": round(sum(r.get("tree_tokens") or 0 for r in rows) / trees, 3) if trees else None,
        "head_calls_per_cycle": round(calls / cycles, 3) if cycles and calls else None,
        "head_ms_per_cycle": round(1e3 * head_s / cycles, 3) if cycles and head_s is not None else None,
        "off_main_share": round(sum(r.get("off_main") or 0 for r in rows) / accepted, 4) if accepted > 0 else None,
        "auto_tree_cycles": sum(a["tree_cycles"] for a in autos) if autos else None,
        "auto_chain_cycles": sum(a["chain_cycles"] for a in autos) if autos else None,
    }


def _ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def _summarize(records: list[dict]) -> dict:
    return summarize([r["metrics"] for r in records])


def _groups(generations: list[dict], strategy: str) -> dict[str, list[dict]]:
    rows = [g for g in generations if g["strategy"] == strategy]
    groups = {task: [g for g in rows if g["task"] == task] for task in sorted({g["task"] for g in rows})}
    groups["all"] = rows
    return groups


def summarize_bench(generations: list[dict], strategies: tuple[str, ...], greedy: bool = True) -> dict:
    """Aggregate per strategy and task; add speed-ups, exact-match rates against ``ar``, and seed spread.

    ``summary[s][task]`` (and ``["all"]``): :func:`summarize` of the rows, ``speedup_vs_ar`` / ``speedup_vs_full``
    (ratio of token-weighted tokens/s), ``matches_ar`` (share of rows identical to ``ar``'s on the same prompt and
    seed — by text for rows whose record says ``compare: text``, the llama.cpp rows; ``None`` when sampling) with ``diverged_from_ar`` (rows that differ) and ``first_divergence`` (mean index
    of the first differing token), and with several seeds ``seed_stats``
    (mean and std over seeds of the per-seed figures).
    """
    summary: dict = {}
    for strategy in strategies:
        summary[strategy] = {task: _summarize(rows) for task, rows in _groups(generations, strategy).items()}
    add_speedups(summary)
    _add_ar_matches(summary, generations, strategies, greedy)
    _add_seed_stats(summary, generations, strategies)
    return summary


def add_speedups(summary: dict) -> None:
    """``speedup_vs_<base>`` per strategy and task: its tokens/s over the base's on the same task."""
    for base in SPEEDUP_BASES:
        if base not in summary:
            continue
        for per in summary.values():
            for task, s in per.items():
                ref = summary[base].get(task)
                if s and ref:
                    s[f"speedup_vs_{base}"] = _ratio(s["tokens_per_s"], ref["tokens_per_s"])


def _add_ar_matches(summary: dict, generations: list[dict], strategies, greedy: bool) -> None:
    ar = {(g["id"], g.get("seed")): g for g in generations if g["strategy"] == "ar"}
    if not ar:
        return
    for strategy in strategies:
        for task, rows in _groups(generations, strategy).items():
            pairs = [(g, ar[(g["id"], g.get("seed"))]) for g in rows if (g["id"], g.get("seed")) in ar]
            s = summary[strategy].get(task)
            if not s or not pairs:
                continue
            same = [_same(g, a) for g, a in pairs]
            s["matches_ar"] = round(sum(same) / len(same), 4) if greedy else None
            s["diverged_from_ar"] = len(same) - sum(same)
            first = [_first_difference(g["token_ids"], a["token_ids"]) for (g, a), ok in zip(pairs, same) if not ok]
            s["first_divergence"] = round(statistics.fmean(first), 1) if first else None


def _same(row: dict, ar: dict) -> bool:
    """Whether a row generated what ``ar`` did: its token ids, or its text where it compares by text."""
    if row.get("compare") == "text":
        return row["text"].strip() == ar["text"].strip()
    return row["token_ids"] == ar["token_ids"]


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _add_seed_stats(summary: dict, generations: list[dict], strategies) -> None:
    seeds = sorted({g.get("seed") for g in generations if g.get("seed") is not None})
    if len(seeds) < 2:
        return
    per_seed = {}
    for seed in seeds:
        rows = [g for g in generations if g.get("seed") == seed]
        per_seed[seed] = {s: {t: _summarize(r) for t, r in _groups(rows, s).items()} for s in strategies}
        add_speedups(per_seed[seed])
    for strategy in strategies:
        for task, s in summary[strategy].items():
            stats = {}
            for key in SEED_KEYS:
                values = [per_seed[seed][strategy].get(task, {}).get(key) for seed in seeds]
                values = [v for v in values if v is not None]
                if values:
                    stats[key] = {
                        "mean": round(statistics.fmean(values), 4),
                        "std": round(statistics.pstdev(values), 4) if len(values) > 1 else 0.0,
                        "values": values,
                    }
            s["seed_stats"] = stats


def oracle_summary(generations: list[dict]) -> dict:
    """The ``full`` rows with their draft-head time taken out: full-vocabulary acceptance at zero head cost.

    ``oracle[task]``: tokens/s = new tokens / (wall − head) (token-weighted, with request-level std), the mean
    accepted length of ``full``, and the speed-ups over ``ar`` / ``full`` on the same task. Empty without ``full``.
    """
    out: dict = {}
    full = _groups(generations, "full")
    if not full["all"]:
        return out
    ar = _groups(generations, "ar")
    for task, rows in full.items():
        tokens = sum(r["metrics"]["new_tokens"] for r in rows)
        wall = sum(r["metrics"]["wall_s"] - (r["metrics"]["head_s"] or 0.0) for r in rows)
        per_row = [
            r["metrics"]["new_tokens"] / w
            for r in rows
            if (w := r["metrics"]["wall_s"] - (r["metrics"]["head_s"] or 0.0)) > 0
        ]
        base = _summarize(rows)
        tps = round(tokens / wall, 4) if wall > 0 else 0.0
        entry = {
            "derived_from": "full",
            "generations": len(rows),
            "new_tokens": tokens,
            "tokens_per_s": tps,
            "tokens_per_s_std": round(statistics.pstdev(per_row), 4) if len(per_row) > 1 else 0.0,
            "wall_s": round(wall, 3),
            "mean_accepted_length": base["mean_accepted_length"],
            "mean_accepted_length_std": base["mean_accepted_length_std"],
            "accept_by_position": base["accept_by_position"],
            "speedup_vs_full": _ratio(tps, base["tokens_per_s"]),
        }
        if ar.get(task):
            entry["speedup_vs_ar"] = _ratio(tps, _summarize(ar[task])["tokens_per_s"])
        out[task] = entry
    return out
