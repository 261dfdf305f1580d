"""``build-index``: run the requested stages and write them, with any kept stages, into one bundle."""

from __future__ import annotations

import gc
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dynvocab.artifacts import Bundle, ModelFingerprint, Stage, load_bundle, write_bundle
from dynvocab.builders import clusters as clusters_stage
from dynvocab.builders.checkpoints import StageCheckpoints
from dynvocab.builders import freq as freq_stage
from dynvocab.builders import graph as graph_stage
from dynvocab.builders import hnsw as hnsw_stage
from dynvocab.builders.corpus import CorpusConfig, check_sources, iter_documents
from dynvocab.builders.counting import count_corpus
from dynvocab.builders.models import end_token_ids, fingerprint, hidden_states, load_head
from dynvocab.errors import DynvocabError
from dynvocab.models import ModelSpec, default_device, load_tokenizer, match_vocabularies, resolve_model
from dynvocab.progress import Reporter, SilentReporter

STAGES = ("freq", "clusters", "hnsw", "graph", "draft_hnsw")
HNSW_STAGES = {"hnsw": "target", "draft_hnsw": "draft"}  # index over whose LM-head rows
CORPUS_STAGES = ("freq", "graph")
DEPENDS_ON = {"router": ("clusters",)}  # a kept stage is dropped when a stage it was trained on is rebuilt


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
    info: dict  # as stored in the bundle: build time, statistics, corpus


@dataclass(frozen=True)
class BuildReport:
    """The result of a build: the file, the stages built and kept."""

    path: Path
    built: list[StageReport]
    kept: list[str]
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


@dataclass(frozen=True)
class _Models:
    """The resolved pair, their tokenizers and fingerprints."""

    target: ModelSpec
    draft: ModelSpec
    target_tokenizer: object
    target_fp: ModelFingerprint
    draft_fp: ModelFingerprint


def _stage(reporter: Reporter, name: str, start: float, tensors: dict, config: dict, stats: dict, extra: dict | None = None) -> Stage:
    """A built stage with its build info; logs its one-line summary."""
    seconds = time.perf_counter() - start
    stage = Stage(name, tensors, config, {"built_at": _now(), "seconds": round(seconds, 2), **stats, **(extra or {})})
    reporter.log(f"{name}: {seconds:.1f} s · {stage.nbytes / 1e6:.1f} MB · {_brief(stats)}")
    return stage


def _corpus_stages(m: _Models, cfg: BuildConfig, reporter: Reporter) -> list[Stage]:
    """freq and/or graph from one tokenization pass over the corpus."""
    start = time.perf_counter()
    with reporter.task("tokenize corpus (documents)", total=None) as advance:
        counts = count_corpus(
            iter_documents(cfg.corpus), m.target_tokenizer, m.target_fp.head_rows, bigrams="graph" in cfg.stages, advance=advance
        )
    seconds = time.perf_counter() - start
    corpus = {**cfg.corpus.describe(), "docs": counts.docs, "tokens": counts.tokens, "seconds": round(seconds, 2)}
    reporter.log(f"corpus: {counts.docs:,} documents · {counts.tokens:,} tokens · {seconds:.1f} s")
    stages = []
    if "freq" in cfg.stages:
        start = time.perf_counter()
        table = freq_stage.build(cfg.freq, counts.unigrams, end_token_ids(m.target, m.target_tokenizer))
        stats = freq_stage.summary(cfg.freq, table)
        stages.append(_stage(reporter, "freq", start, table.to_tensors(), cfg.freq.as_dict(), stats, {"corpus": corpus}))
    if "graph" in cfg.stages:
        start = time.perf_counter()
        graph = graph_stage.build(cfg.graph, counts.bigram_keys, counts.bigram_counts, m.target_fp.head_rows)
        stats = graph_stage.summary(graph)
        stages.append(_stage(reporter, "graph", start, graph.to_tensors(), cfg.graph.as_dict(), stats, {"corpus": corpus}))
    return stages


def _clusters(m: _Models, cfg: BuildConfig, device: str, reporter: Reporter) -> Stage:
    start = time.perf_counter()
    head = load_head(m.draft)  # [V_draft, d_draft]
    with reporter.task("clusters (k-means iterations)", total=cfg.clusters.max_iters) as advance:
        table, stats = clusters_stage.build(cfg.clusters, head, device, advance)
    return _stage(reporter, "clusters", start, table.to_tensors(), cfg.clusters.as_dict(), stats)


def _hnsw(m: _Models, cfg: BuildConfig, device: str, reporter: Reporter, name: str = "hnsw") -> Stage:
    """An HNSW index over the LM-head rows of the stage's model (``hnsw``: the target, EvoSpec's retrieval;
    ``draft_hnsw``: the draft, the hybrid's per-step retrieval), preconditioned on that model's hidden states
    of some corpus documents, recall measured on others."""
    start, h = time.perf_counter(), cfg.hnsw
    role = HNSW_STAGES[name]
    spec = m.target if role == "target" else m.draft
    docs = list(itertools.islice(iter_documents(cfg.corpus), h.recall_docs + h.fit_docs))
    if len(docs) <= h.recall_docs:
        raise DynvocabError(f"the corpus has {len(docs)} documents; the {name} stage needs more than {h.recall_docs}")
    with reporter.task(f"{name} queries ({role} hidden states)", total=None):
        states = hidden_states(spec, m.target_tokenizer, docs, h.query_tokens, device)  # [T_i, d] each
    eval_queries, fit_queries = torch.cat(states[: h.recall_docs]), torch.cat(states[h.recall_docs :])
    del states
    gc.collect()
    head = load_head(spec)  # [V, d] of that model
    with reporter.task(f"{name} (rows indexed)", total=head.shape[0]) as advance:
        tensors, params, stats = hnsw_stage.build(h, head, fit_queries, eval_queries, advance)
    return _stage(reporter, name, start, tensors, h.as_dict(), stats, {"index": params.as_dict(), "model": role})


def build_bundle(
    target: str, draft: str, out: str | Path, cfg: BuildConfig = BuildConfig(), reporter: Reporter = SilentReporter()
) -> BuildReport:
    """Build ``cfg.stages`` for the ``target``/``draft`` pair and write the bundle at ``out`` atomically.

    Stages of an existing bundle at ``out`` that are not rebuilt are kept, provided it was built for the same
    models. ``freq`` and ``graph`` share one tokenization pass over the corpus. Each finished stage is kept beside
    ``out`` until the bundle is written, so a build killed half-way and run again resumes after its last
    finished stage (:mod:`dynvocab.builders.checkpoints`).
    """
    t0 = time.perf_counter()
    out = Path(out)
    device = cfg.device or default_device()
    if not out.parent.is_dir():
        raise DynvocabError(f"folder {out.parent} does not exist; create it or pick another --out")
    check_sources(cfg.corpus)
    t_spec, d_spec = resolve_model(target), resolve_model(draft)
    t_tok, d_tok = load_tokenizer(t_spec), load_tokenizer(d_spec)
    m = _Models(t_spec, d_spec, t_tok, fingerprint(t_spec, t_tok), fingerprint(d_spec, d_tok))
    match_vocabularies(t_tok, d_tok, m.target_fp.head_rows, m.draft_fp.head_rows)
    old = _existing(out, cfg, m.target_fp, m.draft_fp, reporter)

    done = StageCheckpoints(out, m.target_fp, m.draft_fp, {**cfg.corpus.describe(), "device": device})
    configs = _stage_configs(cfg)
    stages = {name: stage for name in cfg.stages if (stage := done.load(name, configs[name])) is not None}
    if stages:
        reporter.log(f"resuming: {', '.join(stages)} finished by an earlier run of this build")

    def finished(stage: Stage) -> None:
        done.save(stage, configs[stage.name])
        stages[stage.name] = stage
        gc.collect()

    if any(s in cfg.stages and s not in stages for s in CORPUS_STAGES):
        for stage in _corpus_stages(m, cfg, reporter):
            finished(stage)
    if "clusters" in cfg.stages and "clusters" not in stages:
        finished(_clusters(m, cfg, device, reporter))
    for name in HNSW_STAGES:
        if name in cfg.stages and name not in stages:
            finished(_hnsw(m, cfg, device, reporter, name))

    ordered = [stages[name] for name in cfg.stages]
    built = [StageReport(s.name, s.info["seconds"], s.nbytes, s.info) for s in ordered]
    kept = _kept_stages(old, cfg, reporter)
    ordered += [old.load_stage(s) for s in kept]
    with reporter.task(f"writing {out.name}", total=None):
        write_bundle(out, ordered, m.target_fp, m.draft_fp)
    done.clear()
    return BuildReport(out, built, kept, time.perf_counter() - t0, out.stat().st_size)


def _stage_configs(cfg: BuildConfig) -> dict[str, dict]:
    """The config each stage's content depends on (the corpus and the models are keyed separately)."""
    return {
        "freq": cfg.freq.as_dict(), "graph": cfg.graph.as_dict(), "clusters": cfg.clusters.as_dict(),
        "hnsw": cfg.hnsw.as_dict(), "draft_hnsw": cfg.hnsw.as_dict(),
    }


def _kept_stages(old: Bundle | None, cfg: BuildConfig, reporter: Reporter) -> list[str]:
    """Stages of the existing bundle to carry over: not rebuilt, and not depending on a rebuilt stage."""
    if old is None:
        return []
    kept = []
    for name in old.stages:
        stale = [d for d in DEPENDS_ON.get(name, ()) if d in cfg.stages]
        if stale:
            reporter.log(f"dropping stage {name}: it was made from the old {', '.join(stale)}; build it again")
        elif name not in cfg.stages:
            kept.append(name)
    return kept


def _brief(stats: dict) -> str:
    parts = []
    for key, value in stats.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v:.1%}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items())
        elif isinstance(value, float):
            value = f"{value:g}"
        parts.append(f"{key} {value}")
    return " · ".join(parts)
