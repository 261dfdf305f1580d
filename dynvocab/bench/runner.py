"""Run several strategies over several prompts on one loaded session; results as data.

Rows are our strategies (through the one speculative loop) and transformers' own decoders (``hf-assisted``,
``hf-lookup``, see :mod:`dynvocab.bench.hf_baselines`), all on the same loaded models and timed the same way.
Replayed conversations (multiturn, topic-switch) feed an answer back before each next user turn: ``ar``'s
answer when ``ar`` is in the run (so every row sees the same context), else each row's own.

Each draft step's active set is recorded by :class:`PolicyRecorder`, a pass-through proxy around the strategy's
policy (so the loop stays untouched): it gives the largest active set and, with ``coverage``, the target
probability mass inside the active set and Recall@k of the target's top-k at every verified position.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from dynvocab.errors import DynvocabError
from dynvocab.bench.hf_baselines import HF_ROWS, LOOKUP_TOKENS, hf_generate
from dynvocab.runtime.loop import DecodeConfig
from dynvocab.bench.summary import EXTRA_KEYS, RECALL_KS, summarize
from dynvocab.runtime.policies.base import CycleReport, VocabPolicy
from dynvocab.bench.prompts import PromptRow
from dynvocab.runtime.prompts import encode_prompt
from dynvocab.runtime.session import Session
from dynvocab.runtime.strategies import StrategyOptions, make_policy, parse_strategies
from dynvocab.bench.tasks import HISTORY_CHARS, BenchItem, as_item

SPEEDUP_BASES = ("ar", "full")
SEED_KEYS = ("tokens_per_s", "mean_accepted_length", "speedup_vs_ar", "speedup_vs_full")


@dataclass(frozen=True)
class BenchConfig:
    """What a bench run covers."""

    strategies: tuple[str, ...] = ("ar", "full")
    decode: DecodeConfig = DecodeConfig()
    options: StrategyOptions = StrategyOptions()
    chat_template: bool = True
    seeds: tuple[int, ...] = ()  # several seeds: every row once per seed (default: decode.seed only)
    coverage: bool = False  # record target mass and Recall@k of the active sets (costs analysis time, subtracted)
    recall_ks: tuple[int, ...] = RECALL_KS
    lookup_tokens: int = LOOKUP_TOKENS
    history_chars: int = HISTORY_CHARS


def parse_rows(text: str) -> list[str]:
    """Split ``a,b,c`` into bench rows: runtime strategies (checked by the runtime) and the hf rows."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    ours = [n for n in names if n not in HF_ROWS]
    if ours or not names:
        parse_strategies(",".join(ours))
    if len(set(names)) != len(names):
        raise DynvocabError(f"--strategies names a row twice: {text}")
    return names


def needs_draft(strategies) -> bool:
    """Whether any row needs the draft model."""
    return any(s not in ("ar", "hf-lookup") for s in strategies)


def runnable_strategies(session: Session, cfg: BenchConfig, skip: bool) -> tuple[BenchConfig, list[str]]:
    """Build each strategy's policy once before the run; one that cannot be built fails now, or is dropped with a
    note when ``skip`` (``--quick``). Returns the config to run and the notes."""
    keep, notes = [], []
    for name in cfg.strategies:
        if name == "hf-assisted" and session.draft is not None and session.draft.hf_model is None:
            msg = f"hf-assisted needs a draft model; transformers cannot assist with an {session.draft.label}"
            if not skip:
                raise DynvocabError(msg)
            notes.append(f"skipped {name}: {msg}")
            continue
        if name in ("ar", *HF_ROWS) or session.draft is None:
            keep.append(name)
            continue
        try:
            policy = make_policy(name, cfg.options, session.policy_context())
            if policy is not None:
                policy.close()
            keep.append(name)
        except DynvocabError as exc:
            if not skip:
                raise
            notes.append(f"skipped {name}: {exc}")
    return replace(cfg, strategies=tuple(keep)), notes


class PolicyRecorder:
    """A pass-through proxy around a policy that records what the loop is handed.

    Every call reaches the wrapped policy unchanged (``active_ids`` returns the very same object, so the packed
    head's reuse still works; attributes and methods it does not define, such as ``prefill_logits``, are the wrapped
    policy's). Per draft step it records the active-set size; with ``coverage`` it scores each verified position on
    the accepted path that had a draft step — the target's probability mass inside that step's active set and the
    share of the target's top-k inside it — before the wrapped policy observes the cycle (a policy may update its
    active set in place there).
    """

    def __init__(
        self, inner: VocabPolicy, vocab_size: int, coverage: bool = False, ks: tuple[int, ...] = RECALL_KS,
        temperature: float = 0.0,
    ):
        self.inner = inner
        self.vocab_size = vocab_size  # rows of the draft head; None active set = these rows
        self.coverage = coverage
        self.ks = ks
        self.temperature = temperature
        self.sizes: list[int] = []  # active-set size per draft step
        self.mass: list[float] = []  # target mass inside the active set, per scored position
        self.hits: dict[int, list[float]] = {k: [] for k in ks}  # share of target top-k inside, per position
        self.analysis_s = 0.0  # time spent scoring (inside the loop's wall clock; the bench subtracts it)
        self._steps: list = []  # this cycle's active sets, by draft step

    def __getattr__(self, name):  # only called for names the proxy itself lacks
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def prefill(self, prompt_ids, target_logits, target_hidden) -> None:
        self.inner.prefill(prompt_ids, target_logits, target_hidden)

    def active_ids(self, step: int, hidden=None, token=None):
        ids = self.inner.active_ids(step, hidden, token)
        if step == 0:
            self._steps = []
        self._steps.append(ids)
        self.sizes.append(ids.size)
        return ids

    def observe(self, cycle: CycleReport) -> None:
        if self.coverage and self._steps:
            start = time.perf_counter()
            self.score(cycle)
            self.analysis_s += time.perf_counter() - start
        self._steps = []
        self.inner.observe(cycle)

    def close(self) -> None:
        self.inner.close()

    @torch.inference_mode()
    def score(self, cycle: CycleReport) -> None:
        """Score the on-path positions of ``cycle`` against the active sets recorded for its draft steps."""
        n = min(cycle.accepted + 1, len(cycle.draft_tokens), len(cycle.emitted), len(self._steps))
        if n <= 0:
            return
        logits = cycle.target_logits[:n].float()  # [n, V_target]
        if self.temperature > 0:
            logits = logits / self.temperature
        p = torch.softmax(logits, dim=-1)  # [n, V_target]
        for j in range(n):
            inside = self._steps[j].mask(p.shape[-1], p.device)  # [V_target] bool
            self.mass.append(float(p[j][inside].sum()))
            for k in self.ks:
                top = logits[j].topk(min(k, logits.shape[-1])).indices  # [k]
                self.hits[k].append(float(inside[top].float().mean()))

    def metrics(self) -> dict:
        """The extra per-generation figures: largest active set, target mass, Recall@k (None when not recorded)."""
        out = {key: None for key in EXTRA_KEYS}
        out["max_active_vocab"] = max(self.sizes) if self.sizes else None
        if self.coverage and self.mass:
            out["target_mass"] = round(statistics.fmean(self.mass), 5)
            for k in self.ks:
                out[f"recall_at_{k}"] = round(statistics.fmean(self.hits[k]), 5)
            out["scored_positions"] = len(self.mass)
        out["analysis_s"] = round(self.analysis_s, 5) if self.coverage else None
        return out


def generate_row(
    session: Session, strategy: str, prompt_ids: list[int], decode: DecodeConfig, cfg: BenchConfig
) -> tuple[list[int], dict]:
    """One row on one prompt: ``(new token ids, metrics dict)`` with every metrics key present."""
    if strategy in HF_ROWS:
        token_ids, metrics = hf_generate(session, strategy, prompt_ids, decode, cfg.lookup_tokens)
        return token_ids, {**metrics, **{key: None for key in EXTRA_KEYS}}
    if strategy == "ar":
        result = session.generate(prompt_ids, "ar", decode, cfg.options)
        return result.token_ids, {**result.metrics.as_dict(), **{key: None for key in EXTRA_KEYS}}
    recorders: list[PolicyRecorder] = []

    def record(policy):
        recorders.append(PolicyRecorder(policy, session.draft.vocab_size, cfg.coverage, cfg.recall_ks, decode.temperature))
        return recorders[-1]

    result = session.generate(prompt_ids, strategy, decode, cfg.options, wrap_policy=record)
    recorder = recorders[0]
    metrics = {**result.metrics.as_dict(), **recorder.metrics()}
    if recorder.coverage and recorder.analysis_s:
        # Scoring ran inside the loop's clock; take it out so --coverage timings stay comparable.
        wall = max(metrics["wall_s"] - recorder.analysis_s, 1e-9)
        metrics["wall_s"] = round(wall, 5)
        metrics["policy_s"] = round(max(metrics["policy_s"] - recorder.analysis_s, 0.0), 5)
        metrics["tokens_per_s"] = round(metrics["new_tokens"] / wall, 5)
    return result.token_ids, metrics


def run_bench(
    session: Session,
    prompts: list[PromptRow | BenchItem],
    cfg: BenchConfig,
    on_result: Callable[[dict], None] | None = None,
    on_start: Callable[[str, str], None] | None = None,
) -> dict:
    """Every row on every prompt (prompt-major, so a slow machine drifts evenly over strategies).

    Replayed items run turn by turn, ``ar`` first in each turn. Returns ``{"config", "generations", "summary",
    "oracle"}``: ``summary[strategy][task]`` aggregates the rows (``"all"``: every task), with speed-ups and
    exact-match rates against ``ar`` where it ran; ``oracle[task]`` is the ``full`` row without its head time.
    """
    items = [as_item(p) for p in prompts]
    order = sorted(cfg.strategies, key=lambda s: s != "ar")  # ar first: its answers are the replayed context
    seeds = cfg.seeds or (cfg.decode.seed,)
    generations = []
    for item in items:
        for seed in seeds:
            decode = replace(cfg.decode, seed=seed)
            answers: dict[str, list[str]] = {s: [] for s in order}
            for turn in range(item.turns):
                row_id = item.row_id(turn)
                for strategy in order:
                    history = answers["ar"] if "ar" in answers else answers[strategy]
                    messages = item.context(turn, history, cfg.history_chars)
                    prompt_ids = encode_prompt(session.tokenizer, messages, cfg.chat_template)
                    if on_start is not None:
                        on_start(row_id, strategy)
                    token_ids, metrics = generate_row(session, strategy, prompt_ids, decode, cfg)
                    text = session.tokenizer.decode(token_ids, skip_special_tokens=True)
                    answers[strategy].append(text)
                    record = {
                        "id": row_id,
                        "task": item.task,
                        "strategy": strategy,
                        "token_ids": token_ids,
                        "text": text,
                        "metrics": metrics,
                        "item": item.id,
                        "turn": turn + 1,
                        "seed": seed,
                        "prompt_tokens": len(prompt_ids),
                    }
                    if item.labels:
                        record["segment"] = item.labels[turn]
                    generations.append(record)
                    if on_result is not None:
                        on_result(record)
    return bench_results(session, cfg, generations)


def bench_results(session: Session, cfg: BenchConfig, generations: list[dict]) -> dict:
    """``run_bench``'s result for the rows in ``generations`` (all of them, or those finished before a Ctrl-C)."""
    seeds = cfg.seeds or (cfg.decode.seed,)
    return {
        "config": {
            "strategies": list(cfg.strategies),
            "gamma": cfg.decode.gamma,
            "stop_below": cfg.decode.stop_below,
            "branch_below": cfg.decode.branch_below,
            "max_new_tokens": cfg.decode.max_new_tokens,
            "temperature": cfg.decode.temperature,
            "top_p": cfg.decode.top_p,
            "seed": cfg.decode.seed,
            "seeds": list(seeds),
            "device": session.device,
            "dtype": session.dtype,
            "draft_step_dtype": session.draft_step_dtype,
            "draft": None if session.draft is None else session.draft.label,
            "prepacked": session.prepacked,
            "coverage": cfg.coverage,
            "recall_ks": list(cfg.recall_ks) if cfg.coverage else [],
            "lookup_tokens": cfg.lookup_tokens,
            "chat_template": cfg.chat_template,
            "history_chars": cfg.history_chars,
            "threads": torch.get_num_threads(),
        },
        "generations": generations,
        "summary": summarize_bench(generations, cfg.strategies, greedy=cfg.decode.temperature == 0),
        "oracle": oracle_summary(generations),
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
    seed; ``None`` when sampling) with ``diverged_from_ar`` (rows that differ) and ``first_divergence`` (mean index
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
            same = [g["token_ids"] == a["token_ids"] for g, a in pairs]
            s["matches_ar"] = round(sum(same) / len(same), 4) if greedy else None
            s["diverged_from_ar"] = len(same) - sum(same)
            first = [_first_difference(g["token_ids"], a["token_ids"]) for (g, a), ok in zip(pairs, same) if not ok]
            s["first_divergence"] = round(statistics.fmean(first), 1) if first else None


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
