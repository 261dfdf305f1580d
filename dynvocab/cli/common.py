"""Options and helpers shared by the commands."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import sys
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from dynvocab.errors import DynvocabError
from dynvocab.runtime.decoding.loop import TREE_SETS, DecodeConfig
from dynvocab.runtime.drafts.kinds import kind_names
from dynvocab.runtime.strategies import StrategyOptions, configs_from_flags, strategy_flags
from dynvocab.runtime.trees.shape import parse_tree

err_console = Console(stderr=True)

Target = Annotated[
    str,
    typer.Option(
        envvar="DYNVOCAB_TARGET",
        help="Target model: hub id, local folder, .gguf file, demo:target, or demo:gemma (262k ids).",
    ),
]
Draft = Annotated[str, typer.Option(
    envvar="DYNVOCAB_DRAFT",
    help="The draft: a draft model (hub id, local folder, .gguf file, demo:draft) or a draft head (folder, hub id, or "
    "demo:gemma-eagle1, the EAGLE-1 head shipped for demo:gemma, or demo:gemma-eagle1-ml, the same trained on nine "
    "languages too); "
    f"its kind is recognised among the registered ones ({kind_names()}).",
)]
DraftModel = Annotated[str, typer.Option(
    "--draft",
    envvar="DYNVOCAB_DRAFT",
    help="The draft model whose passes the stages read (hub id, local folder, .gguf file, demo:draft). For an EAGLE "
    "head, its target (e.g. demo:gemma for demo:gemma-eagle1): the head drafts through the target's head rows.",
)]
Device = Annotated[Optional[str], typer.Option(help="cpu or cuda (default: cuda when a GPU is visible).")]
Dtype = Annotated[
    Optional[str],
    typer.Option(help="float32, bfloat16 or float16 (default: bfloat16 on GPU and on CPUs with native bf16, else float32)."),
]
DraftWeights = Annotated[
    Optional[str],
    typer.Option(
        "--draft-weights",
        help="What the draft's weights are in its passes: int8 (per-output-channel scales, fbgemm; the LM head's "
        "rows too, gathered per active set), or a dtype for a copy its one-token steps read (bfloat16; float32 = "
        "none). The output stays the target's own. [default: int8 on a CPU, else --dtype]",
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
Tree = Annotated[
    str,
    typer.Option(
        "--tree", metavar="off|auto|DEPTHxTOPKxTOKENS",
        help="EAGLE heads: draft an EAGLE-2 tree each cycle, DEPTH draft steps, the TOPK best nodes expanded per "
        "depth into TOPK children each, the TOKENS best verified in one target pass (e.g. 5x8x60); auto fits it "
        "to this machine's measured verification cost (timed once per target and kept in the cache); off: chains. "
        "bench: rows named X@tree get it (auto when off); with no such row it applies to every row.",
    ),
]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", min=1, help="Stop after this many new tokens.")]
TokenMap = Annotated[
    Optional[str],
    typer.Option(help="FR-Spec/SGLang token map for fr and fr-pa: a torch.save'd list of token ids, most frequent first."),
]
FrSize = Annotated[Optional[int], typer.Option(min=1, help="Use only the first K ids of the token map.")]


OOM_HINTS = {
    "generate": "reduce --max-new-tokens or the prompt, or use --dtype bfloat16",
    "bench": "reduce --max-new-tokens, the --strategies rows or --num-prompts, or use --dtype bfloat16",
    "build_index": "reduce --max-docs or build fewer --stages at a time",
    "train_router": "reduce --max-docs, --max-tokens or --batch-size",
}


def one_line_errors(func):
    """Turn DynvocabError, OS errors, running out of memory and a torch ``RuntimeError`` into ``error: …`` on
    stderr and exit code 1; Ctrl-C into ``error: interrupted`` and exit code 130."""
    hint = OOM_HINTS.get(func.__name__, "use a smaller model or input")

    def fail(message: str, code: int = 1):
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
        return typer.Exit(code)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        quiet_transformers()
        try:
            return func(*args, **kwargs)
        except DynvocabError as exc:
            raise fail(str(exc), exc.exit_code) from None
        except MemoryError:
            raise fail(f"out of memory; {hint}") from None
        except OSError as exc:
            raise fail(f"{type(exc).__name__}: {exc}") from None
        except typer.Exit:
            raise
        except RuntimeError as exc:  # torch reports out of memory, and tensors that do not fit, as RuntimeError
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            if "out of memory" in first.lower() or "can't allocate memory" in first.lower():
                raise fail(f"out of memory ({first}); {hint}") from None
            raise fail(f"{type(exc).__name__}: {first}") from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None

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


def check_dtype_device(device: str | None, dtype: str | None, draft_weights: str | None = None) -> None:
    """Validate --device / --dtype / --draft-weights early, before any model is loaded (the API's check)."""
    from dynvocab.models.loading import check_device_options

    check_device_options(device, dtype, draft_weights)


def stdout_is_terminal() -> bool:
    """Whether stdout is a terminal (stream text only there or when asked)."""
    return sys.stdout.isatty()
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


@dataclass(frozen=True)
class LoadFlags:
    """How ``generate`` and ``bench`` load and run the models: --device, --dtype, --draft-weights, --prepack and
    --threads, as given on the command line.

    Defined once: :func:`with_strategy_flags` adds them to a command in place of its parameter of this type.
    """

    device: Device = None
    dtype: Dtype = None
    draft_weights: DraftWeights = None
    prepack: Prepack = None
    threads: Threads = None

    def check(self) -> None:
        """Validate --device / --dtype / --draft-weights before any model is loaded (:func:`check_dtype_device`)."""
        check_dtype_device(self.device, self.dtype, self.draft_weights)


def load_flag_params() -> list[inspect.Parameter]:
    """The options of :class:`LoadFlags`, as parameters typer reads."""
    hints = typing.get_type_hints(LoadFlags, include_extras=True)
    return [
        inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hints[f.name], default=f.default)
        for f in dataclasses.fields(LoadFlags)
    ]


TreeSets = Annotated[str, typer.Option(
    "--tree-sets", metavar="|".join(TREE_SETS),
    help="--tree: depth scores every node of a depth over the set chosen for its best node; node gives each node its "
    "own set where the strategy reads the node (dynaspec, lowrank, centroids, hybrid's per-step search), one head "
    "call over their union (on two CPU cores it cost more than it gained).")]
Temperature = Annotated[float, typer.Option(help="0 = greedy; > 0 samples (exact rejection sampling).")]
TopP = Annotated[float, typer.Option(help="Nucleus sampling threshold in (0, 1], applied to target and draft alike.")]
Seed = Annotated[int, typer.Option(help="Random seed for sampling.")]
NgramMax = Annotated[int, typer.Option(
    min=1, max=64, help="Rows and strategies named X+ngram: the longest suffix of the text so far looked up earlier in "
    "the request; what followed it there is the cycle's draft (no draft model or head runs).")]
NgramMin = Annotated[int, typer.Option(
    min=1, max=64, help="X+ngram: the shortest suffix that counts as a match (at most --ngram-max).")]


_DECODING = DecodeConfig()  # the decoding flags' defaults are the loop's own


@dataclass(frozen=True)
class StrategyFlags:
    """The decoding flags and strategy inputs ``generate`` and ``bench`` share, as given on the command line, and
    the strategies' configs that their own flags describe (each registered strategy contributes its flags).

    Defined once: :func:`with_strategy_flags` adds them to a command, which receives them as ``flags``. The decoding
    flags are :class:`~dynvocab.runtime.decoding.loop.DecodeConfig`'s fields of the same names, with its defaults,
    held as given until :meth:`check` (a DecodeConfig would refuse some of them before the command's own checks ran).
    """

    gamma: int = _DECODING.gamma
    stop_below: float = _DECODING.stop_below
    branch_below: float = _DECODING.branch_below
    temperature: float = _DECODING.temperature
    top_p: float = _DECODING.top_p
    seed: int = _DECODING.seed
    ngram_max: int = _DECODING.ngram_max
    ngram_min: int = _DECODING.ngram_min
    tree: str = _DECODING.tree
    tree_sets: str = _DECODING.tree_sets
    token_map: Optional[str] = None
    fr_size: Optional[int] = None
    bundle: Optional[str] = None
    configs: tuple = ()  # from the strategies' flags (see dynvocab.runtime.registry.configs_from_flags)

    def check(self) -> None:
        """Refuse values the option ranges cannot express (not-a-number, an empty nucleus), before any load."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise DynvocabError(f"--temperature must be a finite number ≥ 0 (got {self.temperature})")
        if not (0.0 < self.top_p <= 1.0):  # also refuses nan
            raise DynvocabError(f"--top-p must be in (0, 1] (got {self.top_p})")
        for flag, value in (("--stop-below", self.stop_below), ("--branch-below", self.branch_below)):
            if not math.isfinite(value):
                raise DynvocabError(f"{flag} must be a number in [0, 1] (got {value})")
        if self.ngram_min > self.ngram_max:
            raise DynvocabError(f"--ngram-min ({self.ngram_min}) must not exceed --ngram-max ({self.ngram_max})")
        parse_tree(self.tree)
        if self.tree_sets not in TREE_SETS:
            raise DynvocabError(f"--tree-sets takes {' or '.join(TREE_SETS)} (got {self.tree_sets!r})")

    def decode(self, max_new_tokens: int, seed: int | None = None) -> DecodeConfig:
        """The :class:`~dynvocab.runtime.decoding.loop.DecodeConfig` these flags describe (``seed``: in place of
        theirs)."""
        values = {name: getattr(self, name) for name in _DECODING_FLAGS}
        if seed is not None:
            values["seed"] = seed
        return DecodeConfig(**values, max_new_tokens=max_new_tokens)

    def options(self) -> StrategyOptions:
        """The :class:`~dynvocab.runtime.registry.StrategyOptions` these flags describe."""
        return StrategyOptions(token_map=self.token_map, fr_size=self.fr_size, configs=self.configs)


_DECODING_FLAGS = tuple(f.name for f in dataclasses.fields(StrategyFlags) if f.name in vars(_DECODING))
_SHARED_TYPES = {
    "gamma": Gamma, "stop_below": StopBelow, "branch_below": BranchBelow, "temperature": Temperature, "top_p": TopP,
    "seed": Seed, "ngram_max": NgramMax, "ngram_min": NgramMin, "tree": Tree, "tree_sets": TreeSets,
    "token_map": TokenMap, "fr_size": FrSize, "bundle": BundleOpt,
}


def strategy_flag_params() -> list[inspect.Parameter]:
    """The options ``generate`` and ``bench`` share: the decoding flags and strategy inputs of
    :class:`StrategyFlags`, then one per flag the registered strategies contribute (its type and default are its
    config field's; its help names the strategies that read it), read from the registry as it is now."""
    params = [
        inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_SHARED_TYPES[f.name], default=f.default)
        for f in dataclasses.fields(StrategyFlags) if f.name in _SHARED_TYPES
    ]
    for flag, users in strategy_flags():
        config = users[0].config
        option = typer.Option(
            f"--{flag.name.replace('_', '-')}", min=flag.min, help=f"{', '.join(u.name for u in users)}: {flag.help}"
        )
        params.append(inspect.Parameter(
            flag.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[flag.value_type(config), option],
            default=flag.default(config),
        ))
    return params


def with_strategy_flags(command):
    """Give ``command`` the shared options (:func:`strategy_flag_params`) in place of its ``flags`` parameter, and
    those of :class:`LoadFlags` (:func:`load_flag_params`) in place of its parameter of that type, if any (typer reads
    the signature); the command receives them as one :class:`StrategyFlags` and one :class:`LoadFlags`."""
    return _StrategyCommand(command)


class _StrategyCommand:
    """``command`` as typer sees it through :func:`with_strategy_flags`. The signature is built each time typer
    reads it, so a strategy registered after this module was imported has its flags too."""

    def __init__(self, command):
        functools.update_wrapper(self, command)
        self.command = command

    @property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(self.command, eval_str=True)
        hints = typing.get_type_hints(self.command, include_extras=True)
        params = []
        for p in signature.parameters.values():
            if p.name == "flags":
                params += strategy_flag_params()
            elif hints.get(p.name) is LoadFlags:
                params += load_flag_params()
            else:
                params.append(p.replace(annotation=hints.get(p.name, p.annotation)))
        return signature.replace(parameters=params)

    def __call__(self, *args, **kwargs):
        shared = {n: kwargs.pop(n) for n in _SHARED_TYPES if n in kwargs}
        values = {flag.name: kwargs.pop(flag.name) for flag, _ in strategy_flags() if flag.name in kwargs}
        flags = StrategyFlags(**shared, configs=configs_from_flags(values))
        for name, hint in typing.get_type_hints(self.command, include_extras=True).items():
            if hint is LoadFlags:
                given = {f.name: kwargs.pop(f.name) for f in dataclasses.fields(LoadFlags) if f.name in kwargs}
                kwargs[name] = LoadFlags(**given)
        return self.command(*args, flags=flags, **kwargs)


def check_out(path: Path | str | None, flag: str) -> None:
    """Refuse an output path whose folder does not exist or cannot be written, before any model loads."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise DynvocabError(f"{flag} {path} is a folder; name a file in it")
    folder = path.parent
    if not folder.is_dir():
        raise DynvocabError(f"folder {folder} for {flag} does not exist; create it or pick another {flag}")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise DynvocabError(f"folder {folder} for {flag} cannot be written ({exc.strerror}); pick another {flag}") from None
