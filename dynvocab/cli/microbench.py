"""``dynvocab microbench``: one part of a draft step timed alone, at real shapes with random weights (or a bundle's
tables). Each mode is a command of this sub-app; ``bench`` itself only runs strategies side by side.

The timing code lives in :mod:`dynvocab.bench.micro` (``microbench``, ``policy_step``, ``eagle_step``,
``draft_step``), which ``scripts/gpu_check.sh`` calls directly; these commands only parse flags, show progress on
stderr, print the table and write the JSON.
"""

from __future__ import annotations

import inspect
import json
from functools import partial
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console

from dynvocab.cli.common import (
    Device,
    DraftWeights,
    Dtype,
    Threads,
    check_dtype_device,
    check_out,
    one_line_errors,
    set_threads,
)
from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic
from dynvocab.runtime.drafts.kinds import kind_names

app = typer.Typer(
    name="microbench",
    help="Time one part of a draft step alone: the head kernels, the policies' own work, an EAGLE step, a "
    "draft-model step. Random weights at real shapes; nothing is downloaded.",
    no_args_is_help=True,
)


def mode(name: str):
    """Register the decorated function as ``microbench NAME`` (errors as one line). Its docstring is its --help,
    each paragraph joined into one line: typer would keep the docstring's line breaks after the first."""

    def register(command):
        paragraphs = inspect.cleandoc(command.__doc__ or "").split("\n\n")
        app.command(name, help="\n\n".join(p.replace("\n", " ") for p in paragraphs))(one_line_errors(command))
        return command

    return register


JsonOut = Annotated[Optional[Path], typer.Option("--json", help="Also write the full result as JSON here.")]


def _start(device: str | None, dtype: str | None, weights: str | None, threads: int | None, json_path: Path | None):
    """The checks every mode makes before it builds anything: device/dtype/weights, the JSON's folder, threads."""
    check_dtype_device(device, dtype, weights)
    check_out(json_path, "--json")
    set_threads(threads)


def _timed(status: str, run: Callable[[], dict]) -> dict:
    """``run()`` under a progress line on stderr."""
    with Console(stderr=True).status(status):
        return run()


def _report(table, payload: dict, json_path: Path | None) -> None:
    """Print ``table`` on stdout; write ``payload`` to ``json_path`` (whole or not at all) and say so on stderr."""
    Console().print(table)
    if json_path is not None:
        text = json.dumps(payload, ensure_ascii=False, indent=1)
        write_atomic(json_path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        Console(stderr=True).print(f"wrote {json_path}")


@mode("kernels")
def kernels(device: Device = None, dtype: Dtype = None, threads: Threads = None, json_path: JsonOut = None) -> None:
    """The draft-head paths over an active set: full, static slice, gathered, fused kernel, packed.

    At the demo draft's head (V 151,936, d 896): the full head, a static slice, index_select + mm, the fused Triton
    kernel (CUDA only) and a packed buffer, for 1k-32k active rows and M = 1, 8, 64 hidden states; each time is
    set against the device's measured copy bandwidth. --dtype defaults to float32.
    """
    from dynvocab.bench.micro.microbench import render_kernel_table, run_kernel_bench
    from dynvocab.models import default_device

    _start(device, dtype, None, threads, json_path)
    device = device or default_device()
    result = _timed("timing draft-head paths…", lambda: run_kernel_bench(device, dtype or "float32", threads=threads))
    _report(render_kernel_table(result), result, json_path)


BundleIn = Annotated[
    Optional[str],
    typer.Option("--bundle", help="Time the policies over this bundle's tables (default: synthetic tables of the "
                 "demo target's sizes)."),
]
DraftKind = Annotated[
    Optional[str],
    typer.Option("--draft-kind", help=f"Over synthetic tables: the draft kind whose random-weight stand-in the "
                 f"policies read (registered: {kind_names()}). [default: eagle1]"),
]


@mode("policy-steps")
def policy_steps(
    bundle: BundleIn = None,
    dtype: Dtype = None,
    draft_weights: DraftWeights = None,
    draft_kind: DraftKind = None,
    threads: Threads = None,
    json_path: JsonOut = None,
) -> None:
    """Each dynamic policy's own work per draft step, beside an EAGLE-1 step with a 3k-row head.

    Per policy: its active_ids and observe time per draft step and its head's time, against the full head and
    an EAGLE-1 step at the demo target's shapes, on the CPU, over the --bundle's tables or synthetic ones. Without
    --dtype it times bfloat16 and float32 rows, and int8 rows first where the draft weights are int8.
    """
    from dynvocab.artifacts.bundle import load_bundle
    from dynvocab.bench.micro.policy_step import SYNTHETIC_KIND, policy_step_bench, render_policy_table
    from dynvocab.models.int8 import INT8, default_draft_weights

    _start(None, dtype, draft_weights, threads, json_path)
    opened = load_bundle(bundle) if bundle else None
    weights = draft_weights or default_draft_weights("cpu", dtype or "float32")
    dtypes = (dtype,) if dtype else ("bfloat16", "float32")
    if weights == INT8:  # the int8 rows an int8 draft's head reads, first
        dtypes = (INT8, *dtypes)
    kind = draft_kind or SYNTHETIC_KIND
    result = _timed("timing policy steps…",
                    lambda: policy_step_bench(opened, dtypes=dtypes, threads=threads, kind=kind))
    _report(render_policy_table(result), result, json_path)


@mode("eagle-step")
def eagle_step(
    device: Device = None,
    dtype: Dtype = None,
    draft_weights: DraftWeights = None,
    threads: Threads = None,
    json_path: JsonOut = None,
) -> None:
    """One EAGLE draft step at real shapes: the head over the full vocabulary vs 32k vs 3k rows.

    The step (its decoder layer, then the head) at each EAGLE shape: the demo target, Gemma-3-270M EAGLE-1 and
    EAGLE-3, Llama-3-8B EAGLE-1, Llama-3.1-8B EAGLE-3; EAGLE-1 also with the lowrank and centroids selectors.
    --draft-weights is int8 or the --dtype.
    """
    from dynvocab.bench.micro.eagle_step import EAGLE_SHAPES, eagle_step_bench, render_eagle_step_table
    from dynvocab.models import default_device, default_dtype
    from dynvocab.models.int8 import INT8, default_draft_weights

    _start(device, dtype, draft_weights, threads, json_path)
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    weights = draft_weights or default_draft_weights(device, dtype)
    if weights not in (INT8, dtype):
        raise DynvocabError(f"eagle-step times --draft-weights int8 or {dtype} (the --dtype); pass --dtype {weights}")
    results = [
        _timed(f"timing an EAGLE draft step at {shape} shapes…",
               partial(eagle_step_bench, shape, device=device, dtype=dtype, weights=weights))
        for shape in EAGLE_SHAPES
    ]
    _report(render_eagle_step_table(results), {"eagle_step": results}, json_path)


@mode("draft-step")
def draft_step(
    device: Device = None,
    dtype: Dtype = None,
    layers: Annotated[
        Optional[int],
        typer.Option(min=1, help="Decoder layers of the body (fewer: a quicker run on a CPU). [default: 24]"),
    ] = None,
    threads: Threads = None,
    json_path: JsonOut = None,
) -> None:
    """One draft-model step at the demo draft's shapes: body and head apart, full vs 32k vs 3k rows.

    A random Qwen2.5-0.5B body decodes one token after 128 cached ones, then the head runs over the full
    vocabulary, a 32k and a 3k packed buffer, and the same sets gathered (the fused Triton kernel on CUDA).
    --dtype defaults to float32.
    """
    from dynvocab.bench.micro.draft_step import draft_step_bench, render_draft_step_table
    from dynvocab.models import default_device

    _start(device, dtype, None, threads, json_path)
    device = device or default_device()
    result = _timed("timing a draft-model step…",
                    lambda: draft_step_bench(device=device, dtype=dtype or "float32", layers=layers, threads=threads))
    _report(render_draft_step_table(result), result, json_path)
