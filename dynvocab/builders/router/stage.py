"""The ``train-router`` command: check the bundle and models, collect the draft's teacher-forced predictions once,
train each selector asked for on them (DynaSpec's router, the ``lowrank`` and ``centroids`` candidate selectors),
evaluate them on held-out documents, rewrite the bundle."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dynvocab.artifacts import ClusterTable, ModelFingerprint, Stage, load_bundle, write_bundle
from dynvocab.artifacts.router import STAGE, RouterTable, clusters_checksum
from dynvocab.artifacts.selectors import CentroidScorer, LowRankScorer, SelectorTable, random_centroids, random_lowrank
from dynvocab.artifacts.stages import CLUSTERS, ROUTER, find_stage
from dynvocab.builders.corpus import CorpusConfig, check_sources, encode_documents
from dynvocab.builders.models import fingerprint, resolve_draft_model
from dynvocab.builders.router.data import collect, split
from dynvocab.builders.router.fit import RouterConfig, mean_loss, positive_counts, train
from dynvocab.builders.router.recall import evaluate, report_budgets
from dynvocab.builders.router.selectors import (
    CENTROID_BUDGETS, CENTROIDS, LOWRANK, LOWRANK_BUDGETS, SelectorConfig, balanced_blocks, block_of, centroid_init,
    default_budget, fit as fit_selector, recall as selector_recall, svd_init,
)
from dynvocab.builders.stage_registry import DRAFT, StageBuilder, Synthetic
from dynvocab.errors import DynvocabError
from dynvocab.models import default_device, load_model, load_tokenizer, resolve_model
from dynvocab.progress import Reporter, SilentReporter


@dataclass(frozen=True)
class TrainRouterConfig:
    """Everything ``train-router`` needs besides the bundle and the models."""

    corpus: CorpusConfig = field(default_factory=lambda: CorpusConfig(max_docs=160))
    router: RouterConfig = field(default_factory=RouterConfig)
    selectors: tuple[str, ...] = (STAGE,)  # which to train on the one data pass: router, lowrank, centroids
    selector: SelectorConfig = field(default_factory=SelectorConfig)
    device: str | None = None  # None: cuda when visible, else cpu
    dtype: str = "float32"  # the draft's dtype for the data pass (bf16 prefill is slow on CPUs without AMX)


@dataclass(frozen=True)
class RouterReport:
    """What ``train-router`` did: data, times, losses, held-out recall."""

    path: Path
    docs: int
    train_rows: int
    heldout_rows: int
    collect_s: float
    train_s: float
    seconds: float
    losses: list[float]  # mean train loss per epoch (router)
    heldout_loss: float
    recall: dict  # the router's, see :func:`dynvocab.builders.router.recall.evaluate` ({} when not trained)
    selectors: dict = field(default_factory=dict)  # lowrank / centroids: budget, recall, losses, seconds


def check_config(rc: RouterConfig) -> None:
    """Refuse settings that cannot train (one line naming the option)."""
    for option, value, least in (("--top-l", rc.top_l, 1), ("--epochs", rc.epochs, 1), ("--hidden", rc.width, 1),
                                 ("--batch-size", rc.batch_size, 1), ("--max-tokens", rc.max_tokens, 2),
                                 ("--k-max", rc.k_max, 1), ("--holdout-every", rc.holdout_every, 2)):
        if value < least:
            raise DynvocabError(f"{option} must be at least {least} (got {value})")
    if not rc.lr > 0:
        raise DynvocabError(f"--lr must be positive (got {rc.lr})")


def _check_model(bundle, given: ModelFingerprint, role: str) -> None:
    built = bundle.fingerprints.get(role)
    if built is None:
        raise DynvocabError(f"bundle {bundle.path} records no {role} model; rebuild it with `dynvocab build-index`")
    diffs = built.differences(given)
    if diffs:
        raise DynvocabError(
            f"bundle {bundle.path} was built for a different {role} "
            f"({built.source or 'another model'}; {', '.join(diffs)}); "
            f"pass --{role} {built.source or '…'} or rebuild the bundle for {given.source}"
        )


SELECTORS = (STAGE, LOWRANK, CENTROIDS)


def check_selectors(cfg: "TrainRouterConfig") -> None:
    """Refuse unknown selectors and settings that cannot train (one line naming the option)."""
    unknown = [k for k in cfg.selectors if k not in SELECTORS]
    if unknown or not cfg.selectors:
        raise DynvocabError(f"--selector takes one or more of {', '.join(SELECTORS)} (got {', '.join(unknown) or 'none'})")
    sc = cfg.selector
    for option, value, least in (("--rank", sc.rank, 1), ("--block-size", sc.block_size, 1),
                                 ("--positives", sc.positives, 1), ("--selector-epochs", sc.epochs, 1)):
        if value < least:
            raise DynvocabError(f"{option} must be at least {least} (got {value})")


def train_router(
    bundle_path: str | Path, draft: str, target: str | None = None, cfg: TrainRouterConfig = TrainRouterConfig(),
    out: str | Path | None = None, reporter: Reporter = SilentReporter(),
) -> RouterReport:
    """Train the selectors ``cfg.selectors`` for ``draft`` on one teacher-forced data pass and write each as its
    stage (``router``, ``lowrank``, ``centroids``).

    The bundle at ``out`` (default: the input bundle) is rewritten atomically with every other stage kept. The
    router needs a ``clusters`` stage built for this draft; every selector needs a bundle built for this draft (and
    for ``target``, when one is given).
    """
    t0 = time.perf_counter()
    rc = cfg.router
    check_config(rc)
    check_selectors(cfg)
    if cfg.corpus.max_docs < rc.holdout_every:
        raise DynvocabError(
            f"--max-docs {cfg.corpus.max_docs} is too few: every {rc.holdout_every}th document is held out; "
            f"pass at least {rc.holdout_every}"
        )
    bundle = load_bundle(bundle_path, verify=True)
    for kind in cfg.selectors:
        for source in find_stage(kind).made_from:
            bundle.require(source)
    out = Path(out) if out is not None else bundle.path
    if not out.parent.is_dir():
        raise DynvocabError(f"folder {out.parent} does not exist; create it or pick another --out")
    check_sources(cfg.corpus)
    p = _draft_pass(bundle, draft, target, cfg, reporter)
    report = {"losses": [], "heldout_loss": 0.0, "recall": {}, "selectors": {}, "train_s": 0.0,
              "corpus": {**cfg.corpus.describe(), "docs": p.docs}, "collect_s": p.collect_s}
    stages = {}
    if STAGE in cfg.selectors:
        stages[STAGE] = _train_cluster_router(bundle, rc, p.train, p.held, p.embedding, p.vocab_rows, reporter, report)
    for kind in (LOWRANK, CENTROIDS):
        if kind in cfg.selectors:
            stages[kind] = _train_selector(kind, cfg.selector, p.head, p.train, p.held, reporter, report)
    keep = [bundle.load_stage(s) for s in bundle.stages if s not in stages]
    with reporter.task(f"writing {out.name}", total=None):
        write_bundle(out, keep + list(stages.values()), bundle.fingerprints["target"], bundle.fingerprints["draft"])
    return RouterReport(out, p.docs, p.train.rows, p.held.rows, p.collect_s, report["train_s"],
                        time.perf_counter() - t0, report["losses"], report["heldout_loss"], report["recall"],
                        report["selectors"])


@dataclass(frozen=True)
class _DraftPass:
    """The draft's teacher-forced pass over the corpus, split, with the draft's embedding and head rows."""

    train: object  # RouterData of the training positions
    held: object  # RouterData of the held-out positions
    embedding: torch.Tensor  # [V, d_e]
    head: torch.Tensor  # [vocab_rows, d]
    vocab_rows: int  # ids both models share
    docs: int
    collect_s: float


def _draft_pass(bundle, draft: str, target: str | None, cfg: TrainRouterConfig, reporter: Reporter) -> _DraftPass:
    """Check the models against the bundle, then run the draft over the corpus once (its top-L at each position)."""
    rc = cfg.router
    d_spec = resolve_draft_model(draft)
    tokenizer = load_tokenizer(d_spec)
    d_fp = fingerprint(d_spec, tokenizer)
    _check_model(bundle, d_fp, "draft")
    if target is not None:
        t_spec = resolve_model(target)
        _check_model(bundle, fingerprint(t_spec, load_tokenizer(t_spec)), "target")
    vocab_rows = min(d_fp.head_rows, bundle.fingerprints["target"].head_rows)  # ids both models share
    if rc.top_l > vocab_rows:
        raise DynvocabError(f"--top-l {rc.top_l} exceeds the draft's {vocab_rows} token ids")
    device = cfg.device or default_device()
    with reporter.task(f"loading draft {draft} ({cfg.dtype}, {device})", total=None):
        model = load_model(d_spec, device, cfg.dtype)
    start = time.perf_counter()
    with reporter.task("draft pass (documents)", total=cfg.corpus.max_docs) as advance:
        docs = encode_documents(cfg.corpus, tokenizer, rc.max_tokens)
        data = collect(model, docs, rc.top_l, vocab_rows, advance)
    collect_s = time.perf_counter() - start
    embedding = model.get_input_embeddings().weight.detach().float().cpu()  # [V, d_e]
    head = model.get_output_embeddings().weight[:vocab_rows].detach().float().cpu()  # [V, d]
    del model
    n_docs = int(data.doc.max()) + 1
    train_data, held = split(data, rc.holdout_every)
    del data
    reporter.log(
        f"data: {n_docs:,} documents · {train_data.rows:,} train + {held.rows:,} held-out positions · "
        f"{collect_s:.1f} s"
    )
    return _DraftPass(train_data, held, embedding, head, vocab_rows, n_docs, collect_s)


def _info(t0: float, report: dict, train_data, held, losses: list[float], **extra) -> dict:
    return {
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.perf_counter() - t0, 2),
        "corpus": report["corpus"],
        "collect_seconds": round(report["collect_s"], 2),
        "train_positions": train_data.rows,
        "heldout_positions": held.rows,
        "losses": [round(x, 5) for x in losses],
        **{k: _rounded(v) for k, v in extra.items()},
    }


def _train_cluster_router(bundle, rc: RouterConfig, train_data, held, embedding, vocab_rows, reporter, report) -> Stage:
    """DynaSpec's router over the bundle's clusters (its stage; the report's router fields filled in)."""
    t0 = time.perf_counter()
    clusters = ClusterTable.from_bundle(bundle)
    m = clusters.num_clusters
    assign = clusters.assign.long()
    sizes = torch.bincount(assign[:vocab_rows], minlength=m)  # [M] draftable ids per cluster
    positives = float(positive_counts(held, assign, m).sum()) / held.rows
    reporter.log(f"router: top-{rc.top_l} → {positives:.1f} positive clusters per position")
    batches = rc.epochs * math.ceil(train_data.rows / rc.batch_size)
    with reporter.task(f"training router ({rc.epochs} epochs, batches)", total=batches) as advance:
        module, losses = train(rc, train_data, embedding, assign, m, advance)
    train_s = time.perf_counter() - t0
    heldout_loss = mean_loss(module, held, embedding, assign)
    reporter.log(f"training: {train_s:.1f} s · loss {losses[0]:.3f} → {losses[-1]:.3f} (held-out {heldout_loss:.3f})")
    static_order = positive_counts(train_data, assign, m).argsort(descending=True)  # [M] most often positive first
    recall = evaluate(module, held, embedding, assign, sizes, report_budgets(rc.k_max), static_order)
    report.update(losses=losses, heldout_loss=heldout_loss, recall=recall, train_s=report["train_s"] + train_s)
    config = {**rc.as_dict(), "clusters_sha256": clusters_checksum(bundle), "vocab_rows": vocab_rows}
    table = RouterTable.from_module(module, config)
    info = _info(t0, report, train_data, held, losses, train_seconds=train_s, heldout_loss=heldout_loss, recall=recall)
    return Stage(STAGE, table.to_tensors(), table.config, info)


def _train_selector(kind: str, sc: SelectorConfig, head: torch.Tensor, train_data, held, reporter, report) -> Stage:
    """A candidate selector initialised from the head's rows ``head`` [V, d] and trained on the data: its stage,
    with the default budget set by held-out recall (the report's ``selectors[kind]`` filled in)."""
    t0 = time.perf_counter()
    unit = sizes = None
    if kind == LOWRANK:
        rank = min(sc.rank, head.shape[1])
        with reporter.task(f"lowrank: SVD init (rank {rank})", total=None):
            scorer = LowRankScorer(*svd_init(head, rank))
        budgets = LOWRANK_BUDGETS
    else:
        with reporter.task(f"centroids: balanced blocks of {sc.block_size}", total=sc.cluster_iters) as advance:
            order = balanced_blocks(head, sc.block_size, sc.cluster_iters, sc.seed, advance)
        unit = block_of(order, sc.block_size)
        sizes = torch.bincount(unit)
        scorer = CentroidScorer(centroid_init(head, order, sc.block_size))
        budgets = CENTROID_BUDGETS
    before = selector_recall(kind, scorer, held, budgets, unit, sizes)
    batches = sc.epochs * math.ceil(train_data.rows / sc.batch_size)
    with reporter.task(f"training {kind} ({sc.epochs} epochs, batches)", total=batches) as advance:
        losses = fit_selector(kind, scorer, sc, train_data, unit, advance)
    recall = selector_recall(kind, scorer, held, budgets, unit, sizes)
    budget = default_budget(recall)
    seconds = time.perf_counter() - t0
    report["selectors"][kind] = {"budget": budget, "recall": recall, "untrained_recall": before,
                                 "losses": losses, "seconds": seconds}
    report["train_s"] += seconds
    b = recall[str(budget)]
    reporter.log(
        f"{kind}: {seconds:.1f} s · loss {losses[0]:.3f} → {losses[-1]:.3f} · default budget {budget} "
        f"({b['ids']:,.0f} ids): top-1 recall {b['top1_recall']:.1%}, top-2 {b['top2_recall']:.1%}"
    )
    config = {**sc.as_dict(), "budget": budget}
    table = SelectorTable.lowrank(scorer, config) if kind == LOWRANK else SelectorTable.centroids(
        scorer, order, sc.block_size, config)
    info = _info(t0, report, train_data, held, losses, recall=recall, untrained_recall=before)
    return Stage(kind, table.tensors, table.config, info)


def _rounded(obj):
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    return round(obj, 5) if isinstance(obj, float) else obj


def _synthetic_router(spec: Synthetic, made: dict) -> Stage:
    """A random router (128 hidden units) over the synthetic clusters, its config naming their checksum."""
    from dynvocab.artifacts.bundle import tensor_sha256
    from dynvocab.artifacts.router import RouterMLP

    assign = made[CLUSTERS.name].tensors["assign"]  # [V]
    m = int(made[CLUSTERS.name].tensors["centroids"].shape[0])
    table = RouterTable.from_module(RouterMLP(spec.dim, spec.dim, 128, m), {"clusters_sha256": tensor_sha256(assign)})
    return Stage(STAGE, table.to_tensors(), table.config)


def _synthetic_selector(kind: str):
    make = random_lowrank if kind == LOWRANK else random_centroids

    def synthetic(spec: Synthetic, made: dict) -> Stage:
        """A random selector at the benches' sizes (lowrank: rank 256, 4,096 candidates; centroids: 32 blocks
        of 128)."""
        table = make(spec.vocab, spec.dim, spec.generator)
        return Stage(table.kind, table.tensors, table.config)

    return synthetic


ROUTER_STAGE = StageBuilder(ROUTER, RouterConfig, needs=(DRAFT,), synthetic=_synthetic_router)
CENTROIDS_STAGE = StageBuilder(find_stage(CENTROIDS), SelectorConfig, needs=(DRAFT,),
                               synthetic=_synthetic_selector(CENTROIDS))
LOWRANK_STAGE = StageBuilder(find_stage(LOWRANK), SelectorConfig, needs=(DRAFT,), synthetic=_synthetic_selector(LOWRANK))
