"""Options and helpers shared by the commands."""

from __future__ import annotations

import functools
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from dynvocab.errors import DynvocabError

err_console = Console(stderr=True)

Target = Annotated[
    str, typer.Option(help="Target model: hub id, local folder, .gguf file, or demo:target.")
]
Draft = Annotated[str, typer.Option(help="Draft model: hub id, local folder, .gguf file, or demo:draft.")]
Device = Annotated[Optional[str], typer.Option(help="cpu or cuda (default: cuda when a GPU is visible).")]
Dtype = Annotated[
    Optional[str],
    typer.Option(help="float32, bfloat16 or float16 (default: bfloat16 on GPU and on CPUs with native bf16, else float32)."),
]
DraftStepDtype = Annotated[
    Optional[str],
    typer.Option(
        "--draft-step-dtype",
        help="Dtype of a copy of the draft's weights for its one-token steps (they read half the bytes in "
        "bfloat16; the output stays the target's own); its prompt pass keeps --dtype. float32 turns it off. "
        "[default: bfloat16 for float32 on CPU]",
    ),
]
Prepack = Annotated[
    Optional[bool],
    typer.Option(
        "--prepack/--no-prepack",
        help="Give the target's linears a oneDNN-packed copy for its few-row verification passes (1.5-3x faster "
        "there, one more copy of its weights in memory). [default: on for float32 on CPU]",
    ),
]
Gamma = Annotated[int, typer.Option(min=1, max=32, help="The longest draft per cycle (γ).")]
StopBelow = Annotated[
    float,
    typer.Option(
        min=0.0, max=1.0,
        help="End a draft after a token the draft gave a probability below this (0: always γ tokens; hf-assisted "
        "gets the same threshold).",
    ),
]
BranchBelow = Annotated[
    float,
    typer.Option(
        min=0.0, max=1.0,
        help="Greedy only: also verify the draft's runner-up where its pick had a probability below this (tree "
        "leaves in the same target pass; 0: the chain alone).",
    ),
]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", min=1, help="Stop after this many new tokens.")]
TokenMap = Annotated[
    Optional[str],
    typer.Option(help="FR-Spec/SGLang token map for fr and fr-pa: a torch.save'd list of token ids, most frequent first."),
]
FrSize = Annotated[Optional[int], typer.Option(help="Use only the first K ids of the token map.")]
PaKMax = Annotated[Optional[int], typer.Option(help="k_max of fr-pa's position-aware budget (default: the map size).")]


def one_line_errors(func):
    """Turn DynvocabError (and a few plain OS errors) into ``error: …`` on stderr and exit code 1."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        quiet_transformers()
        try:
            return func(*args, **kwargs)
        except DynvocabError as exc:
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except (OSError, MemoryError) as exc:
            err_console.print(f"[bold red]error:[/] {type(exc).__name__}: {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print("[bold red]error:[/] interrupted")
            raise typer.Exit(130) from None

    return wrapper


def quiet_transformers() -> None:
    """Keep transformers' own progress bars and advisory logs off the terminal; the CLI renders progress."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def status_printer(quiet: bool = False):
    """A callback that prints loading messages on stderr."""
    if quiet:
        return lambda msg: None
    return lambda msg: err_console.print(f"[dim]{msg}…[/]", highlight=False)


def check_dtype_device(device: str | None, dtype: str | None, draft_step_dtype: str | None = None) -> None:
    """Validate --device / --dtype / --draft-step-dtype early, before any model is loaded."""
    if device is not None and device != "cpu" and not device.startswith("cuda"):
        raise DynvocabError(f"unknown device '{device}'; use cpu or cuda")
    for flag, value in (("dtype", dtype), ("draft step dtype", draft_step_dtype)):
        if value is not None and value not in ("float32", "bfloat16", "float16"):
            raise DynvocabError(f"unknown {flag} '{value}'; use float32, bfloat16 or float16")


def stdout_is_terminal() -> bool:
    """Whether stdout is a terminal (stream text only there or when asked)."""
    return sys.stdout.isatty()
KPre = Annotated[int, typer.Option(min=1, help="microspec: target top-K_pre per prompt position joining the stream.")]
KVer = Annotated[int, typer.Option(min=1, help="microspec: target top-K_ver per verified position joining the stream.")]
Window = Annotated[int, typer.Option(min=1, help="microspec: W_max, the stream entries the active set is drawn from.")]
BundleOpt = Annotated[
    Optional[str], typer.Option("--bundle", help="Bundle from `dynvocab build-index` (freq ranking for fr/fr-pa, …).")
]
Threads = Annotated[
    Optional[int],
    typer.Option(min=1, help="CPU threads for torch (default: torch's choice; 1 is steadier on a shared machine)."),
]


def set_threads(threads: int | None) -> None:
    """Apply --threads."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
CoreSize = Annotated[int, typer.Option(min=1, help="hybrid: size of the static core of most frequent tokens.")]
HybridWindow = Annotated[int, typer.Option(min=1, help="hybrid: stream entries of its context window.")]
StepNeighbours = Annotated[
    int,
    typer.Option(
        min=0,
        help="hybrid: per draft step, HNSW neighbours of the draft hidden state among the draft's head rows "
        "(bundle stage draft_hnsw; 0 = off; CPU devices only: on a GPU it would cost a host sync per step).",
    ),
]
KMax = Annotated[int, typer.Option(min=1, help="dynaspec: clusters routed at draft steps 0 and 1 (k_max).")]
OnlineAlign = Annotated[
    bool, typer.Option("--online-align", help="evospec: online LoRA alignment of the draft (q, v projections).")
]


def strategy_options(
    token_map: str | None,
    fr_size: int | None,
    pa_k_max: int | None,
    k_pre: int,
    k_ver: int,
    window: int,
    core_size: int,
    hybrid_window: int,
    step_neighbours: int,
    k_max: int,
    online_align: bool,
):
    """The :class:`~dynvocab.runtime.strategies.StrategyOptions` that the shared strategy flags describe."""
    from dynvocab.runtime.policies.dynaspec import DynaSpecConfig
    from dynvocab.runtime.policies.evospec import EvoSpecConfig
    from dynvocab.runtime.policies.hybrid import HybridConfig
    from dynvocab.runtime.policies.microspec import MicroSpecConfig
    from dynvocab.runtime.strategies import StrategyOptions

    return StrategyOptions(
        token_map=token_map,
        fr_size=fr_size,
        pa_k_max=pa_k_max,
        microspec=MicroSpecConfig(k_pre=k_pre, k_ver=k_ver, window=window),
        hybrid=HybridConfig(
            core_size=core_size, window=hybrid_window, k_pre=k_pre, k_ver=k_ver, step_neighbours=step_neighbours
        ),
        dynaspec=DynaSpecConfig(k_max=k_max),
        evospec=EvoSpecConfig(online_align=online_align),
    )
