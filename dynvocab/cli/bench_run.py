"""The body of ``dynvocab bench``: choose prompts and rows, load the models once, run with a progress bar,
render the tables and write the requested files."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dynvocab.bench.report import notes, render_tables, write_atomic, write_csv, write_plot
from dynvocab.cli.common import status_printer, stdout_is_terminal
from dynvocab.errors import DynvocabError
from dynvocab.runtime.loop import DEFAULT_BRANCH_BELOW, DEFAULT_GAMMA, DEFAULT_STOP_BELOW, DecodeConfig
from dynvocab.runtime.strategies import StrategyOptions
from dynvocab.bench.tasks import TASKS, BenchItem, embedded_items, file_items

DEFAULT_ROWS = "ar,full"
DEFAULT_MAX_NEW = 64
DEFAULT_NUM_PROMPTS = 5


@dataclass(frozen=True)
class Quick:
    """``--quick``: a small run of the embedded tasks that finishes in minutes on a CPU (rows whose policy cannot
    be built here — e.g. ``fr`` without a frequency ranking — are skipped with a note)."""

    strategies: str = "ar,full,microspec,fr,hybrid"
    tasks: tuple[str, ...] = ("code", "chat")
    num_prompts: int = 1
    max_new_tokens: int = 32


@dataclass(frozen=True)
class BenchRequest:
    """What the user asked of ``dynvocab bench`` (None = the default, or ``--quick``'s)."""

    prompts: str | None = None
    strategies: str | None = None
    ids: str | None = None
    tasks: str | None = None
    num_prompts: int | None = None
    quick: bool = False
    target: str = "demo:target"
    draft: str = "demo:draft"
    device: str | None = None
    dtype: str | None = None
    draft_step_dtype: str | None = None
    prepack: bool | None = None
    bundle: str | None = None
    max_new_tokens: int | None = None
    gamma: int = DEFAULT_GAMMA
    stop_below: float = DEFAULT_STOP_BELOW
    branch_below: float = DEFAULT_BRANCH_BELOW
    temperature: float = 0.0
    seed: int = 0
    seeds: str | None = None
    coverage: bool = False
    chat_template: bool = True
    json_path: Path | None = None
    csv_path: Path | None = None
    plot_path: Path | None = None


def split(text: str | None) -> list[str] | None:
    """``a, b,c`` -> ``["a", "b", "c"]`` (None for nothing)."""
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def parse_seeds(text: str | None, seed: int) -> tuple[int, ...]:
    """``--seeds 0,1,2`` (default: ``--seed``)."""
    if not text:
        return (seed,)
    try:
        seeds = tuple(int(s) for s in split(text) or [])
    except ValueError:
        raise DynvocabError(f"--seeds must be comma-separated integers, e.g. 0,1,2 (got '{text}')") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise DynvocabError(f"--seeds must name distinct integers, e.g. 0,1,2 (got '{text}')")
    return seeds


def select_items(req: BenchRequest) -> list[BenchItem]:
    """The prompt file's items, or the embedded tasks' (``--quick``: one code and one chat prompt)."""
    quick = Quick() if req.quick else None
    tasks = split(req.tasks)
    n = req.num_prompts or (quick.num_prompts if quick else None)
    if req.prompts is not None:
        return file_items(req.prompts, split(req.ids), tasks, n)
    tasks = tasks or list(quick.tasks if quick else TASKS)
    return embedded_items(tasks, n or DEFAULT_NUM_PROMPTS, split(req.ids))


def check_outputs(*paths: Path | None) -> None:
    """Refuse output paths whose folder does not exist, before any model is loaded."""
    for path in paths:
        if path is not None and not Path(path).parent.exists():
            raise DynvocabError(f"folder {Path(path).parent} for {path.name} does not exist")


def run_command(req: BenchRequest, options: StrategyOptions) -> dict:
    """Run the bench as asked; print the tables and notes; write JSON / CSV / plot. Returns the results."""
    from dynvocab.bench.runner import BenchConfig, needs_draft, parse_rows, run_bench, runnable_strategies
    from dynvocab.runtime.session import ModelConfig, Session

    quick = Quick() if req.quick else None
    names = parse_rows(req.strategies or (quick.strategies if quick else DEFAULT_ROWS))
    seeds = parse_seeds(req.seeds, req.seed)
    check_outputs(req.json_path, req.csv_path, req.plot_path)
    if req.plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise DynvocabError("--plot needs matplotlib (the extra `plot`): pip install 'dynvocab[plot]'")
    items = select_items(req)
    max_new = req.max_new_tokens or (quick.max_new_tokens if quick else DEFAULT_MAX_NEW)
    cfg = BenchConfig(
        strategies=tuple(names),
        decode=DecodeConfig(
            gamma=req.gamma, max_new_tokens=max_new, temperature=req.temperature, seed=seeds[0],
            stop_below=req.stop_below, branch_below=req.branch_below,
        ),
        options=options,
        chat_template=req.chat_template,
        seeds=seeds,
        coverage=req.coverage,
    )
    session = Session(
        ModelConfig(
            req.target, req.draft, req.device, req.dtype, prepack=req.prepack, draft_step_dtype=req.draft_step_dtype
        ),
        need_draft=needs_draft(names),
        status=status_printer(), bundle=req.bundle,
    )
    cfg, skipped = runnable_strategies(session, cfg, skip=req.quick)
    console = Console(stderr=True)
    for note in skipped:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    total = sum(item.turns for item in items) * len(cfg.strategies) * len(seeds)
    with Progress(
        TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=console, transient=True,
    ) as progress:
        bar = progress.add_task("", total=total)
        results = run_bench(
            session, items, cfg,
            on_start=lambda row, strategy: progress.update(bar, description=f"{row} · {strategy}"),
            on_result=lambda record: progress.update(bar, advance=1),
        )
    results["notes"] = skipped
    results["config"]["tasks"] = sorted({item.task for item in items})
    out = Console(width=None if stdout_is_terminal() else 200)
    for table in render_tables(results):
        out.print(table)
    for note in notes(results):
        console.print(f"[dim]{note}[/]", highlight=False)
    if req.json_path is not None:
        text = json.dumps(results, ensure_ascii=False, indent=1)
        write_atomic(req.json_path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        console.print(f"wrote {req.json_path}")
    if req.csv_path is not None:
        write_csv(req.csv_path, results)
        console.print(f"wrote {req.csv_path}")
    if req.plot_path is not None:
        write_plot(req.plot_path, results)
        console.print(f"wrote {req.plot_path}")
    return results
