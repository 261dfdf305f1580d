"""``dynvocab build-index``, ``inspect`` and ``export``: make, look into, and convert a bundle."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from dynvocab.artifacts.export import formats
from dynvocab.budget import FR_SIZE
from dynvocab.builders.clusters import ClustersConfig
from dynvocab.builders.corpus import CorpusConfig
from dynvocab.builders.hnsw import HnswConfig
from dynvocab.builders.stages import build_stage_names
from dynvocab.cli.common import Device, DraftModel, Target, check_dtype_device, check_out, err_console, one_line_errors
from dynvocab.errors import DynvocabError
from dynvocab.progress import make_reporter
from dynvocab.runtime.batched import batch_strategies


def _override(cfg, **values):
    """The frozen config ``cfg`` with the options the user gave (None = keep the default)."""
    return replace(cfg, **{k: v for k, v in values.items() if v is not None})


@one_line_errors
def build_index(
    out: Annotated[Path, typer.Option("--out", help="The bundle to write (.safetensors); other stages in it are kept.")],
    target: Target = "demo:target",
    draft: DraftModel = "demo:draft",
    corpus: Annotated[
        Optional[List[str]],
        typer.Option(help="sharegpt (training split), slimpajama, python-stubs (code prompts from this Python's standard library), debian-faq (the Debian FAQ's training split in nine languages, from Debian's debian-faq packages), debian-faq-translate (its English training sections asked into each other language), licences (the training split of /usr/share/common-licenses), or a .txt/.jsonl/.json/.parquet file or saved datasets folder; repeatable."),
    ] = None,
    max_docs: Annotated[Optional[int], typer.Option(min=1, help=f"Read at most this many documents (default {CorpusConfig.max_docs:,}).")] = None,
    stages: Annotated[Optional[str], typer.Option(help=f"Comma-separated stages to (re)build, from {','.join(build_stage_names())} (default: all).")] = None,
    num_clusters: Annotated[Optional[int], typer.Option(min=1, help=f"clusters: number of clusters M (default {ClustersConfig.num_clusters}).")] = None,
    hnsw_m: Annotated[Optional[int], typer.Option(min=1, help=f"hnsw: graph degree M (default {HnswConfig.m}).")] = None,
    ef_construction: Annotated[Optional[int], typer.Option(min=1, help=f"hnsw: ef at construction (default {HnswConfig.ef_construction}).")] = None,
    ef_search: Annotated[Optional[int], typer.Option(min=1, help=f"hnsw: ef at search time (default {HnswConfig.ef_search}).")] = None,
    hnsw_rank: Annotated[Optional[int], typer.Option(min=1, help=f"hnsw: dimensions of the projection the graph is built on (default {HnswConfig.rank}).")] = None,
    hnsw_candidates: Annotated[Optional[int], typer.Option(min=1, help=f"hnsw: rows the graph proposes for the exact re-rank (default {HnswConfig.candidates}).")] = None,
    hnsw_threads: Annotated[
        Optional[int],
        typer.Option(
            min=-1,
            help="hnsw: threads inserting rows (default all cores: fastest, but the graph, not its recall, differs "
            "between builds; 1: every build writes the same bytes).",
        ),
    ] = None,
    device: Device = None,
) -> None:
    """Build the offline tables (the stages --stages names) for a target/draft pair into one bundle."""
    from dynvocab import api
    from dynvocab.builders.pipeline import BuildConfig, parse_stages

    check_dtype_device(device, None)
    check_out(out, "--out")
    if hnsw_threads == 0:
        raise DynvocabError("--hnsw-threads must be -1 (all cores) or at least 1")
    base = BuildConfig()
    cfg = BuildConfig(
        stages=parse_stages(stages) if stages is not None else build_stage_names(),
        corpus=_override(base.corpus, sources=tuple(corpus) if corpus else None, max_docs=max_docs),
        clusters=_override(base.clusters, num_clusters=num_clusters),
        hnsw=_override(
            base.hnsw,
            m=hnsw_m,
            ef_construction=ef_construction,
            ef_search=ef_search,
            rank=hnsw_rank,
            candidates=hnsw_candidates,
            num_threads=hnsw_threads,
        ),
        device=device,
    )
    with make_reporter(err_console) as reporter:
        report = api.build_index(out, target, draft, cfg, reporter)
    kept = f" · kept {', '.join(report.kept)}" if report.kept else ""
    err_console.print(
        f"wrote {report.path} · {report.file_bytes / 1e6:.1f} MB · {report.seconds:.1f} s{kept}",
        highlight=False, soft_wrap=True,
    )


def describe_bundle(bundle) -> dict:
    """Everything ``inspect`` shows, as JSON-ready data (with what each stage's registry entry adds)."""
    from dynvocab.artifacts import find_stage

    stages = {}
    for name in bundle.stages:
        entry = {
            "config": bundle.config(name),
            "info": bundle.info(name),
            "bytes": bundle.stage_nbytes(name),
            "sha256": bundle.stage_checksum(name),
            "tensors": {
                t: {"dtype": bundle.entries[f"{name}.{t}"].dtype, "shape": list(bundle.entries[f"{name}.{t}"].shape)}
                for t in bundle.tensor_names(name)
            },
        }
        kind = find_stage(name)
        if kind is not None and kind.describe is not None:
            entry.update(kind.describe(bundle))
        stages[name] = entry
    return {
        "path": str(bundle.path),
        "format_version": bundle.metadata["format_version"],
        "written_at": bundle.metadata["written_at"],
        "dynvocab_version": bundle.metadata["dynvocab_version"],
        "file_bytes": bundle.path.stat().st_size,
        "fingerprint": {role: fp.as_dict() for role, fp in bundle.fingerprints.items()},
        "checksums": checksum_note(bundle),
        "stages": stages,
    }


def checksum_note(bundle) -> str:
    """What ``inspect`` says of the bundle's checksums (it verified every one before describing the bundle)."""
    if bundle.has_checksums:
        return "sha256 per tensor, all verified"
    written = bundle.metadata["written_at"] or "at an unknown time"
    return f"no checksum (built before bundles carried checksums; written {written})"


@one_line_errors
def inspect(
    bundle_path: Annotated[Path, typer.Argument(metavar="BUNDLE", help="A bundle written by build-index.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """Show a bundle's stages, sizes, configs, model fingerprint and the corpus coverage of the top-K tokens."""
    from dynvocab.artifacts import find_stage, load_bundle

    info = describe_bundle(load_bundle(bundle_path, verify=True))
    if json_out:
        print(json.dumps(info, ensure_ascii=False))
        return
    console = Console()
    console.print(
        f"[bold]{info['path']}[/] · format v{info['format_version']} · {info['file_bytes'] / 1e6:.1f} MB · "
        f"written {info['written_at']} · {info['checksums']}", highlight=False,
    )
    for role, fp in info["fingerprint"].items():
        console.print(
            f"{role}: {fp['source'] or '?'} · vocab {fp['vocab_size']:,} · head {fp['head_rows']:,}×{fp['hidden_size']} "
            f"· tokenizer {fp['tokenizer_sha256'][:12]}", highlight=False,
        )
    table = Table(title="stages")
    for col in ("stage", "size", "recall", "tensors", "built"):
        table.add_column(col)
    for name, st in info["stages"].items():
        tensors = "\n".join(f"{t} {v['dtype']} {tuple(v['shape'])}" for t, v in st["tensors"].items())
        built = f"{st['info'].get('built_at', '?')}\nin {st['info'].get('seconds', '?')} s"
        sha = f"\nsha256 {st['sha256'][:12]}" if st["sha256"] else "\nno checksum"
        recall = "\n".join(f"{k} {v:.3f}" for k, v in st["info"].items() if k.startswith("recall@")) or "–"
        table.add_row(name, f"{st['bytes'] / 1e6:.1f} MB{sha}", recall, tensors, built)
    console.print(table)
    for name, st in info["stages"].items():
        skip = ("built_at", "seconds", "corpus", "index", "coverage")
        console.print(f"[bold]{name}[/] config: " + ", ".join(f"{k}={v}" for k, v in st["config"].items()), soft_wrap=True)
        stats = ", ".join(f"{k}={v}" for k, v in st["info"].items() if k not in skip)
        if stats:
            console.print(f"[bold]{name}[/] stats: {stats}", soft_wrap=True)
    for name, st in info["stages"].items():
        kind = find_stage(name)
        if kind is not None and kind.headline is not None:
            console.print(kind.headline(st), highlight=False, soft_wrap=True)


@one_line_errors
def export(
    bundle_path: Annotated[Path, typer.Argument(metavar="BUNDLE", help="A bundle (sglang, eagle3: with a freq stage; vllm: with the stages --strategy reads).")],
    out: Annotated[Path, typer.Option("--out", help="The file to write (torch.save), or for vllm the folder (new or empty).")],
    fmt: Annotated[str, typer.Option("--format", help=f"One of {', '.join(formats())}. " + "; ".join(f"{f.name}: {f.help}" for f in formats().values()) + ".")] = "sglang",
    size: Annotated[Optional[int], typer.Option(min=1, help=f"sglang, eagle3: number of token ids K (default {FR_SIZE}).")] = None,
    strategy: Annotated[Optional[str], typer.Option(help=f"vllm: the selector the draft's head runs, one of {', '.join(batch_strategies())}; on an EAGLE head also S+ngram (the request's own tokens looked up first).")] = None,
    draft: Annotated[Optional[str], typer.Option(help="vllm: the draft the bundle was built for: a local model folder, demo:draft, or an EAGLE head (eagle layout).")] = None,
    budget: Annotated[Optional[int], typer.Option(min=1, help="vllm: the selector's size (fr: ids; lowrank: candidates; centroids: blocks; default: the bundle's).")] = None,
    copy: Annotated[bool, typer.Option("--copy", help="vllm: copy the draft's files into the folder instead of linking them.")] = False,
    gamma: Annotated[Optional[int], typer.Option(min=1, help="vllm: draft tokens per cycle (num_speculative_tokens) in the speculative_config export prints.")] = None,
    schedule: Annotated[Optional[str], typer.Option(metavar="START:K,…|BENCH.json", help="vllm (with --gamma): speculate k tokens from each batch size on, 0 = none, e.g. 1:3,4:0; or the JSON of `bench --vllm --schedule auto`, whose pick is taken. Printed as speculative_config's num_speculative_tokens_per_batch_size.")] = None,
) -> None:
    """Export the bundle for another system: an SGLang/FR-Spec token map, EAGLE-3 d2t/t2d, or a vLLM draft folder."""
    from dynvocab.artifacts.export import ExportRequest, export_bundle, lookup_format

    if not lookup_format(fmt).folder:
        check_out(out, "--out")
    request = ExportRequest(size=size, strategy=strategy, draft=draft, budget=budget, copy=copy, gamma=gamma,
                            schedule=schedule)
    done = export_bundle(bundle_path, out, fmt, request)
    err_console.print(f"wrote {done.path} ({done.summary})", highlight=False, soft_wrap=True)
    for note in done.notes:
        err_console.print(note, highlight=False, soft_wrap=True, markup=False)
