"""``dynvocab bench``: strategies side by side on the same loaded models."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dynvocab.cli.common import (
    BundleOpt,
    CoreSize,
    HybridWindow,
    Threads,
    Device,
    Draft,
    Dtype,
    FrSize,
    Gamma,
    MaxNew,
    KPre,
    KVer,
    PaKMax,
    Window,
    Target,
    TokenMap,
    check_dtype_device,
    one_line_errors,
    set_threads,
    status_printer,
)
from dynvocab.errors import DynvocabError
from dynvocab.runtime.loop import DecodeConfig
from dynvocab.runtime.policies.hybrid import HybridConfig
from dynvocab.runtime.policies.microspec import MicroSpecConfig
from dynvocab.runtime.prompts import load_prompts
from dynvocab.runtime.strategies import StrategyOptions, parse_strategies


@one_line_errors
def bench(
    prompts: Annotated[
        Optional[str], typer.Option("--prompts", help="JSONL prompt file: rows with id, task, and prompt or messages.")
    ] = None,
    strategies: Annotated[str, typer.Option(help="Comma-separated strategies, e.g. ar,full,fr.")] = "ar,full",
    ids: Annotated[Optional[str], typer.Option(help="Comma-separated prompt ids to run (default: all).")] = None,
    tasks: Annotated[Optional[str], typer.Option(help="Comma-separated tasks to run (default: all).")] = None,
    target: Target = "demo:target",
    draft: Draft = "demo:draft",
    max_new_tokens: MaxNew = 64,
    gamma: Gamma = 4,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Random seed for sampling.")] = 0,
    token_map: TokenMap = None,
    fr_size: FrSize = None,
    pa_k_max: PaKMax = None,
    k_pre: KPre = MicroSpecConfig.k_pre,
    k_ver: KVer = MicroSpecConfig.k_ver,
    window: Window = MicroSpecConfig.window,
    core_size: CoreSize = HybridConfig.core_size,
    hybrid_window: HybridWindow = HybridConfig.window,
    bundle: BundleOpt = None,
    device: Device = None,
    dtype: Dtype = None,
    threads: Threads = None,
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template", help="Encode prompts as plain text.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the full results (generations, summary) here.")] = None,
    kernels: Annotated[
        bool, typer.Option("--kernels", help="Instead: microbenchmark the draft-head paths (full, 32k, gathered, packed).")
    ] = False,
) -> None:
    """Run every strategy on every prompt with the models loaded once; print a table, optionally write JSON."""
    from dynvocab.runtime.bench import BenchConfig, run_bench
    from dynvocab.runtime.session import ModelConfig, Session

    check_dtype_device(device, dtype)
    if json_path is not None and not json_path.parent.exists():
        raise DynvocabError(f"folder {json_path.parent} for --json does not exist")
    set_threads(threads)
    if kernels:
        _kernel_bench(device, dtype, json_path, threads)
        return
    names = parse_strategies(strategies)
    if prompts is None:
        raise DynvocabError("bench needs --prompts FILE.jsonl (or --kernels for the head microbenchmark)")
    rows = load_prompts(prompts, _split(ids), _split(tasks))
    options = StrategyOptions(
        token_map=token_map,
        fr_size=fr_size,
        pa_k_max=pa_k_max,
        microspec=MicroSpecConfig(k_pre=k_pre, k_ver=k_ver, window=window),
        hybrid=HybridConfig(core_size=core_size, window=hybrid_window, k_pre=k_pre, k_ver=k_ver),
    )
    cfg = BenchConfig(
        strategies=tuple(names),
        decode=DecodeConfig(gamma=gamma, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed),
        options=options,
        chat_template=not no_chat_template,
    )
    needs_draft = any(n != "ar" for n in names)
    session = Session(ModelConfig(target, draft, device, dtype), need_draft=needs_draft, status=status_printer(), bundle=bundle)
    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), console=console, transient=True,
    ) as progress:
        task = progress.add_task("", total=len(rows) * len(names))

        def advance(record: dict) -> None:
            progress.update(task, advance=1, description=f"{record['id']} · {record['strategy']}")

        results = run_bench(session, rows, cfg, on_result=advance)
    Console().print(render_table(results))
    if json_path is not None:
        write_json_atomic(json_path, results)
        console.print(f"wrote {json_path}")


def _kernel_bench(device: str | None, dtype: str | None, json_path: Path | None, threads: int | None) -> None:
    from dynvocab.kernels.microbench import render_kernel_table, run_kernel_bench
    from dynvocab.models import default_device

    device = device or default_device()
    console = Console(stderr=True)
    with console.status("timing draft-head paths…"):
        result = run_kernel_bench(device=device, dtype=dtype or "float32", threads=threads)
    Console().print(render_kernel_table(result))
    if json_path is not None:
        write_json_atomic(json_path, result)
        console.print(f"wrote {json_path}")


def _split(text: str | None) -> list[str] | None:
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def render_table(results: dict) -> Table:
    """A rich table: one row per strategy (all tasks together)."""
    cfg = results["config"]
    table = Table(title=f"dynvocab bench · γ={cfg['gamma']} · {cfg['dtype']} on {cfg['device']}")
    for col in ("strategy", "tokens/s", "× ar", "× full", "MAL", "active vocab", "coverage", "= ar", "draft s", "head s", "verify s"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for strategy, per in results["summary"].items():
        s = per["all"]
        table.add_row(
            strategy,
            f"{s['tokens_per_s']:.2f} ± {s['tokens_per_s_std']:.2f}",
            _fmt(s.get("speedup_vs_ar"), "{:.2f}×"),
            _fmt(s.get("speedup_vs_full"), "{:.2f}×"),
            f"{s['mean_accepted_length']:.2f}",
            _fmt(s.get("mean_active_vocab"), "{:,.0f}"),
            _fmt(s.get("coverage"), "{:.1%}"),
            _fmt(s.get("matches_ar"), "{:.0%}"),
            f"{s['draft_s']:.2f}",
            f"{s['head_s']:.2f}",
            f"{s['verify_s']:.2f}",
        )
    return table


def _fmt(value, spec: str) -> str:
    return "–" if value is None else spec.format(value)


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write JSON to a temp file in the same folder, then rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, ensure_ascii=False, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
