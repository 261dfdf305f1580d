"""``build-index``: run the requested stages and write them, with any kept stages, into one bundle.

Which stages exist, what each reads and how it is made come from the stage registries
(:mod:`dynvocab.builders.stages`, :mod:`dynvocab.artifacts.stages`); this module only runs them: the shared
corpus pass before the first stage that needs its counts (freed after the last), each stage checkpointed as it
finishes, the stages of an existing bundle kept unless they were made from a rebuilt one.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TypeVar

from dynvocab.artifacts import Bundle, ModelFingerprint, Stage, find_stage, load_bundle, write_bundle
from dynvocab.builders import clusters as clusters_stage
from dynvocab.builders import freq as freq_stage
from dynvocab.builders import graph as graph_stage
from dynvocab.builders import hnsw as hnsw_stage
from dynvocab.builders.checkpoints import StageCheckpoints
from dynvocab.builders.corpus import CorpusConfig, check_sources, iter_labelled_documents
from dynvocab.builders.counting import count_corpus
from dynvocab.builders.models import fingerprint, resolve_draft_model
from dynvocab.builders.stages import (
    BIGRAMS, CORPUS_PASS, BuildInputs, Built, StageBuilder, build_stage_names, config_dict, lookup_builder,
)
from dynvocab.errors import DynvocabError
from dynvocab.models import default_device, load_tokenizer, match_vocabularies, resolve_model
from dynvocab.progress import Reporter, SilentReporter

C = TypeVar("C")


@dataclass(frozen=True)
class BuildConfig:
    """Everything a build needs besides the models and the output path; each default lives in its stage config."""

    stages: tuple[str, ...] = field(default_factory=build_stage_names)  # default: every registered stage
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    freq: freq_stage.FreqConfig = field(default_factory=freq_stage.FreqConfig)
    clusters: clusters_stage.ClustersConfig = field(default_factory=clusters_stage.ClustersConfig)
    hnsw: hnsw_stage.HnswConfig = field(default_factory=hnsw_stage.HnswConfig)
    graph: graph_stage.GraphConfig = field(default_factory=graph_stage.GraphConfig)
    device: str | None = None  # k-means and the recall-query target pass (None: cuda when visible, else cpu)
    configs: tuple = ()  # configs of other registered stages (a plugin's), found by type

    def config(self, kind: type[C]) -> C:
        """The config of type ``kind`` in force: a field's, one in ``configs``, else ``kind``'s defaults."""
        for value in (*(getattr(self, f.name) for f in fields(self)), *self.configs):
            if type(value) is kind:
                return value
        return kind()


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
    """``freq,hnsw`` -> ("freq", "hnsw") in bundle order; unknown names are refused."""
    known = build_stage_names()
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in known]
    if unknown or not names:
        raise DynvocabError(f"unknown stage(s) {', '.join(unknown) or '(none)'}; use a comma-separated subset of {','.join(known)}")
    return tuple(s for s in known if s in names)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _existing(out: Path, cfg: BuildConfig, target: ModelFingerprint, draft: ModelFingerprint, reporter: Reporter) -> Bundle | None:
    """The bundle already at ``out`` whose other stages are kept, or None when everything is rebuilt."""
    full = set(cfg.stages) == set(build_stage_names())
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
            f"rebuild all stages (--stages {','.join(build_stage_names())}) or write to another --out"
        )
    old.verify()
    return old


def _stage(reporter: Reporter, name: str, start: float, built: Built, config: dict) -> Stage:
    """A built stage with its build info; logs its one-line summary."""
    seconds = time.perf_counter() - start
    info = {"built_at": _now(), "seconds": round(seconds, 2), **built.stats, **built.extra}
    stage = Stage(name, built.tensors, config, info)
    reporter.log(f"{name}: {seconds:.1f} s · {stage.nbytes / 1e6:.1f} MB · {_brief(built.stats)}")
    return stage


def _count(inputs: BuildInputs, bigrams: bool) -> None:
    """The shared corpus pass: token (and with ``bigrams``, bigram) counts of the target's tokenization."""
    start = time.perf_counter()
    with inputs.reporter.task("tokenize corpus (documents)", total=None) as advance:
        counts = count_corpus(
            iter_labelled_documents(inputs.corpus), inputs.target_tokenizer, inputs.target_fp.head_rows,
            bigrams=bigrams, advance=advance, labelled=True,
        )
    seconds = time.perf_counter() - start
    inputs.counts = counts
    inputs.corpus_info = {**inputs.corpus.describe(), "docs": counts.docs, "tokens": counts.tokens,
                          "seconds": round(seconds, 2)}
    inputs.reporter.log(f"corpus: {counts.docs:,} documents · {counts.tokens:,} tokens · {seconds:.1f} s")


def _reads_counts(entry: StageBuilder) -> bool:
    return any(n in CORPUS_PASS for n in entry.needs)


def _run_stages(inputs: BuildInputs, cfg: BuildConfig, done: StageCheckpoints) -> dict[str, Stage]:
    """Every stage of ``cfg.stages``: loaded from an interrupted run's checkpoints, else built (the stages that
    read the corpus counts first, so that the counts are freed before the others run) and checkpointed."""
    entries = [lookup_builder(name) for name in cfg.stages]
    configs = {e.name: config_dict(cfg.config(e.config)) for e in entries}
    stages = {e.name: s for e in entries if (s := done.load(e.name, configs[e.name])) is not None}
    if stages:
        inputs.reporter.log(f"resuming: {', '.join(stages)} finished by an earlier run of this build")
    todo = sorted((e for e in entries if e.name not in stages), key=lambda e: not _reads_counts(e))
    for i, entry in enumerate(todo):
        if _reads_counts(entry) and inputs.counts is None:
            _count(inputs, bigrams=any(BIGRAMS in e.needs for e in todo))
        start = time.perf_counter()
        built = entry.build(inputs, cfg.config(entry.config))
        stage = _stage(inputs.reporter, entry.name, start, built, configs[entry.name])
        done.save(stage, configs[entry.name])
        stages[entry.name] = stage
        if not any(_reads_counts(e) for e in todo[i + 1 :]):
            inputs.counts = None
        gc.collect()
    return stages


def _inputs(target: str, draft: str, cfg: BuildConfig, device: str, reporter: Reporter) -> BuildInputs:
    """The resolved pair (tokenizers, fingerprints, vocabularies checked to match) and what else builders read."""
    t_spec, d_spec = resolve_model(target), resolve_draft_model(draft)
    t_tok, d_tok = load_tokenizer(t_spec), load_tokenizer(d_spec)
    fps = fingerprint(t_spec, t_tok), fingerprint(d_spec, d_tok)
    inputs = BuildInputs(t_spec, d_spec, t_tok, *fps, cfg.corpus, device, reporter)
    match_vocabularies(t_tok, d_tok, inputs.target_fp.head_rows, inputs.draft_fp.head_rows)
    return inputs


def build_bundle(
    target: str, draft: str, out: str | Path, cfg: BuildConfig = BuildConfig(), reporter: Reporter = SilentReporter()
) -> BuildReport:
    """Build ``cfg.stages`` for the ``target``/``draft`` pair and write the bundle at ``out`` atomically.

    Stages of an existing bundle at ``out`` that are not rebuilt are kept, provided it was built for the same
    models (and not made from a stage rebuilt now). The stages that read corpus counts share one tokenization
    pass. Each finished stage is kept beside ``out`` until the bundle is written, so a build killed half-way and
    run again resumes after its last finished stage (:mod:`dynvocab.builders.checkpoints`).
    """
    t0 = time.perf_counter()
    out = Path(out)
    device = cfg.device or default_device()
    if not out.parent.is_dir():
        raise DynvocabError(f"folder {out.parent} does not exist; create it or pick another --out")
    check_sources(cfg.corpus)
    inputs = _inputs(target, draft, cfg, device, reporter)
    old = _existing(out, cfg, inputs.target_fp, inputs.draft_fp, reporter)
    done = StageCheckpoints(out, inputs.target_fp, inputs.draft_fp, {**cfg.corpus.describe(), "device": device})
    stages = _run_stages(inputs, cfg, done)
    ordered = [stages[name] for name in cfg.stages]
    built = [StageReport(s.name, s.info["seconds"], s.nbytes, s.info) for s in ordered]
    kept = _kept_stages(old, cfg, reporter)
    ordered += [old.load_stage(s) for s in kept]
    with reporter.task(f"writing {out.name}", total=None):
        write_bundle(out, ordered, inputs.target_fp, inputs.draft_fp)
    done.clear()
    return BuildReport(out, built, kept, time.perf_counter() - t0, out.stat().st_size)


def _kept_stages(old: Bundle | None, cfg: BuildConfig, reporter: Reporter) -> list[str]:
    """Stages of the existing bundle to carry over: not rebuilt, and not depending on a rebuilt stage."""
    if old is None:
        return []
    kept = []
    for name in (s for s in old.stages if s not in cfg.stages):
        kind = find_stage(name)
        stale = [d for d in (kind.made_from if kind else ()) if d in cfg.stages]
        if stale:
            reporter.log(f"dropping stage {name}: it was made from the old {', '.join(stale)}; build it again")
        else:
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
