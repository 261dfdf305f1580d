"""The ``train-router`` command: check the bundle and models, collect, train, evaluate, rewrite the bundle."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dynvocab.artifacts import ClusterTable, ModelFingerprint, Stage, load_bundle, write_bundle
from dynvocab.artifacts.router import STAGE, RouterTable, clusters_checksum
from dynvocab.builders.corpus import CorpusConfig, check_sources, encode_documents
from dynvocab.builders.models import fingerprint
from dynvocab.builders.progress import Reporter, SilentReporter
from dynvocab.builders.router.data import collect, split
from dynvocab.builders.router.fit import RouterConfig, mean_loss, positive_counts, train
from dynvocab.builders.router.recall import evaluate, report_budgets
from dynvocab.errors import DynvocabError
from dynvocab.models import default_device, load_model, load_tokenizer, resolve_model


@dataclass(frozen=True)
class TrainRouterConfig:
    """Everything ``train-router`` needs besides the bundle and the models."""

    corpus: CorpusConfig = field(default_factory=lambda: CorpusConfig(max_docs=160))
    router: RouterConfig = field(default_factory=RouterConfig)
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
    losses: list[float]  # mean train loss per epoch
    heldout_loss: float
    recall: dict  # see :func:`dynvocab.builders.router.recall.evaluate`


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


def train_router(
    bundle_path: str | Path, draft: str, target: str | None = None, cfg: TrainRouterConfig = TrainRouterConfig(),
    out: str | Path | None = None, reporter: Reporter = SilentReporter(),
) -> RouterReport:
    """Train the router for ``draft`` on the bundle's clusters and write it as the ``router`` stage.

    The bundle at ``out`` (default: the input bundle) is rewritten atomically with every other stage kept. The
    bundle must hold a ``clusters`` stage built for this draft (and for ``target``, when one is given).
    """
    t0 = time.perf_counter()
    rc = cfg.router
    check_config(rc)
    if cfg.corpus.max_docs < rc.holdout_every:
        raise DynvocabError(
            f"--max-docs {cfg.corpus.max_docs} is too few: every {rc.holdout_every}th document is held out; "
            f"pass at least {rc.holdout_every}"
        )
    bundle = load_bundle(bundle_path, verify=True)
    bundle.require("clusters")
    out = Path(out) if out is not None else bundle.path
    if not out.parent.is_dir():
        raise DynvocabError(f"folder {out.parent} does not exist; create it or pick another --out")
    check_sources(cfg.corpus)
    d_spec = resolve_model(draft)
    tokenizer = load_tokenizer(d_spec)
    d_fp = fingerprint(d_spec, tokenizer)
    _check_model(bundle, d_fp, "draft")
    if target is not None:
        t_spec = resolve_model(target)
        _check_model(bundle, fingerprint(t_spec, load_tokenizer(t_spec)), "target")
    clusters = ClusterTable.from_bundle(bundle)
    m = clusters.num_clusters
    vocab_rows = min(d_fp.head_rows, bundle.fingerprints["target"].head_rows)  # ids both models share
    if rc.top_l > vocab_rows:
        raise DynvocabError(f"--top-l {rc.top_l} exceeds the draft's {vocab_rows} token ids")
    assign = clusters.assign.long()
    sizes = torch.bincount(assign[:vocab_rows], minlength=m)  # [M] draftable ids per cluster

    device = cfg.device or default_device()
    with reporter.task(f"loading draft {draft} ({cfg.dtype}, {device})", total=None):
        model = load_model(d_spec, device, cfg.dtype)
    start = time.perf_counter()
    with reporter.task("draft pass (documents)", total=cfg.corpus.max_docs) as advance:
        docs = encode_documents(cfg.corpus, tokenizer, rc.max_tokens)
        data = collect(model, docs, rc.top_l, vocab_rows, advance)
    collect_s = time.perf_counter() - start
    embedding = model.get_input_embeddings().weight.detach().float().cpu()  # [V, d_e]
    del model
    n_docs = int(data.doc.max()) + 1
    train_data, held = split(data, rc.holdout_every)
    del data
    positives = float(positive_counts(held, assign, m).sum()) / held.rows
    reporter.log(
        f"data: {n_docs:,} documents · {train_data.rows:,} train + {held.rows:,} held-out positions · "
        f"top-{rc.top_l} → {positives:.1f} positive clusters per position · {collect_s:.1f} s"
    )

    start = time.perf_counter()
    batches = rc.epochs * math.ceil(train_data.rows / rc.batch_size)
    with reporter.task(f"training router ({rc.epochs} epochs, batches)", total=batches) as advance:
        module, losses = train(rc, train_data, embedding, assign, m, advance)
    train_s = time.perf_counter() - start
    heldout_loss = mean_loss(module, held, embedding, assign)
    reporter.log(
        f"training: {train_s:.1f} s · loss {losses[0]:.3f} → {losses[-1]:.3f} (held-out {heldout_loss:.3f})"
    )
    static_order = positive_counts(train_data, assign, m).argsort(descending=True)  # [M] most often positive first
    recall = evaluate(module, held, embedding, assign, sizes, report_budgets(rc.k_max), static_order)

    config = {**rc.as_dict(), "clusters_sha256": clusters_checksum(bundle), "vocab_rows": vocab_rows}
    table = RouterTable.from_module(module, config)
    info = {
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.perf_counter() - t0, 2),
        "corpus": {**cfg.corpus.describe(), "docs": n_docs},
        "train_positions": train_data.rows,
        "heldout_positions": held.rows,
        "collect_seconds": round(collect_s, 2),
        "train_seconds": round(train_s, 2),
        "losses": [round(x, 5) for x in losses],
        "heldout_loss": round(heldout_loss, 5),
        "recall": _rounded(recall),
    }
    stages = [bundle.load_stage(s) for s in bundle.stages if s != STAGE]
    stages.append(Stage(STAGE, table.to_tensors(), table.config, info))
    with reporter.task(f"writing {out.name}", total=None):
        write_bundle(out, stages, bundle.fingerprints["target"], bundle.fingerprints["draft"])
    return RouterReport(out, n_docs, train_data.rows, held.rows, collect_s, train_s, time.perf_counter() - t0,
                        losses, heldout_loss, recall)


def _rounded(obj):
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    return round(obj, 5) if isinstance(obj, float) else obj
