"""Run several strategies over several prompts on one loaded session; results as data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dynvocab.runtime.loop import DecodeConfig
from dynvocab.runtime.metrics import summarize
from dynvocab.runtime.prompts import PromptRow, encode_prompt
from dynvocab.runtime.session import Session
from dynvocab.runtime.strategies import StrategyOptions


@dataclass(frozen=True)
class BenchConfig:
    """What a bench run covers."""

    strategies: tuple[str, ...] = ("ar", "full")
    decode: DecodeConfig = DecodeConfig()
    options: StrategyOptions = StrategyOptions()
    chat_template: bool = True


def run_bench(
    session: Session,
    prompts: list[PromptRow],
    cfg: BenchConfig,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """Every strategy on every prompt (prompt-major, so a slow machine drifts evenly over strategies).

    Returns ``{"config", "generations", "summary"}``; ``summary[strategy][task]`` aggregates the rows and
    ``summary[strategy]["all"]`` all tasks, with ``speedup_vs_ar`` / ``matches_ar`` where ``ar`` ran.
    """
    generations = []
    for row in prompts:
        prompt_ids = encode_prompt(session.tokenizer, row.messages, cfg.chat_template)
        for strategy in cfg.strategies:
            result = session.generate(prompt_ids, strategy, cfg.decode, cfg.options)
            record = {
                "id": row.id,
                "task": row.task,
                "strategy": strategy,
                "token_ids": result.token_ids,
                "text": session.tokenizer.decode(result.token_ids, skip_special_tokens=True),
                "metrics": result.metrics.as_dict(),
            }
            generations.append(record)
            if on_result is not None:
                on_result(record)
    return {
        "config": {
            "strategies": list(cfg.strategies),
            "gamma": cfg.decode.gamma,
            "max_new_tokens": cfg.decode.max_new_tokens,
            "temperature": cfg.decode.temperature,
            "top_p": cfg.decode.top_p,
            "seed": cfg.decode.seed,
            "device": session.device,
            "dtype": session.dtype,
        },
        "generations": generations,
        "summary": summarize_bench(generations, cfg.strategies),
    }


def summarize_bench(generations: list[dict], strategies: tuple[str, ...]) -> dict:
    """Aggregate per strategy and task; add speed-ups and exact-match rates against ``ar``."""
    summary: dict = {}
    ar_tokens = {g["id"]: g["token_ids"] for g in generations if g["strategy"] == "ar"}
    for strategy in strategies:
        rows = [g for g in generations if g["strategy"] == strategy]
        tasks = sorted({g["task"] for g in rows})
        per = {task: summarize([g["metrics"] for g in rows if g["task"] == task]) for task in tasks}
        per["all"] = summarize([g["metrics"] for g in rows])
        if ar_tokens:
            matched = [g["token_ids"] == ar_tokens[g["id"]] for g in rows if g["id"] in ar_tokens]
            per["all"]["matches_ar"] = round(sum(matched) / len(matched), 4) if matched else None
        summary[strategy] = per
    for base in ("ar", "full"):
        if base not in summary:
            continue
        base_tps = summary[base]["all"]["tokens_per_s"]
        for strategy in summary:
            if base_tps:
                summary[strategy]["all"][f"speedup_vs_{base}"] = round(summary[strategy]["all"]["tokens_per_s"] / base_tps, 4)
    return summary
