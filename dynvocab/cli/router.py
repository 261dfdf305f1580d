"""``dynvocab train-router``: train DynaSpec's cluster router on the draft and add it to a bundle."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Annotated, List, Optional

import typer
from rich.table import Table

from dynvocab.builders.router import SELECTORS, RouterConfig, SelectorConfig, TrainRouterConfig
from dynvocab.cli.common import Device, DraftModel, check_dtype_device, check_out, err_console, one_line_errors
from dynvocab.errors import DynvocabError
from dynvocab.progress import make_reporter

_DEFAULTS = TrainRouterConfig()


def _override(cfg, **values):
    """The frozen config ``cfg`` with the options the user gave (None = keep the default)."""
    return replace(cfg, **{k: v for k, v in values.items() if v is not None})


@one_line_errors
def train_router(
    bundle: Annotated[Path, typer.Option("--bundle", help="Bundle built for the draft (with a clusters stage for the router); the trained stages are added to it.")],
    draft: DraftModel = "demo:draft",
    selector: Annotated[
        str, typer.Option(help=f"Selectors to train on one data pass, comma-separated: {', '.join(SELECTORS)} "
                               "(DynaSpec's cluster router; the low-rank scorer; the centroid blocks).")
    ] = "router",
    target: Annotated[
        Optional[str], typer.Option(help="Target model; when given, the bundle must have been built for it too.")
    ] = None,
    corpus: Annotated[
        Optional[List[str]],
        typer.Option(help="sharegpt (training split, chat-template encoded), or .txt/.jsonl/.json/.parquet files; repeatable."),
    ] = None,
    max_docs: Annotated[Optional[int], typer.Option(min=1, help=f"Documents to run the draft over (default {_DEFAULTS.corpus.max_docs}).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(min=1, help=f"Tokens per document (default {RouterConfig.max_tokens}).")] = None,
    epochs: Annotated[Optional[int], typer.Option(min=1, help=f"Training epochs (default {RouterConfig.epochs}).")] = None,
    top_l: Annotated[Optional[int], typer.Option(min=1, help=f"Positives: clusters of the draft's top-L tokens (default {RouterConfig.top_l}).")] = None,
    hidden: Annotated[Optional[int], typer.Option(min=1, help=f"Hidden units of the router MLP (default {RouterConfig.width}).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(min=1, help=f"Training batch size (default {RouterConfig.batch_size}).")] = None,
    lr: Annotated[Optional[float], typer.Option(help=f"AdamW learning rate (default {RouterConfig.lr:g}).")] = None,
    k_max: Annotated[Optional[int], typer.Option(min=1, help=f"Cluster budget k_max the recall report centres on (default {RouterConfig.k_max}).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the initialisation and the batch order.")] = None,
    rank: Annotated[Optional[int], typer.Option(min=1, help=f"lowrank: rank r of the scorer (default {SelectorConfig.rank}).")] = None,
    block_size: Annotated[Optional[int], typer.Option(min=1, help=f"centroids: ids per block (default {SelectorConfig.block_size}).")] = None,
    selector_epochs: Annotated[Optional[int], typer.Option(min=1, help=f"lowrank / centroids: training epochs (default {SelectorConfig.epochs}).")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write the bundle here instead of updating --bundle in place.")] = None,
    device: Device = None,
    dtype: Annotated[Optional[str], typer.Option(help=f"The draft's dtype for the data pass (default {_DEFAULTS.dtype}).")] = None,
) -> None:
    """Train vocabulary selectors on the draft's top-L predictions (DynaSpec's cluster router, the lowrank and
    centroids candidate selectors) from one data pass; add them to the bundle with their held-out recall."""
    from dynvocab import api

    check_dtype_device(device, dtype)
    check_out(out if out is not None else bundle, "--out")
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise DynvocabError(f"--lr must be a finite number > 0 (got {lr})")
    cfg = TrainRouterConfig(
        corpus=_override(_DEFAULTS.corpus, sources=tuple(corpus) if corpus else None, max_docs=max_docs),
        router=_override(RouterConfig(), max_tokens=max_tokens, epochs=epochs, top_l=top_l, width=hidden,
                         batch_size=batch_size, lr=lr, k_max=k_max, seed=seed),
        selectors=tuple(dict.fromkeys(k.strip() for k in selector.split(",") if k.strip())),
        selector=_override(SelectorConfig(), rank=rank, block_size=block_size, epochs=selector_epochs, seed=seed),
        device=device,
        dtype=dtype or _DEFAULTS.dtype,
    )
    with make_reporter(err_console) as reporter:
        report = api.train_router(bundle, draft, target, cfg, out, reporter)
    if report.recall:
        err_console.print(_recall_table(report.recall, cfg.router.k_max))
    for kind, sel in report.selectors.items():
        err_console.print(_selector_table(kind, sel))
    sched = report.recall.get("schedule")
    if sched:
        err_console.print(
            f"position-aware schedule (γ={sched['gamma']}): mean shortlist {sched['mean_shortlist']:,.0f} ids · "
            f"top-1 recall {sched['top1_recall']:.1%}", highlight=False,
        )
    err_console.print(
        f"wrote {report.path} · {', '.join(cfg.selectors)} · {report.docs:,} docs · {report.train_rows:,} train positions · "
        f"data {report.collect_s:.1f} s · training {report.train_s:.1f} s · total {report.seconds:.1f} s",
        highlight=False, soft_wrap=True,
    )


def _recall_table(recall: dict, k_max: int) -> Table:
    table = Table(title="held-out router recall")
    for col in ("clusters k", "cluster recall", "top-1 recall", "static top-1", "mean shortlist"):
        table.add_column(col, justify="right")
    for k, r in recall.items():
        if k == "schedule":
            continue
        mark = " (k_max)" if int(k) == k_max else ""
        static = f"{r['static_top1_recall']:.1%}" if "static_top1_recall" in r else "-"
        table.add_row(f"{k}{mark}", f"{r['cluster_recall']:.1%}", f"{r['top1_recall']:.1%}", static, f"{r['mean_shortlist']:,.0f}")
    return table


def _selector_table(kind: str, sel: dict) -> Table:
    unit = "candidate ids" if kind == "lowrank" else "blocks"
    table = Table(title=f"held-out {kind} recall of the draft's top-1 / top-2 (untrained in brackets)")
    for col in (unit, "ids", "top-1 recall", "top-2 recall"):
        table.add_column(col, justify="right")
    for b, r in sel["recall"].items():
        u = sel["untrained_recall"].get(b, {})
        mark = " (default)" if int(b) == sel["budget"] else ""
        table.add_row(f"{int(b):,}{mark}", f"{r['ids']:,.0f}", f"{r['top1_recall']:.1%} ({u.get('top1_recall', 0):.1%})",
                      f"{r['top2_recall']:.1%} ({u.get('top2_recall', 0):.1%})")
    return table
