"""Rendering of bench results: rich tables, CSV, plot; every file written atomically (temp file + rename)."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from rich.table import Table

from dynvocab.files import write_atomic
from dynvocab.bench.engines.llamacpp import LLAMA_ROWS
from dynvocab.bench.loop.summary import RECALL_KS

ORACLE = "oracle"
CSV_COLUMNS = (
    "strategy", "task", "derived_from", "generations", "new_tokens", "tokens_per_s", "tokens_per_s_std",
    "speedup_vs_ar", "speedup_vs_full", "mean_accepted_length", "mean_accepted_length_std", "accept_by_position",
    "wall_s", "prefill_share", "draft_share", "verify_share", "head_share", "policy_share", "head_share_of_draft",
    "draft_steps", "policy_ms_per_step", "head_ms_per_step",
    "mean_active_vocab", "max_active_vocab", "active_hit_rate", "coverage", "leaves", "leaf_hits",
    "lookup_cycles", "lookup_drafted", "lookup_accepted", "tree", "tree_cycles", "tree_tokens_per_cycle",
    "head_calls_per_cycle", "head_ms_per_cycle", "off_main_share", "auto_tree_cycles", "auto_chain_cycles", "target_mass",
    *(f"recall_at_{k}" for k in RECALL_KS),
    "matches_ar", "diverged_from_ar", "first_divergence",
    "tokens_per_s_seed_mean", "tokens_per_s_seed_std", "mean_accepted_length_seed_mean",
    "mean_accepted_length_seed_std",
)


def models_line(cfg: dict) -> str:
    """``float32 on cpu`` plus the draft's step dtype where it differs and whether the models were prepacked."""
    line = f"{cfg['dtype']} on {cfg['device']}"
    if cfg.get("draft_weights") not in (None, cfg["dtype"]):
        line += f" (draft weights {cfg['draft_weights']})"
    if cfg.get("draft_bytes"):
        b = cfg["draft_bytes"]
        line += f", draft {b['weights'] / 2**20:,.0f} MiB + {b['prepared'] / 2**20:,.0f} MiB prepared"
    if cfg.get("prepacked"):
        line += " · prepacked"
    if cfg.get("draft") not in (None, "draft model"):
        line += f" · {cfg['draft']} draft"
    return line


def rows_of(results: dict) -> list[tuple[str, str, dict]]:
    """``(strategy, task, figures)`` for every strategy × task of the summary, then the oracle's."""
    out = [(s, task, fig) for s, per in results["summary"].items() for task, fig in per.items() if fig]
    out += [(ORACLE, task, fig) for task, fig in (results.get("oracle") or {}).items()]
    return out


def _fmt(value, spec: str) -> str:
    return "–" if value is None else spec.format(value)


def _pm(mean, std, spec: str) -> str:
    return "–" if mean is None else f"{spec.format(mean)} ± {spec.format(std or 0.0)}"


def _shares(s: dict) -> str:
    parts = [s.get(k) for k in ("draft_share", "verify_share", "head_share")]
    if all(p is None for p in parts):
        return "–"
    return " / ".join("–" if p is None else f"{100 * p:.0f}" for p in parts)


def _per_step(s: dict) -> str:
    policy, head = s.get("policy_ms_per_step"), s.get("head_ms_per_step")
    if head is None:
        return "–"
    return f"{_fmt(policy, '{:.2f}')} / {head:.2f}"


def _positions(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values[:6]) + (" …" if len(values) > 6 else "") if values else "–"


def _vocab(s: dict) -> str:
    mean, peak = s.get("mean_active_vocab"), s.get("max_active_vocab")
    if mean is None:
        return "–"
    return f"{mean:,.0f}" if peak is None or peak == round(mean) else f"{mean:,.0f} / {peak:,}"


def draft_line(cfg: dict) -> str:
    """How drafts were made: the longest draft, the early stop and the tree leaves (older JSON has neither)."""
    parts = [f"γ≤{cfg['gamma']}" if cfg.get("stop_below") else f"γ={cfg['gamma']}"]
    if cfg.get("stop_below"):
        parts.append(f"stop<{cfg['stop_below']:g}")
    if cfg.get("branch_below") and not cfg.get("temperature"):
        parts.append(f"leaves<{cfg['branch_below']:g}")
    return " ".join(parts)


def render_tables(results: dict) -> list[Table]:
    """The main table (strategies as rows, all tasks together, the oracle last), and with several tasks a
    tokens/s · MAL table per task."""
    cfg = results["config"]
    seeds = cfg.get("seeds") or [cfg.get("seed")]
    sampling = f"T={cfg['temperature']} · seeds {','.join(map(str, seeds))}" if cfg["temperature"] else "greedy"
    title = (
        f"dynvocab bench · {draft_line(cfg)} · {cfg['max_new_tokens']} new tokens · {sampling} · "
        f"{models_line(cfg)}"
    )
    scored = cfg.get("coverage")  # --coverage: the active sets' target mass and Recall@k were scored
    looked = any(s.get("lookup_cycles") for _, _, s in rows_of(results))  # X+ngram rows ran
    table = Table(title=title, title_justify="left")
    columns = ["row", "tok/s", "×ar", "×full", "MAL", "accept by position", "draft/verify/head %",
               "policy/head ms/step", "vocab mean/max", "hit", "leaf hits", "=ar"]
    if looked:
        columns += ["lookup"]
    if scored:
        columns += ["mass", "R@1", "R@10", "R@256"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("row", "accept by position") else "right", no_wrap=True)
    for strategy, task, s in rows_of(results):
        if task != "all":
            continue
        oracle = strategy == ORACLE
        cells = [
            "oracle estimate (full − head)" if oracle else strategy,
            _pm(s["tokens_per_s"], s.get("tokens_per_s_std"), "{:.2f}"),
            _fmt(s.get("speedup_vs_ar"), "{:.2f}×"),
            _fmt(s.get("speedup_vs_full"), "{:.2f}×"),
            _pm(s["mean_accepted_length"], s.get("mean_accepted_length_std"), "{:.2f}"),
            _positions(s.get("accept_by_position") or []),
            "–" if oracle else _shares(s),
            "–" if oracle else _per_step(s),
            "–" if oracle else _vocab(s),
            _fmt(s.get("active_hit_rate", s.get("coverage")), "{:.1%}"),
            _leaves(s),
            _fmt(s.get("matches_ar"), "{:.0%}"),
        ]
        if looked:
            cells.append(_lookup(s))
        if scored:
            cells += [_fmt(s.get(k), "{:.1%}") for k in ("target_mass", "recall_at_1", "recall_at_10", "recall_at_256")]
        table.add_row(*cells, style="dim" if oracle else None)
    tables = [table]
    trees = [(name, per["all"]) for name, per in results["summary"].items() if per.get("all", {}).get("tree_cycles")]
    if trees:
        tables.append(_tree_table(trees))
    tasks = [t for t in next(iter(results["summary"].values()), {}) if t != "all"]
    if len(tasks) > 1:
        per = [*results["summary"].items(), (ORACLE, results.get("oracle") or {})]
        tables.append(_per_task_table(tasks, [(name, p) for name, p in per if p]))
    return tables


def _tree_table(rows: list[tuple[str, dict]]) -> Table:
    """The rows that drafted trees: their shape, tokens verified, head calls and head time per cycle, the share of
    accepted tokens off the draft's main path, and where ``auto`` drafted trees or chains."""
    table = Table(title="draft trees (--tree): per cycle", title_justify="left")
    for col in ("row", "tree", "tokens verified", "head calls", "head ms", "accepted off main path", "auto: tree/chain cycles"):
        table.add_column(col, justify="left" if col in ("row", "tree") else "right", no_wrap=True)
    for name, s in rows:
        auto = "–" if s.get("auto_tree_cycles") is None else f"{s['auto_tree_cycles']}/{s['auto_chain_cycles']}"
        table.add_row(name, s.get("tree") or "–", _fmt(s.get("tree_tokens_per_cycle"), "{:.1f}"),
                      _fmt(s.get("head_calls_per_cycle"), "{:.2f}"), _fmt(s.get("head_ms_per_cycle"), "{:.1f}"),
                      _fmt(s.get("off_main_share"), "{:.0%}"), auto)
    return table


WIDE_TASKS = 4  # more tasks than this (Spec-Bench's 13 categories): one line per task and row, not a column each


def _per_task_table(tasks: list[str], per: list[tuple[str, dict]]) -> Table:
    """Tokens/s · MAL (× ar) per task: a column per task for a few tasks, else a line per task and row."""
    def cell(s: dict | None) -> str:
        if not s:
            return "–"
        ar = f" ({s['speedup_vs_ar']:.2f}×)" if s.get("speedup_vs_ar") is not None else ""
        return f"{s['tokens_per_s']:.2f} · {s['mean_accepted_length']:.2f}{ar}"

    title = "per task: tokens/s · mean accepted length (× ar)"
    if len(tasks) > WIDE_TASKS:
        table = Table(title=title, title_justify="left")
        for col in ("task", "row", "tok/s · MAL (× ar)", "×full"):
            table.add_column(col, justify="right" if col.startswith(("tok", "×")) else "left", no_wrap=True)
        for task in tasks:
            for i, (name, p) in enumerate(per):
                s = p.get(task)
                table.add_row(task if i == 0 else "", name, cell(s), _fmt((s or {}).get("speedup_vs_full"), "{:.2f}×"),
                              style="dim" if name == ORACLE else None, end_section=i == len(per) - 1)
        return table
    table = Table(title=title, title_justify="left")
    table.add_column("row", no_wrap=True)
    for task in tasks:
        table.add_column(task, justify="right", no_wrap=True)
    for name, p in per:
        table.add_row(name, *(cell(p.get(task)) for task in tasks), style="dim" if name == ORACLE else None)
    return table


def notes(results: dict) -> list[str]:
    """Plain-language notes under the table: skipped rows, divergence from ar, what the figures mean."""
    out = list(results.get("notes") or [])
    cfg = results["config"]
    summary = results["summary"]
    if "ar" in summary and cfg["temperature"] == 0:
        diverged = {s: per["all"].get("diverged_from_ar") for s, per in summary.items() if s != "ar" and s not in LLAMA_ROWS}
        diverged = {s: n for s, n in diverged.items() if n}
        if diverged:
            why = (
                "expected in bfloat16/float16: a multi-token verification pass can break a near-tie differently"
                if cfg["dtype"] != "float32"
                else "unexpected in float32: please report it"
            )
            listed = ", ".join(f"{s} {n}/{summary[s]['all']['generations']}" for s, n in diverged.items())
            out.append(f"outputs differing from ar: {listed} ({why})")
    if cfg.get("llamacpp"):
        out.append(llamacpp_note(cfg["llamacpp"], cfg["dtype"]))
    if cfg.get("coverage"):
        out.append(
            "mass: target probability inside the active set; R@k: share of the target's top-k inside it "
            "(scoring time is taken out of the wall clock)"
        )
    out.append(
        "MAL = new tokens per target pass; shares are of wall time (head ⊂ draft); oracle estimate = full without "
        "its draft-head time (not a bound: the full head's cache misses outside its timed calls stay in); tok/s ± "
        "request-level std"
    )
    return out


def llamacpp_note(llama: dict, dtype: str) -> str:
    """What the llama.cpp rows are: other weights (the GGUF files as stored), text-compared, timed by llama.cpp."""
    return (
        f"llama.cpp rows: {llama['target']} target and {llama['draft']} draft as stored ({llama['spec_type']}), "
        f"not the {dtype} weights of the other rows, so their =ar is a same-text rate against ar; tok/s from "
        "llama.cpp's own timing lines (prefill included, loading excluded); MAL and accept by position from its "
        "drafter statistics (shares of all verification passes)"
    )


def write_csv(path: Path, results: dict) -> None:
    """One row per strategy × task (the oracle's rows carry ``derived_from = full``)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for strategy, task, s in rows_of(results):
        row = {k: s.get(k) for k in CSV_COLUMNS}
        row.update(strategy=strategy, task=task)
        row["accept_by_position"] = " ".join(f"{v:.4f}" for v in s.get("accept_by_position") or [])
        for key in ("tokens_per_s", "mean_accepted_length"):
            stats = (s.get("seed_stats") or {}).get(key)
            if stats:
                row[f"{key}_seed_mean"], row[f"{key}_seed_std"] = stats["mean"], stats["std"]
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    write_atomic(path, lambda tmp: tmp.write_text(buf.getvalue(), encoding="utf-8"))


def write_plot(path: Path, results: dict) -> None:
    """Three panels: tokens/s and mean accepted length per row (bars per task, request-level std as error bars),
    and mean active vocabulary vs mean accepted length (one point per strategy × task)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, oracle = results["summary"], results.get("oracle") or {}
    names = list(summary) + ([ORACLE] if oracle else [])
    tasks = [t for t in next(iter(summary.values()), {}) if t != "all"]
    groups = tasks + ["all"] if len(tasks) > 1 else ["all"]

    def fig(name: str, task: str) -> dict:
        return (oracle if name == ORACLE else summary[name]).get(task) or {}

    figure, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    width = 0.8 / len(groups)
    panels = (("tokens_per_s", "tokens/s"), ("mean_accepted_length", "mean accepted length"))
    for panel, (key, label) in enumerate(panels):
        ax = axes[panel]
        for g, task in enumerate(groups):
            xs = [i + (g - (len(groups) - 1) / 2) * width for i in range(len(names))]
            ys = [fig(n, task).get(key) or 0.0 for n in names]
            err = [fig(n, task).get(f"{key}_std") or 0.0 for n in names]
            ax.bar(xs, ys, width, yerr=err, capsize=2, label=task)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
        ax.set_ylabel(label)
        ax.set_title(label + " (± request-level std)")
        if len(groups) > 1:
            ax.legend(fontsize=8)
    ax = axes[2]
    markers = "osD^v<>pP*X"
    for i, name in enumerate(summary):  # colour: strategy; marker: task
        for t, task in enumerate(tasks or ["all"]):
            s = summary[name].get(task) or {}
            if s.get("mean_active_vocab") is None:
                continue
            ax.scatter(s["mean_active_vocab"], s["mean_accepted_length"], color=f"C{i % 10}",
                       marker=markers[t % len(markers)], label=f"{name} · {task}" if len(tasks) > 1 else name)
    ax.set_xscale("log")
    ax.set_xlabel("mean active vocabulary (log)")
    ax.set_ylabel("mean accepted length")
    ax.set_title("active vocabulary vs acceptance")
    if ax.collections:
        ax.legend(fontsize=7)
    cfg = results["config"]
    figure.suptitle(f"dynvocab bench · {draft_line(cfg)} · {models_line(cfg)}")
    figure.tight_layout()
    write_atomic(path, lambda tmp: figure.savefig(tmp, dpi=110, format=(Path(path).suffix.lstrip(".") or "png")))
    plt.close(figure)


def _lookup(s: dict) -> str:
    """X+ngram rows: the share of cycles whose draft was an n-gram lookup's, and its accepted of drafted tokens."""
    if not s.get("lookup_cycles"):
        return "–"
    return f"{s['lookup_cycles'] / s['cycles']:.0%} {s['lookup_accepted']}/{s['lookup_drafted']}"


def _leaves(s: dict) -> str:
    """Accepted tree leaves of those verified ("–" without leaves); accept-by-position counts chain tokens only."""
    return f"{s['leaf_hits']}/{s['leaves']}" if s.get("leaves") else "–"
