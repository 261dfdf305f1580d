"""``dynvocab bench``: strategies side by side on the same loaded models."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from dynvocab.cli.common import (
    BundleOpt,
    KMax,
    OnlineAlign,
    CoreSize,
    HybridWindow,
    StepNeighbours,
    Threads,
    Device,
    Draft,
    DraftStepDtype,
    Dtype,
    Prepack,
    StopBelow,
    FrSize,
    BranchBelow,
    Gamma,
    KPre,
    KVer,
    PaKMax,
    Window,
    Target,
    TokenMap,
    check_dtype_device,
    one_line_errors,
    set_threads,
    strategy_options,
)
from dynvocab.errors import DynvocabError
from dynvocab.runtime.loop import DEFAULT_BRANCH_BELOW, DEFAULT_GAMMA, DEFAULT_STOP_BELOW
from dynvocab.runtime.policies.dynaspec import DynaSpecConfig
from dynvocab.runtime.policies.hybrid import HybridConfig
from dynvocab.runtime.policies.microspec import MicroSpecConfig


@one_line_errors
def bench(
    prompts: Annotated[
        Optional[str],
        typer.Option(
            "--prompts",
            help="JSONL prompt file (rows: id, task, prompt or messages; or a Spec-Bench question.jsonl). "
            "Default: the embedded tasks.",
        ),
    ] = None,
    strategies: Annotated[
        Optional[str],
        typer.Option(help="Comma-separated rows: strategies (ar,full,fr,…) and hf-assisted, hf-lookup. [default: ar,full]"),
    ] = None,
    ids: Annotated[Optional[str], typer.Option(help="Comma-separated prompt ids to run (default: all).")] = None,
    tasks: Annotated[
        Optional[str],
        typer.Option(help="Comma-separated tasks: code, chat, multiturn, topic-switch (or a prompt file's). [default: all]"),
    ] = None,
    num_prompts: Annotated[
        Optional[int], typer.Option("--num-prompts", min=1, help="Prompts per task (topic-switch: N code + N chat turns). [default: 5]")
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Small run: 1 code + 1 chat prompt, 32 tokens, ar,full,microspec,fr,hybrid.")
    ] = False,
    target: Target = "demo:target",
    draft: Draft = "demo:draft",
    max_new_tokens: Annotated[
        Optional[int], typer.Option("--max-new-tokens", min=1, help="Stop after this many new tokens. [default: 64]")
    ] = None,
    gamma: Gamma = DEFAULT_GAMMA,
    stop_below: StopBelow = DEFAULT_STOP_BELOW,
    branch_below: BranchBelow = DEFAULT_BRANCH_BELOW,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Random seed for sampling.")] = 0,
    seeds: Annotated[
        Optional[str], typer.Option(help="Comma-separated seeds (e.g. 0,1,2): every row once per seed; mean ± std over seeds.")
    ] = None,
    token_map: TokenMap = None,
    fr_size: FrSize = None,
    pa_k_max: PaKMax = None,
    k_pre: KPre = MicroSpecConfig.k_pre,
    k_ver: KVer = MicroSpecConfig.k_ver,
    window: Window = MicroSpecConfig.window,
    core_size: CoreSize = HybridConfig.core_size,
    hybrid_window: HybridWindow = HybridConfig.window,
    step_neighbours: StepNeighbours = HybridConfig.step_neighbours,
    k_max: KMax = DynaSpecConfig.k_max,
    online_align: OnlineAlign = False,
    bundle: BundleOpt = None,
    device: Device = None,
    dtype: Dtype = None,
    draft_step_dtype: DraftStepDtype = None,
    prepack: Prepack = None,
    threads: Threads = None,
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template", help="Encode prompts as plain text.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the full results (generations, summary) here.")] = None,
    csv_path: Annotated[Optional[Path], typer.Option("--csv", help="Write one row per strategy × task here.")] = None,
    plot_path: Annotated[
        Optional[Path], typer.Option("--plot", help="Write a figure (tokens/s, MAL, active vocabulary vs MAL) here, e.g. bench.png.")
    ] = None,
    coverage: Annotated[
        bool, typer.Option("--coverage", help="Also score each active set: target probability mass and Recall@k of the target's top-k.")
    ] = False,
    kernels: Annotated[
        bool, typer.Option("--kernels", help="Instead: microbenchmark the draft-head paths (full, 32k, gathered, packed).")
    ] = False,
    eagle_step: Annotated[
        bool,
        typer.Option(
            "--eagle-step",
            help="Instead: time one EAGLE draft step at real shapes with random weights (demo target, Llama-3-8B "
            "EAGLE-1, Llama-3.1-8B EAGLE-3): full head vs 32k vs 3k rows.",
        ),
    ] = False,
) -> None:
    """Run every strategy on every prompt with the models loaded once; print a table, optionally write JSON/CSV/plot."""
    from dynvocab.cli.bench_run import BenchRequest, run_command

    check_dtype_device(device, dtype, draft_step_dtype)
    if json_path is not None and not json_path.parent.exists():
        raise DynvocabError(f"folder {json_path.parent} for --json does not exist")
    set_threads(threads)
    if kernels:
        _kernel_bench(device, dtype, json_path, threads)
        return
    if eagle_step:
        _eagle_step_bench(device, dtype, json_path)
        return
    options = strategy_options(
        token_map, fr_size, pa_k_max, k_pre, k_ver, window, core_size, hybrid_window, step_neighbours, k_max,
        online_align,
    )
    request = BenchRequest(
        prompts=prompts, strategies=strategies, ids=ids, tasks=tasks, num_prompts=num_prompts, quick=quick,
        target=target, draft=draft, device=device, dtype=dtype, draft_step_dtype=draft_step_dtype, prepack=prepack,
        bundle=bundle, max_new_tokens=max_new_tokens,
        gamma=gamma, stop_below=stop_below, branch_below=branch_below, temperature=temperature, seed=seed, seeds=seeds, coverage=coverage,
        chat_template=not no_chat_template, json_path=json_path, csv_path=csv_path, plot_path=plot_path,
    )
    run_command(request, options)


def _kernel_bench(device: str | None, dtype: str | None, json_path: Path | None, threads: int | None) -> None:
    from dynvocab.bench.microbench import render_kernel_table, run_kernel_bench
    from dynvocab.models import default_device

    device = device or default_device()
    console = Console(stderr=True)
    with console.status("timing draft-head paths…"):
        result = run_kernel_bench(device=device, dtype=dtype or "float32", threads=threads)
    Console().print(render_kernel_table(result))
    if json_path is not None:
        write_json_atomic(json_path, result)
        console.print(f"wrote {json_path}")


def _eagle_step_bench(device: str | None, dtype: str | None, json_path: Path | None) -> None:
    from dynvocab.bench.eagle_step import EAGLE_SHAPES, eagle_step_bench, render_eagle_step_table
    from dynvocab.models import default_device, default_dtype

    device = device or default_device()
    dtype = dtype or default_dtype(device)
    console = Console(stderr=True)
    results = []
    for shape in EAGLE_SHAPES:
        with console.status(f"timing an EAGLE draft step at {shape} shapes…"):
            results.append(eagle_step_bench(shape, device=device, dtype=dtype))
    Console().print(render_eagle_step_table(results))
    if json_path is not None:
        write_json_atomic(json_path, {"eagle_step": results})
        console.print(f"wrote {json_path}")


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
