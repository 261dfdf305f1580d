"""The ``dynvocab`` command line: a typer app with one module per command family."""

from __future__ import annotations

import os
import sys

import typer
from typer._click.exceptions import NoArgsIsHelpError  # typer >= 0.25 carries its own click
from typer.core import TyperGroup

# The CLI renders its own progress; keep transformers' bars and advisory logs off the terminal.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from dynvocab.cli import bench as _bench
from dynvocab.cli import build as _build
from dynvocab.cli import generate as _generate
from dynvocab.cli import microbench as _microbench
from dynvocab.errors import DynvocabError

class OneLineUsageErrors(TyperGroup):
    """The app's command group: a bad option value or a missing argument is one ``error: …`` line too."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except typer.TyperException as exc:
            command = _subcommand_path(getattr(exc, "ctx", None))
            print(f"error: {exc.format_message()} (see `dynvocab{command} --help`)", file=sys.stderr)
            sys.exit(exc.exit_code)
        except typer.Abort:
            print("error: interrupted", file=sys.stderr)
            sys.exit(130)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


def _subcommand_path(ctx) -> str:
    """`` microbench kernels`` for a context of ``dynvocab microbench kernels`` ("" for the app's own)."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    return "".join(f" {name}" for name in names)


app = typer.Typer(
    cls=OneLineUsageErrors,
    name="dynvocab",
    help="Lossless speculative decoding with a small, context-dependent draft vocabulary.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("generate")(_generate.generate)
app.command("bench")(_bench.bench)
app.add_typer(_microbench.app, name="microbench")
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
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
