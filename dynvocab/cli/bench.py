"""``dynvocab bench``: strategies side by side on the same loaded models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from dynvocab.cli.common import (
    Device,
    Draft,
    DraftWeights,
    Dtype,
    Prepack,
    StrategyFlags,
    Target,
    Threads,
    check_dtype_device,
    check_out,
    one_line_errors,
    set_threads,
    with_strategy_flags,
)
from dynvocab.errors import DynvocabError
from dynvocab.runtime.drafts import kind_names
from dynvocab.files import write_atomic


@one_line_errors
@with_strategy_flags
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
        bool, typer.Option("--quick", help="Small run: 1 code + 1 chat prompt, 32 tokens, ar,full,microspec,fr,hybrid. On the "
                           "default models it then runs the 262k demo (Gemma-3-270M, the shipped head demo:gemma-eagle1: "
                           "2 + 2 prompts, 64 tokens); its --json/--csv/--plot files get '.gemma' before the suffix.")
    ] = False,
    target: Target = "demo:target",
    draft: Draft = "demo:draft",
    max_new_tokens: Annotated[
        Optional[int], typer.Option("--max-new-tokens", min=1, help="Stop after this many new tokens. [default: 64]")
    ] = None,
    seeds: Annotated[
        Optional[str], typer.Option(help="Comma-separated seeds (e.g. 0,1,2): every row once per seed; mean ± std over seeds.")
    ] = None,
    flags: StrategyFlags = StrategyFlags(),
    device: Device = None,
    dtype: Dtype = None,
    draft_weights: DraftWeights = None,
    prepack: Prepack = None,
    threads: Threads = None,
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template", help="Encode prompts as plain text.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the full results (generations, summary) here.")] = None,
    csv_path: Annotated[Optional[Path], typer.Option("--csv", help="Write one row per strategy × task here.")] = None,
    plot_path: Annotated[
        Optional[Path], typer.Option("--plot", help="Write a figure (tokens/s, MAL, active vocabulary vs MAL) here, e.g. bench.png.")
    ] = None,
    score_sets: Annotated[
        bool, typer.Option("--coverage", help="Also score each active set: target probability mass and Recall@k of the target's top-k.")
    ] = False,
    kernels: Annotated[
        bool, typer.Option("--kernels", help="Instead: microbenchmark the draft-head paths (full, 32k, gathered, packed).")
    ] = False,
    policy_steps: Annotated[
        bool,
        typer.Option(
            "--policy-steps",
            help="Instead: time each dynamic policy's own work per draft step against an EAGLE-1 step with a 3k-row "
            "head at the demo target's shapes (bfloat16 and float32; the --bundle's tables, else synthetic ones).",
        ),
    ] = False,
    draft_kind: Annotated[
        Optional[str],
        typer.Option(
            "--draft-kind",
            help=f"With --policy-steps over synthetic tables: the draft kind whose random-weight stand-in the "
            f"policies read (registered: {kind_names()}; default eagle1).",
        ),
    ] = None,
    llamacpp: Annotated[
        Optional[Path],
        typer.Option(
            "--llamacpp",
            metavar="BIN_DIR",
            help="Also run llama.cpp on the same GGUF files and prompts: rows llama.cpp (llama-completion) and "
            "llama.cpp-spec (llama-speculative-simple, the --draft GGUF as its draft). BIN_DIR holds both "
            "binaries (scripts/build_llamacpp.sh builds them); --target/--draft must be .gguf files or demo:*.",
        ),
    ] = None,
    eagle_step: Annotated[
        bool,
        typer.Option(
            "--eagle-step",
            help="Instead: time one EAGLE draft step at real shapes with random weights (demo target, Llama-3-8B "
            "EAGLE-1, Llama-3.1-8B EAGLE-3): full head vs 32k vs 3k rows.",
        ),
    ] = False,
    vllm: Annotated[
        bool,
        typer.Option("--vllm", help="Instead: run the prompts through vLLM: rows vllm, vllm-spec (the draft's full "
                     "head) and vllm-spec:<strategy> per plugin strategy (fr, lowrank, centroids) in one engine."),
    ] = False,
    vllm_python: Annotated[
        Optional[str], typer.Option("--vllm-python", metavar="PATH", help="With --vllm: the python of an environment "
                                    "with vLLM (default: this one, where it imports vLLM).")
    ] = None,
    rounds: Annotated[
        Optional[int], typer.Option(min=1, help="With --vllm: interleaved rounds per row; medians reported. [default: 3]")
    ] = None,
    tensor_parallel_size: Annotated[
        int, typer.Option("--tensor-parallel-size", min=1, help="With --vllm: vLLM's tensor-parallel ranks.")
    ] = 1,
) -> None:
    """Run every strategy on every prompt with the models loaded once; print a table, optionally write JSON/CSV/plot."""
    from dynvocab.cli.bench_run import BenchRequest, run_command
    from dynvocab.runtime.session import ModelConfig

    check_dtype_device(device, dtype, draft_weights)
    for path, flag in ((json_path, "--json"), (csv_path, "--csv"), (plot_path, "--plot")):
        check_out(path, flag)
    set_threads(threads)
    if kernels:
        _kernel_bench(device, dtype, json_path, threads)
        return
    flags.check()
    if vllm:
        from dynvocab.cli.bench_run import BenchRequest, VllmRequest, run_vllm_command

        request = BenchRequest(
            models=ModelConfig(target, draft, dtype=dtype), prompts=prompts, strategies=strategies, ids=ids, tasks=tasks,
            num_prompts=num_prompts, quick=quick, max_new_tokens=max_new_tokens, chat_template=not no_chat_template,
            json_path=json_path,
        )
        run_vllm_command(request, flags, VllmRequest(vllm_python, rounds, tensor_parallel_size))
        return
    if policy_steps:
        _policy_step_bench(flags.bundle, dtype, draft_weights, json_path, threads, draft_kind)
        return
    if eagle_step:
        _eagle_step_bench(device, dtype, draft_weights, json_path)
        return
    llama = None
    if llamacpp is not None:
        from dynvocab.bench.llamacpp import prepare

        if flags.temperature > 0:
            raise DynvocabError("--llamacpp rows decode greedily; drop --temperature")
        llama = prepare(llamacpp, target, draft)
    request = BenchRequest(
        models=ModelConfig(target, draft, device, dtype, prepack=prepack, draft_weights=draft_weights),
        prompts=prompts, strategies=strategies, ids=ids, tasks=tasks, num_prompts=num_prompts, quick=quick,
        max_new_tokens=max_new_tokens, seeds=seeds, score_sets=score_sets, chat_template=not no_chat_template,
        json_path=json_path, csv_path=csv_path, plot_path=plot_path, llamacpp=llama,
    )
    if quick:
        from dynvocab.cli.bench_run import run_quick

        run_quick(request, flags)
        return
    run_command(request, flags)


def _kernel_bench(device: str | None, dtype: str | None, json_path: Path | None, threads: int | None) -> None:
    from dynvocab.bench.microbench import render_kernel_table, run_kernel_bench
    from dynvocab.models import default_device

    device = device or default_device()
    console = Console(stderr=True)
    with console.status("timing draft-head paths…"):
        result = run_kernel_bench(device=device, dtype=dtype or "float32", threads=threads)
    Console().print(render_kernel_table(result))
    if json_path is not None:
        _write_json(json_path, result)
        console.print(f"wrote {json_path}")


def _policy_step_bench(
    bundle: str | None, dtype: str | None, weights: str | None, json_path: Path | None, threads: int | None,
    kind: str | None = None,
) -> None:
    from dynvocab.artifacts.bundle import load_bundle
    from dynvocab.bench.policy_step import SYNTHETIC_KIND, policy_step_bench, render_policy_table
    from dynvocab.models.prepack import INT8, default_draft_weights

    console = Console(stderr=True)
    opened = load_bundle(bundle) if bundle else None
    weights = weights or default_draft_weights("cpu", dtype or "float32")
    dtypes = (dtype,) if dtype else ("bfloat16", "float32")
    if weights == INT8:  # the int8 rows an int8 draft's head reads, first
        dtypes = (INT8, *dtypes)
    with console.status("timing policy steps…"):
        result = policy_step_bench(opened, dtypes=dtypes, threads=threads, kind=kind or SYNTHETIC_KIND)
    Console().print(render_policy_table(result))
    if json_path is not None:
        _write_json(json_path, result)
        console.print(f"wrote {json_path}")


def _write_json(path: Path, payload: dict) -> None:
    """Write ``payload`` as JSON, whole or not at all."""
    text = json.dumps(payload, ensure_ascii=False, indent=1)
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _eagle_step_bench(device: str | None, dtype: str | None, weights: str | None, json_path: Path | None) -> None:
    from dynvocab.bench.eagle_step import EAGLE_SHAPES, eagle_step_bench, render_eagle_step_table
    from dynvocab.models import default_device, default_dtype
    from dynvocab.models.prepack import INT8, default_draft_weights

    device = device or default_device()
    dtype = dtype or default_dtype(device)
    weights = weights or default_draft_weights(device, dtype)
    if weights not in (INT8, dtype):
        raise DynvocabError(f"--eagle-step times --draft-weights int8 or {dtype} (the --dtype); pass --dtype {weights}")
    console = Console(stderr=True)
    results = []
    for shape in EAGLE_SHAPES:
        with console.status(f"timing an EAGLE draft step at {shape} shapes…"):
            results.append(eagle_step_bench(shape, device=device, dtype=dtype, weights=weights))
    Console().print(render_eagle_step_table(results))
    if json_path is not None:
        _write_json(json_path, {"eagle_step": results})
        console.print(f"wrote {json_path}")

