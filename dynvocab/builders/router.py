"""Stage ``router``: train DynaSpec's meta-classifier on the draft's own predictions and add it to a bundle.

Data (DynaSpec appendix A.2, with teacher forcing instead of running EAGLE-2): one forward pass of the draft
over each training document gives, at every position i, the final hidden state h_i and the draft's top-L
tokens over its full vocabulary. A training pair is ``(h_i, E(x_i)) -> y`` with y_m = 1 iff cluster m holds
one of those top-L tokens (§4.2); the router is trained with binary cross-entropy over all M clusters.

Held-out documents (every ``holdout_every``-th of the training split; the ShareGPT evaluation split is never
read) measure the recall the runtime will see: the share of positive clusters inside the router's top-k, and
how often the draft's own top-1 token falls inside the top-k clusters' union, with the mean union size.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F

from dynvocab.artifacts import ClusterTable, ModelFingerprint, Stage, load_bundle, write_bundle
from dynvocab.artifacts.router import DEFAULT_K_MAX, DEFAULT_TOP_L, STAGE, RouterMLP, RouterTable, clusters_checksum
from dynvocab.builders.corpus import CorpusConfig, check_sources, iter_documents
from dynvocab.builders.models import fingerprint
from dynvocab.builders.progress import Advance, Reporter, SilentReporter
from dynvocab.data.sharegpt import sharegpt_train, to_messages
from dynvocab.errors import DynvocabError
from dynvocab.models import default_device, load_model, load_tokenizer, resolve_model

REPORT_GAMMA = 4  # draft steps per cycle whose position-aware budgets the recall report covers (loop default)


@dataclass(frozen=True)
class RouterConfig:
    """How the router is trained. Defaults: ~30k positions (160 documents × 192 tokens) of the 0.5B demo draft,
    whose float32 data pass dominates (~1 GFLOP per position) and takes 10–30 min on a shared 2-core CPU;
    8 epochs of a 1024-wide MLP take 1–3 min. Recall still grows with more data (--max-docs)."""

    top_l: int = DEFAULT_TOP_L  # positives: the draft's top-L tokens at each position
    width: int = 1024  # hidden units of the one-hidden-layer MLP
    epochs: int = 8
    batch_size: int = 256
    lr: float = 1e-3  # AdamW, cosine decay to 0
    weight_decay: float = 1e-4
    max_tokens: int = 192  # tokens per document (chat-template encoded for ShareGPT)
    holdout_every: int = 10  # every n-th document is held out for the recall report
    k_max: int = DEFAULT_K_MAX  # the budget whose recall is the headline figure
    seed: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TrainRouterConfig:
    """Everything ``train-router`` needs besides the bundle and the models."""

    corpus: CorpusConfig = field(default_factory=lambda: CorpusConfig(max_docs=160))
    router: RouterConfig = field(default_factory=RouterConfig)
    device: str | None = None  # None: cuda when visible, else cpu
    dtype: str = "float32"  # the draft's dtype for the data pass (bf16 prefill is slow on CPUs without AMX)


@dataclass
class RouterData:
    """Teacher-forced draft predictions: one row per document position."""

    hidden: torch.Tensor  # [N, d] bfloat16, the draft's final hidden state h_i
    tokens: torch.Tensor  # [N] int64, the token x_i fed at position i
    top: torch.Tensor  # [N, L] int64, the draft's top-L next-token ids at position i (descending)
    doc: torch.Tensor  # [N] int64, document index of each row

    def subset(self, mask: torch.Tensor) -> "RouterData":
        return RouterData(self.hidden[mask], self.tokens[mask], self.top[mask], self.doc[mask])

    @property
    def rows(self) -> int:
        return int(self.tokens.numel())


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
    recall: dict  # see :func:`evaluate`


# ---- data ------------------------------------------------------------------------------------------------


def encode_documents(corpus: CorpusConfig, tokenizer, max_tokens: int) -> Iterator[list[int]]:
    """Token ids of each corpus document, at most ``max_tokens`` each, at most ``corpus.max_docs`` documents.

    ShareGPT conversations (training split only) are encoded with the tokenizer's chat template, as the runtime
    encodes prompts; other sources are plain text.
    """
    check_sources(corpus)
    count = 0
    for src in corpus.sources:
        for ids in _source_ids(src, corpus, tokenizer, max_tokens):
            if len(ids) < 2:
                continue
            yield ids
            count += 1
            if count >= corpus.max_docs:
                return


def _source_ids(src: str, corpus: CorpusConfig, tokenizer, max_tokens: int) -> Iterator[list[int]]:
    chars = max_tokens * 16  # enough text for max_tokens tokens; spares tokenizing whole long conversations
    if src == "sharegpt" and getattr(tokenizer, "chat_template", None):
        for record in sharegpt_train():
            messages = to_messages(record)
            if messages:
                text = tokenizer.apply_chat_template(messages, tokenize=False)
                yield tokenizer(text[:chars], add_special_tokens=False)["input_ids"][:max_tokens]
        return
    one = CorpusConfig(sources=(src,), max_docs=corpus.max_docs, slimpajama_id=corpus.slimpajama_id)
    for text in iter_documents(one):
        yield tokenizer(text[:chars], add_special_tokens=False)["input_ids"][:max_tokens]


@torch.inference_mode()
def collect(
    model, documents: Iterable[list[int]], top_l: int, vocab_rows: int, advance: Advance = lambda n: None,
    chunk: int = 128,
) -> RouterData:
    """Run the draft ``model`` over each document (teacher forcing) and keep (h_i, x_i, top-L_i) per position.

    Only the first ``vocab_rows`` head rows count (ids the draft may propose at run time).
    """
    body = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    weight = head.weight[:vocab_rows]  # [V, d]
    bias = None if getattr(head, "bias", None) is None else head.bias[:vocab_rows]
    device = weight.device
    hidden, tokens, tops, docs = [], [], [], []
    for i, ids in enumerate(documents):
        x = torch.tensor(ids, dtype=torch.long, device=device)
        h = body(input_ids=x.view(1, -1)).last_hidden_state[0]  # [T, d]
        for s in range(0, h.shape[0], chunk):
            logits = F.linear(h[s : s + chunk], weight, bias)  # [c, V]
            tops.append(logits.topk(top_l, dim=-1).indices.cpu())  # [c, L]
        hidden.append(h.to(torch.bfloat16).cpu())
        tokens.append(x.cpu())
        docs.append(torch.full((x.numel(),), i, dtype=torch.long))
        advance(1)
    if not tokens:
        raise DynvocabError("the corpus gave no documents for the router; check --corpus and --max-docs")
    return RouterData(torch.cat(hidden), torch.cat(tokens), torch.cat(tops), torch.cat(docs))


def split(data: RouterData, holdout_every: int) -> tuple[RouterData, RouterData]:
    """(train, held-out): every ``holdout_every``-th document is held out."""
    held = data.doc % holdout_every == holdout_every - 1
    if not held.any() or held.all():
        docs = int(data.doc.max()) + 1
        raise DynvocabError(
            f"{docs} document(s) are too few to hold every {holdout_every}th out; "
            f"raise --max-docs to at least {holdout_every}"
        )
    return data.subset(~held), data.subset(held)


# ---- training ------------------------------------------------------------------------------------------


def labels(top: torch.Tensor, assign: torch.Tensor, num_clusters: int) -> torch.Tensor:
    """Multi-hot cluster labels [n, M]: y_m = 1 iff cluster m holds one of the row's top-L tokens."""
    y = torch.zeros(top.shape[0], num_clusters)
    return y.scatter_(1, assign[top], 1.0)


def positive_counts(data: RouterData, assign: torch.Tensor, num_clusters: int, chunk: int = 8192) -> torch.Tensor:
    """Rows in which each cluster is positive, [M] float."""
    counts = torch.zeros(num_clusters)
    for s in range(0, data.rows, chunk):
        counts += labels(data.top[s : s + chunk], assign, num_clusters).sum(0)
    return counts


def _inputs(data: RouterData, rows: torch.Tensor, embedding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return data.hidden[rows].float(), embedding[data.tokens[rows]].float()  # [n, d_h], [n, d_e]


def input_stats(data: RouterData, embedding: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-feature mean and std [D] of ``concat[h, E(x)]`` over the rows of ``data``."""
    total = sq = None
    for s in range(0, data.rows, chunk):
        h, e = _inputs(data, torch.arange(s, min(s + chunk, data.rows)), embedding)
        x = torch.cat([h, e], dim=-1).double()
        total = x.sum(0) if total is None else total + x.sum(0)
        sq = (x * x).sum(0) if sq is None else sq + (x * x).sum(0)
    mean = total / data.rows
    std = (sq / data.rows - mean * mean).clamp_min(0).sqrt()
    return mean.float(), std.float()


def bce_loss(
    module: RouterMLP, data: RouterData, rows: torch.Tensor, embedding: torch.Tensor, assign: torch.Tensor
) -> torch.Tensor:
    """DynaSpec's router loss on ``rows``: BCE summed over the M clusters, averaged over rows."""
    h, e = _inputs(data, rows, embedding)
    y = labels(data.top[rows], assign, module.num_clusters)  # [n, M]
    return F.binary_cross_entropy_with_logits(module(h, e), y, reduction="sum") / rows.numel()


@torch.no_grad()
def mean_loss(
    module: RouterMLP, data: RouterData, embedding: torch.Tensor, assign: torch.Tensor, chunk: int = 4096
) -> float:
    """:func:`bce_loss` over all rows of ``data``."""
    chunks = torch.arange(data.rows).split(chunk)
    return sum(float(bce_loss(module, data, rows, embedding, assign)) * rows.numel() for rows in chunks) / data.rows


def train(
    cfg: RouterConfig, data: RouterData, embedding: torch.Tensor, assign: torch.Tensor, num_clusters: int,
    advance: Advance = lambda n: None,
) -> tuple[RouterMLP, list[float]]:
    """Fit the router on ``data``; returns the module (eval mode) and the mean loss of each epoch.

    ``embedding`` [V, d_e] is the draft's input embedding, ``assign`` [V] the cluster of each token id.
    """
    torch.manual_seed(cfg.seed)
    module = RouterMLP(data.hidden.shape[1], embedding.shape[1], cfg.width, num_clusters)
    module.set_input_stats(*input_stats(data, embedding))
    with torch.no_grad():  # start from the clusters' prior positive rate: the first steps learn context, not base rates
        rate = (positive_counts(data, assign, num_clusters) / data.rows).clamp(1e-6, 1 - 1e-6)
        module.fc2.bias.copy_(torch.log(rate / (1 - rate)))
    steps_per_epoch = math.ceil(data.rows / cfg.batch_size)
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, cfg.epochs * steps_per_epoch))
    gen = torch.Generator().manual_seed(cfg.seed)
    losses = []
    module.train()
    for _ in range(cfg.epochs):
        order = torch.randperm(data.rows, generator=gen)
        total = 0.0
        for s in range(0, data.rows, cfg.batch_size):
            rows = order[s : s + cfg.batch_size]
            loss = bce_loss(module, data, rows, embedding, assign)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * rows.numel()
            advance(1)
        losses.append(total / data.rows)
    return module.eval(), losses


# ---- evaluation ----------------------------------------------------------------------------------------


def schedule(k_max: int, gamma: int = REPORT_GAMMA) -> list[int]:
    """DynaSpec's cluster budget k_c(t) for t < γ (§4.2): k_max, k_max, then ⌊k_max / (2(t+1))⌋.

    The runtime's copy is ``pa_budget(k_max, t, divisor=2)``; builders do not import the runtime.
    """
    return [k_max if t < 2 else max(1, k_max // (2 * (t + 1))) for t in range(gamma)]


def report_budgets(k_max: int, gamma: int = REPORT_GAMMA) -> list[int]:
    """Cluster budgets the report covers: the schedule's k_c(t) for t < γ and a few fixed ones up to k_max."""
    return sorted({k for k in (*schedule(k_max, gamma), 16, 32, 64, 128) if k <= k_max})


@torch.no_grad()
def evaluate(
    module: RouterMLP, data: RouterData, embedding: torch.Tensor, assign: torch.Tensor, sizes: torch.Tensor,
    budgets: list[int], static_order: torch.Tensor | None = None, gamma: int = REPORT_GAMMA, chunk: int = 4096,
) -> dict:
    """Held-out recall of the router's top-k clusters for each budget k.

    Per budget: ``cluster_recall`` (positive clusters inside the top-k / all positive clusters), ``top1_recall``
    (rows whose draft top-1 token lies in the top-k clusters' union), ``mean_shortlist`` (mean union size in
    draftable ids, ``sizes`` [M]), and with ``static_order`` [M] the top-1 recall of one fixed top-k cluster list.
    Also the position-aware schedule over ``gamma`` steps: its mean shortlist and mean top-1 recall.
    """
    m = module.num_clusters
    k_top = min(max(budgets), m)
    captured = {k: 0.0 for k in budgets}
    top1 = {k: 0.0 for k in budgets}
    shortlist = {k: 0.0 for k in budgets}
    static = {k: 0.0 for k in budgets}
    positives = 0.0
    for s in range(0, data.rows, chunk):
        rows = torch.arange(s, min(s + chunk, data.rows))
        h, e = _inputs(data, rows, embedding)
        order = module(h, e).topk(k_top, dim=-1).indices  # [n, k_top], best first
        y = labels(data.top[rows], assign, m)  # [n, M]
        first = assign[data.top[rows, 0]]  # [n] cluster of the draft's top-1 token
        positives += float(y.sum())
        for k in budgets:
            sel = order[:, : min(k, m)]  # [n, k]
            captured[k] += float(y.gather(1, sel).sum())
            top1[k] += float((sel == first[:, None]).any(1).sum())
            shortlist[k] += float(sizes[sel].sum())
            if static_order is not None:
                static[k] += float(torch.isin(first, static_order[:k]).sum())
    n = data.rows
    out = {
        str(k): {
            "cluster_recall": captured[k] / positives if positives else 0.0,
            "top1_recall": top1[k] / n,
            "mean_shortlist": shortlist[k] / n,
            **({"static_top1_recall": static[k] / n} if static_order is not None else {}),
        }
        for k in budgets
    }
    steps = [str(b) for b in schedule(max(budgets), gamma)]
    if all(b in out for b in steps):
        out["schedule"] = {
            "gamma": gamma,
            "mean_shortlist": sum(out[b]["mean_shortlist"] for b in steps) / gamma,
            "top1_recall": sum(out[b]["top1_recall"] for b in steps) / gamma,
        }
    return out


# ---- the command ---------------------------------------------------------------------------------------


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
