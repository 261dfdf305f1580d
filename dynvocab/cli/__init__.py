"""The ``dynvocab`` command line: a typer app with one module per command family."""

from __future__ import annotations

import os
import sys

import typer

# The CLI renders its own progress; keep transformers' bars and advisory logs off the terminal.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from dynvocab.cli import bench as _bench
from dynvocab.cli import build as _build
from dynvocab.cli import generate as _generate
from dynvocab.errors import DynvocabError

app = typer.Typer(
    name="dynvocab",
    help="Lossless speculative decoding with a small, context-dependent draft vocabulary.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("generate")(_generate.generate)
app.command("bench")(_bench.bench)
app.command("build-index")(_build.build_index)
app.command("inspect")(_build.inspect)
app.command("export")(_build.export)
app.command("train-router")(__import__("dynvocab.cli.router", fromlist=["train_router"]).train_router)
app.command("train-draft")(__import__("dynvocab.cli.train_draft", fromlist=["train_draft"]).train_draft)


def main() -> None:
    """Console entry point: run the app; a DynvocabError becomes one line on stderr and exit code 1."""
    try:
        app(standalone_mode=True)
    except DynvocabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
