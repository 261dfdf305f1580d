"""``build-index``: run the requested stages and write them, with any kept stages, into one bundle."""

from __future__ import annotations

import gc
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

from dynvocab.artifacts import Bundle, ModelFingerprint, Stage, load_bundle, write_bundle
from dynvocab.builders import clusters as clusters_stage
from dynvocab.builders import freq as freq_stage
from dynvocab.builders import graph as graph_stage
from dynvocab.builders import hnsw as hnsw_stage
from dynvocab.builders.corpus import CorpusConfig, check_sources, iter_documents
from dynvocab.builders.counting import CorpusCounts, count_corpus
from dynvocab.builders.models import end_token_ids, fingerprint, load_head, target_hidden_states
from dynvocab.builders.progress import Reporter, SilentReporter
from dynvocab.errors import DynvocabError
from dynvocab.models import default_device, load_tokenizer, match_vocabularies, resolve_model

STAGES = ("freq", "clusters", "hnsw", "graph")
CORPUS_STAGES = ("freq", "graph")


@dataclass(frozen=True)
class BuildConfig:
    """Everything a build needs besides the models and the output path; each default lives in its stage config."""

    stages: tuple[str, ...] = STAGES
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    freq: freq_stage.FreqConfig = field(default_factory=freq_stage.FreqConfig)
    clusters: clusters_stage.ClustersConfig = field(default_factory=clusters_stage.ClustersConfig)
    hnsw: hnsw_stage.HnswConfig = field(default_factory=hnsw_stage.HnswConfig)
    graph: graph_stage.GraphConfig = field(default_factory=graph_stage.GraphConfig)
    device: str | None = None  # k-means and the recall-query target pass (None: cuda when visible, else cpu)


@dataclass(frozen=True)
class StageReport:
    """What one stage took and made."""

    name: str
    seconds: float
    nbytes: int
    stats: dict


@dataclass(frozen=True)
class BuildReport:
    """The result of a build: the file, the stages built and kept, the corpus pass."""

    path: Path
    built: list[StageReport]
    kept: list[str]
    corpus: dict | None
    seconds: float
    file_bytes: int


def parse_stages(text: str) -> tuple[str, ...]:
    """``freq,hnsw`` -> ("freq", "hnsw") in pipeline order; unknown names are refused."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in STAGES]
    if unknown or not names:
        raise DynvocabError(f"unknown stage(s) {', '.join(unknown) or '(none)'}; use a comma-separated subset of {','.join(STAGES)}")
    return tuple(s for s in STAGES if s in names)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _existing(out: Path, cfg: BuildConfig, target: ModelFingerprint, draft: ModelFingerprint, reporter: Reporter) -> Bundle | None:
    """The bundle already at ``out`` whose other stages are kept, or None when everything is rebuilt."""
    full = set(cfg.stages) == set(STAGES)
    if not out.exists():
        return None
    try:
        old = load_bundle(out)
    except DynvocabError:
        if full:
            reporter.log(f"replacing unreadable {out}")
            return None
        raise
    kept = [s for s in old.stages if s not in cfg.stages]
    if not kept:
        return None
    diffs = {role: old.fingerprints[role].differences(fp) for role, fp in (("target", target), ("draft", draft)) if role in old.fingerprints}
    wrong = [role for role, d in diffs.items() if d]
    if wrong:
        if full:
            reporter.log(f"dropping stage(s) {', '.join(kept)} of {out}: built for another {wrong[0]}")
            return None
        raise DynvocabError(
            f"{out} was built for a different {wrong[0]} ({'; '.join(diffs[wrong[0]])}); "
            f"rebuild all stages (--stages {','.join(STAGES)}) or write to another --out"
        )
    old.verify()
    return old


def _corpus_pass(tokenizer, rows: int, cfg: BuildConfig, reporter: Reporter) -> tuple[CorpusCounts, float]:
    start = time.perf_counter()
    with reporter.task("tokenize corpus", total=None) as advance:
        counts = count_corpus(iter_documents(cfg.corpus), tokenizer, rows, bigrams="graph" in cfg.stages, advance=advance)
    return counts, time.perf_counter() - start


def build_bundle(
    target: str, draft: str, out: str | Path, cfg: BuildConfig = BuildConfig(), reporter: Reporter = SilentReporter()
) -> BuildReport:
    """Build ``cfg.stages`` for the ``target``/``draft`` pair and write the bundle at ``out`` atomically.

    Stages of an existing bundle at ``out`` that are not rebuilt are kept, provided it was built for the same
    models. ``freq`` and ``graph`` share one tokenization pass over the corpus.
    """
    t0 = time.perf_counter()
    out = Path(out)
    device = cfg.device or default_device()
    if not out.parent.is_dir():
        raise DynvocabError(f"folder {out.parent} does not exist; create it or pick another --out")
    check_sources(cfg.corpus)
    t_spec, d_spec = resolve_model(target), resolve_model(draft)
    t_tok, d_tok = load_tokenizer(t_spec), load_tokenizer(d_spec)
    t_fp, d_fp = fingerprint(t_spec, t_tok), fingerprint(d_spec, d_tok)
    match_vocabularies(t_tok, d_tok, t_fp.head_rows, d_fp.head_rows)
    old = _existing(out, cfg, t_fp, d_fp, reporter)

    stages: list[Stage] = []
    reports: list[StageReport] = []

    def add(name: str, seconds: float, tensors: dict, config: dict, stats: dict, extra: dict | None = None) -> None:
        stage = Stage(name, tensors, config, {"built_at": _now(), "seconds": round(seconds, 2), **stats, **(extra or {})})
        stages.append(stage)
        reports.append(StageReport(name, seconds, stage.nbytes, stats))
        reporter.log(f"{name}: {seconds:.1f} s · {stage.nbytes / 1e6:.1f} MB · {_brief(stats)}")

    corpus_info = None
    if any(s in cfg.stages for s in CORPUS_STAGES):
        counts, seconds = _corpus_pass(t_tok, t_fp.head_rows, cfg, reporter)
        corpus_info = {**cfg.corpus.describe(), "docs": counts.docs, "tokens": counts.tokens, "seconds": round(seconds, 2)}
        reporter.log(f"corpus: {counts.docs:,} documents · {counts.tokens:,} tokens · {seconds:.1f} s")
        if "freq" in cfg.stages:
            start = time.perf_counter()
            table = freq_stage.build(cfg.freq, counts.unigrams, end_token_ids(t_spec, t_tok))
            add("freq", time.perf_counter() - start, table.to_tensors(), cfg.freq.as_dict(),
                freq_stage.summary(cfg.freq, table), {"corpus": corpus_info})
        if "graph" in cfg.stages:
            start = time.perf_counter()
            table = graph_stage.build(cfg.graph, counts.bigram_keys, counts.bigram_counts, t_fp.head_rows)
            add("graph", time.perf_counter() - start, table.to_tensors(), cfg.graph.as_dict(),
                graph_stage.summary(table), {"corpus": corpus_info})
        del counts
        gc.collect()

    if "clusters" in cfg.stages:
        start = time.perf_counter()
        head = load_head(d_spec)  # [V_draft, d_draft]
        with reporter.task("clusters (k-means iterations)", total=cfg.clusters.max_iters) as advance:
            table, stats = clusters_stage.build(cfg.clusters, head, device, advance)
        del head
        add("clusters", time.perf_counter() - start, table.to_tensors(), cfg.clusters.as_dict(), stats)

    if "hnsw" in cfg.stages:
        start = time.perf_counter()
        docs = list(itertools.islice(iter_documents(cfg.corpus), cfg.hnsw.recall_docs))
        with reporter.task("hnsw recall queries (target hidden states)", total=None):
            queries = target_hidden_states(t_spec, t_tok, docs, cfg.hnsw.recall_tokens, device)  # [n, d]
        head = load_head(t_spec)  # [V_target, d_target]
        with reporter.task("hnsw (rows indexed)", total=head.shape[0]) as advance:
            data, params, stats = hnsw_stage.build(cfg.hnsw, head, queries, advance)
        del head, queries
        gc.collect()
        add("hnsw", time.perf_counter() - start, {"index": data}, cfg.hnsw.as_dict(), stats, {"index": params.as_dict()})

    kept = [s for s in old.stages if s not in cfg.stages] if old is not None else []
    stages += [old.load_stage(s) for s in kept]
    with reporter.task(f"writing {out.name}", total=None):
        write_bundle(out, stages, t_fp, d_fp)
    return BuildReport(out, reports, kept, corpus_info, time.perf_counter() - t0, out.stat().st_size)


def _brief(stats: dict) -> str:
    parts = []
    for key, value in stats.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v:.1%}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items())
        elif isinstance(value, float):
            value = f"{value:g}"
        parts.append(f"{key} {value}")
    return " · ".join(parts)
