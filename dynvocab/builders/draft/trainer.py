"""``train-draft``: build an EAGLE head for a target offline — features (phase 1), then training (phase 2).

Both phases resume. Phase 1 writes feature shards whole (see :mod:`.features`); phase 2 writes a checkpoint
(weights, optimizer, scheduler, step) whole every ``checkpoint_every`` steps and at the end of each epoch. Batch
order and noise depend only on the seed, the epoch and the step, so a run killed and rerun ends with the same
weights as one that never stopped.

Under ``torchrun`` (see :mod:`.ranks`) training is data-parallel: every rank holds the whole head; each optimizer
step's global batch of ``batch_docs`` documents (its order rank-independent) is dealt out across the ranks, each
rank runs its share in micro-batches of ``micro_docs`` (gradient accumulation), and the gradients are summed over
the ranks before one identical optimizer step on each. Every loss term is divided by the global batch's token
count, so the summed gradient is the gradient of one mean over all its tokens, the same for any number of ranks
or micro-batch size (to float rounding); a checkpoint holds nothing rank-specific, so a run resumes on another
number of ranks. Rank 0 writes the checkpoints and the head. The output folder is the head in a published layout (written by
:func:`dynvocab.models.eagle.save_eagle`) plus ``training.json``; the work files sit under ``OUT/work/`` and may be
deleted once the head is written.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from dynvocab.builders.corpus import CorpusConfig, check_sources, encode_documents
from dynvocab.builders.draft import features as feats
from dynvocab.builders.draft import distill, recipe, vocab
from dynvocab.builders.draft.init import init_eagle1_from_target, init_eagle3_from_target
from dynvocab.builders.draft.ranks import Ranks, joined
from dynvocab.builders.models import end_token_ids, fingerprint
from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic
from dynvocab.models import default_device, default_dtype, load_model, load_tokenizer, resolve_model
from dynvocab.models.eagle import EAGLE1, EAGLE3, EagleModel, config_like, save_eagle
from dynvocab.models.eagle.modules import embedding_scale
from dynvocab.progress import Reporter, SilentReporter

ARCHS = {"eagle1": EAGLE1, "eagle3": EAGLE3}
FORMATS = ("eagle", "speculators")
EVAL_NAMES = ("sharegpt-eval", "sharegpt:eval", "sharegpt_eval", "sharegpt:test", "eval")


@dataclass(frozen=True)
class OptimConfig:
    """How the head is trained. Defaults are sized for the 45-minute CPU budget (docs/train-draft.md)."""

    epochs: int = 1
    lr: float = 3e-4  # AdamW peak; linear warm-up then cosine decay to 10%
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.5  # EAGLE main.py: grad_clip 0.5
    ttt_steps: int | None = None  # chained steps per document; None: 1 for EAGLE-1 (paper), 3 for EAGLE-3
    feature_noise: float | None = None  # uniform noise width on input features; None: 0.2 EAGLE-1, 0 EAGLE-3
    holdout_every: int = 10  # every n-th training document is held out for the agreement report
    eval_docs: int = 24  # held-out documents scored at each evaluation
    eval_every: int = 100  # steps between held-out evaluations (and the progress bar's agreement)
    checkpoint_every: int = 25  # steps between checkpoints
    seed: int = 0
    batch_docs: int = 1  # documents per optimizer step, over all ranks together (the global batch)
    micro_docs: int = 8  # documents per forward pass on one rank (speed and memory only: not part of the recipe)
    negatives: int = 4096  # EAGLE-1: uniformly sampled ids its sampled cross-entropy scores beside the target's
    # cached top-k (recipe.candidate_rows), drawn anew each step; 0: the whole head at every position

    def steps_for(self, kind: str) -> int:
        return self.ttt_steps if self.ttt_steps is not None else (1 if kind == EAGLE1 else 3)

    def noise_for(self, kind: str) -> float:
        return self.feature_noise if self.feature_noise is not None else (0.2 if kind == EAGLE1 else 0.0)


@dataclass(frozen=True)
class TrainDraftConfig:
    """Everything ``train-draft`` needs besides the target and the output folder."""

    arch: str = "eagle3"
    draft_vocab: int = 32768  # EAGLE-3 only: lm_head rows (FR-Spec's and the export's K)
    bundle: str | None = None  # a bundle whose freq stage gives the draft vocabulary (else: counted from the data)
    corpus: CorpusConfig = field(default_factory=lambda: CorpusConfig(max_docs=128))  # ~30k tokens: see docs/train-draft.md
    features: feats.FeatureConfig = field(default_factory=feats.FeatureConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    layout: str = "eagle"  # eagle: the EAGLE repo layout of its kind; speculators: vllm-project/speculators (EAGLE-3)
    device: str | None = None
    features_dir: str | None = None  # the feature cache (default OUT/work/features); heads may share one
    distill: distill.DistillConfig | None = None  # train on the target's own continuations of the corpus's prompts
    save_dtype: str | None = None  # the head's weights on disk (None: float32, as trained; bfloat16 halves them)


@dataclass(frozen=True)
class TrainDraftReport:
    """What ``train-draft`` did (also written as ``OUT/training.json``)."""

    path: Path
    info: dict


def check_config(cfg: TrainDraftConfig) -> None:
    """One-line refusals before any model is loaded: unknown arch/format, the evaluation split, empty corpus."""
    if cfg.arch not in ARCHS:
        raise DynvocabError(f"unknown --arch '{cfg.arch}'; use eagle3 or eagle1")
    if cfg.layout not in FORMATS:
        raise DynvocabError(f"unknown --format '{cfg.layout}'; use eagle or speculators")
    if cfg.layout == "speculators" and cfg.arch != "eagle3":
        raise DynvocabError("--format speculators holds EAGLE-3 heads; use --arch eagle3 or --format eagle")
    evals = [s for s in cfg.corpus.sources if s.lower() in EVAL_NAMES]
    if evals:
        raise DynvocabError(
            f"corpus '{evals[0]}' is the ShareGPT evaluation split, reserved for bench; train on sharegpt (its training split)"
        )
    check_sources(cfg.corpus)
    o = cfg.optim
    for flag, value, low in (("--epochs", o.epochs, 1), ("--max-tokens", cfg.features.max_tokens, 2),
                             ("--batch-docs", o.batch_docs, 1), ("--micro-docs", o.micro_docs, 1),
                             ("--feature-batch", cfg.features.batch_docs or 1, 1)):
        if value < low:
            raise DynvocabError(f"{flag} must be at least {low}, got {value}")
    if not o.lr > 0:
        raise DynvocabError(f"--lr must be positive, got {o.lr}")
    if cfg.save_dtype not in (None, "float32", "bfloat16", "float16"):
        raise DynvocabError(f"unknown --save-dtype '{cfg.save_dtype}'; use float32, bfloat16 or float16")
    if o.negatives < 0:
        raise DynvocabError(f"--negatives must be 0 (the whole head) or positive, got {o.negatives}")
    if cfg.distill is not None:
        cfg.distill.check()


def _encode(cfg: TrainDraftConfig, tokenizer):
    """ShareGPT chat-template encoded (training split only), as the router's data pass reads it."""
    return encode_documents(cfg.corpus, tokenizer, cfg.features.max_tokens)


def train_draft(target: str, out: str | Path, cfg: TrainDraftConfig = TrainDraftConfig(), reporter: Reporter = SilentReporter()) -> TrainDraftReport:
    """Build an EAGLE head of ``cfg.arch`` for ``target`` into ``out`` (resuming whatever a previous run left): in
    this process, or data-parallel over the ranks of a ``torchrun`` launch (every rank returns the report)."""
    t0 = time.perf_counter()
    check_config(cfg)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DynvocabError(f"--out {out} is a file; pass a folder")
    with joined(cfg.device or default_device()) as ranks:
        return _build(target, out, cfg, reporter if ranks.main else SilentReporter(), ranks, t0)


def _build(target: str, out: Path, cfg: TrainDraftConfig, reporter: Reporter, ranks: Ranks, t0: float) -> TrainDraftReport:
    kind = ARCHS[cfg.arch]
    device = ranks.device(cfg.device or default_device())
    cfg = replace(cfg, features=cfg.features.resolved(device))
    spec = resolve_model(target)
    tokenizer = load_tokenizer(spec)
    documents = _encode(cfg, tokenizer)
    first = next(documents, None)  # refuse an empty corpus before the target is loaded
    if first is None:
        raise DynvocabError("the corpus gave no documents (of 2 tokens or more); check --corpus and --max-docs")
    target_fp = fingerprint(spec, tokenizer)
    if kind == EAGLE3:
        vocab.check_size(cfg.draft_vocab, target_fp.head_rows)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    model = load_model(spec, device, cfg.features.dtype)
    _check_layout_fits(cfg, model, target)
    layers = len(getattr(model, model.base_model_prefix).layers)
    head_cfg = _head_config(model, kind, cfg, layers)
    entering = head_cfg.target_layers(layers) if kind == EAGLE3 else None
    if cfg.distill is not None:
        cfg = replace(cfg, distill=replace(cfg.distill, dtype=cfg.distill.dtype or default_dtype(device)))
    settings = feats.settings_of(cfg.features, _corpus_settings(cfg), entering)
    folder = Path(cfg.features_dir) if cfg.features_dir else work / "features"
    manifest = ranks.on_main(lambda: feats.open_manifest(folder, target_fp, settings))
    start = time.perf_counter()
    extracted = feats.needs_extraction(manifest, cfg.corpus.max_docs)
    made = {}
    if extracted:
        all_docs = itertools.chain([first], documents)
        if cfg.distill is not None:
            docs_dir = folder / "documents"
            made = ranks.on_main(lambda: _self_distill(spec, model, tokenizer, all_docs, docs_dir, cfg, device, target_fp, reporter))
            all_docs = distill.documents(docs_dir, cfg.corpus.max_docs, cfg.features.max_tokens)
        feats.extract(model, all_docs, folder, manifest, cfg.features, cfg.corpus.max_docs, reporter, ranks)
    features = feats.load_features(folder, cfg.corpus.max_docs)
    reader = feats.FeatureReader(features, aux=kind == EAGLE3)
    reporter.log(f"features: {features.docs:,} documents · {reader.tokens:,} tokens in {folder}")
    extract_s = time.perf_counter() - start

    draft_ids, vocab_info = (None, {})
    if kind == EAGLE3:
        draft_ids, vocab_info = _draft_vocab(cfg, reader, spec, tokenizer, target_fp)
    head = _build_head(model, head_cfg, draft_ids)
    ranks.broadcast_([p.data for p in head.parameters() if p.requires_grad])  # one start on every rank, as DDP's
    weight = model.get_output_embeddings().weight.detach().float()  # [V, d] the target's LM head
    target_head = weight if kind == EAGLE1 else weight[draft_ids].clone()  # EAGLE-1 [V, d]; EAGLE-3 [K, d]
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the target's memory, for training

    start = time.perf_counter()
    history = _train(head, reader, target_head, draft_ids, cfg, work, settings, reporter, ranks)
    train_s = time.perf_counter() - start
    info = {
        "arch": cfg.arch,
        "layout": cfg.layout,
        "target": target_fp.as_dict(),
        "config": _describe(cfg),
        "data": {"docs": features.docs, "tokens": reader.tokens, "shards": len(features.shards),
                 "train_docs": history["train_docs"], "heldout_docs": history["heldout_docs"],
                 "extract": features.manifest.get("extract", {}) if extracted else {}, "features_dir": str(folder),
                 "self_distilled": _distill_summary(cfg, folder, features.docs, made)},
        "draft_vocab": vocab_info,
        "target_layers": list(entering or ()),
        "steps": history["step"],
        "train_tokens": history["train_tokens"],
        "losses": history["losses"],
        "heldout": history["heldout"],
        "seconds": {"features": round(extract_s, 1), "training": round(train_s, 1), "total": round(time.perf_counter() - t0, 1)},
        "peak_memory_mb": _peak_memory_mb(device),
        "device": device,
        "ranks": ranks.world,
    }
    layout = "speculators" if cfg.layout == "speculators" else None

    def publish() -> None:
        # The verifier speculators records: the target's resolved folder (demo:target -> its converted cache
        # folder), which resolves offline and holds the very weights the head was trained on; a hub target stays
        # its hub id.
        save_eagle(head, out, layout=layout, embeddings=False, target_name=spec.path,
                   dtype=getattr(torch, cfg.save_dtype) if cfg.save_dtype else None)
        write_atomic(out / "training.json", lambda p: p.write_text(json.dumps(info, indent=2) + "\n"))

    ranks.on_main(publish)  # every rank returns once the head is written
    return TrainDraftReport(out, info)


def _corpus_settings(cfg: TrainDraftConfig) -> dict:
    """What the documents are, as the feature cache's manifest records it: the corpus, and how the target rewrote it."""
    corpus = cfg.corpus.describe()
    if cfg.distill is not None:
        corpus["self_distill"] = asdict(cfg.distill)
    return corpus


def _self_distill(spec, model, tokenizer, prompts, folder: Path, cfg: TrainDraftConfig, device: str, target_fp,
                  reporter: Reporter) -> dict:
    """The target's own documents for the first ``max_docs`` prompts (resuming ``folder``); the target generates in
    the distill dtype (a second copy when it differs from the feature pass's). Returns what was generated now."""
    manifest = distill.open_manifest(folder, target_fp, distill.settings_of(cfg.distill, cfg.corpus.describe()))
    if not distill.needs_generation(manifest, cfg.corpus.max_docs):
        return {}
    same = cfg.distill.dtype == cfg.features.dtype
    writer = model if same else load_model(spec, device, cfg.distill.dtype)
    try:
        manifest = distill.generate(writer, tokenizer, prompts, folder, manifest, cfg.distill, cfg.corpus.max_docs,
                                    end_token_ids(spec, tokenizer), reporter)
    finally:
        del writer
        gc.collect()
    return manifest.get("generate", {})


def _distill_summary(cfg: TrainDraftConfig, folder: Path, docs: int, made: dict) -> dict:
    if cfg.distill is None:
        return {}
    return {**distill.summary(folder / "documents", docs), "generate": made, "settings": asdict(cfg.distill)}


def _check_layout_fits(cfg: TrainDraftConfig, model, target: str) -> None:
    """Refuse a layout whose readers would run the head otherwise than it was trained: speculators and vLLM embed
    the head's tokens without a target's embedding scale (Gemma's sqrt(d)), which the head here is trained with."""
    scale = embedding_scale(model)
    if cfg.layout == "speculators" and scale != 1.0:
        raise DynvocabError(
            f"{target} scales its input embeddings (× {scale:.2f}) and speculators' readers do not; "
            "use --format eagle (dynvocab runs it, pairing the scale from the target)"
        )


def _describe(cfg: TrainDraftConfig) -> dict:
    out = asdict(cfg)
    out["corpus"] = cfg.corpus.describe()
    return out


def _peak_memory_mb(device: str) -> float:
    """Peak resident memory of this process (CPU: ru_maxrss; CUDA: the allocator's peak)."""
    if device.startswith("cuda"):
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _head_config(model, kind: str, cfg: TrainDraftConfig, layers: int):
    """A head shaped like the target's decoder layer; EAGLE-3 reads the default layers (2, L//2, L-3) when the
    target has at least 4 layers, else the hidden states entering layers (1, L//2, L) (L: the last output)."""
    layer_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if kind == EAGLE1:
        return config_like(layer_cfg, EAGLE1)
    aux = None if layers >= 4 else (1, max(1, layers // 2), layers)
    return config_like(
        layer_cfg, EAGLE3, draft_vocab_size=cfg.draft_vocab, target_hidden_size=layer_cfg.hidden_size, aux_hidden_states=aux
    )


def _draft_vocab(cfg, reader, spec, tokenizer, target_fp) -> tuple[torch.Tensor, dict]:
    if cfg.bundle is not None:
        return vocab.from_bundle(cfg.bundle, cfg.draft_vocab, target_fp)
    counts = np.zeros(target_fp.head_rows, dtype=np.int64)
    for k in range(len(reader)):
        if not _held_out(reader.doc_id(k), cfg.optim.holdout_every):
            np.add.at(counts, reader.read(k)["ids"].numpy(), 1)
    return vocab.from_counts(counts, end_token_ids(spec, tokenizer), cfg.draft_vocab)


def _build_head(model, head_cfg, draft_ids) -> EagleModel:
    """A head initialised from the target where the shapes allow (its last layer, embeddings, norm, head rows)."""
    torch.manual_seed(0)
    head = EagleModel(head_cfg).float()
    if head_cfg.kind == EAGLE1:
        init_eagle1_from_target(head, model)
    else:
        head.set_draft_vocab(draft_ids)
        init_eagle3_from_target(head, model, draft_ids)
    head.embed_tokens.weight.requires_grad_(False)  # the target's embeddings, frozen (EAGLE: requires_grad False)
    return head.to(next(model.parameters()).device)


def _held_out(doc_id: int, every: int) -> bool:
    return doc_id % every == every - 1


# ---- phase 2 ----------------------------------------------------------------------------------------------


def _train(head, reader, target_head, draft_ids, cfg: TrainDraftConfig, work: Path, settings: dict, reporter,
           ranks: Ranks = Ranks()) -> dict:
    o, kind = cfg.optim, head.kind
    train = [k for k in range(len(reader)) if not _held_out(reader.doc_id(k), o.holdout_every)]
    heldout = [k for k in range(len(reader)) if _held_out(reader.doc_id(k), o.holdout_every)][: o.eval_docs]
    if not train:
        raise DynvocabError("no training documents after holding out every "
                            f"{o.holdout_every}th; raise --max-docs")
    per_epoch = -(-len(train) // o.batch_docs)
    total = o.epochs * per_epoch
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(0.9, 0.95), weight_decay=o.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, o.warmup_steps, total))
    state = {"step": 0, "train_tokens": 0, "losses": [], "heldout": [], "settings": _train_settings(cfg, settings)}
    ckpt = work / "checkpoint.pt"
    if ckpt.is_file():
        state = _resume(ckpt, head, opt, sched, state)
        reporter.log(f"resuming training at step {state['step']:,} of {total:,}")
    steps = o.steps_for(kind)
    device = str(head.fc.weight.device)
    gpu = device.startswith("cuda")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if gpu else contextlib.nullcontext
    score = lambda: {"step": state["step"], **evaluate(head, reader, heldout, target_head, draft_ids, steps, autocast)}
    if heldout and ranks.main and not state["heldout"]:  # the starting point, for the report's before/after
        state["heldout"].append(score())
    unit = "documents" if o.batch_docs == 1 else f"steps of {o.batch_docs} documents"
    with reporter.task(f"training ({unit})", total=total) as advance:
        advance(state["step"])
        running = None
        while state["step"] < total:
            step = state["step"]
            epoch, s = divmod(step, per_epoch)
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(o.seed * 1000 + epoch))
            first = epoch * len(train) + s * o.batch_docs  # the run's number of the batch's first document (its noise seed)
            batch = [(first + j, train[int(k)]) for j, k in enumerate(order[s * o.batch_docs : (s + 1) * o.batch_docs])]
            batch = [(sample, k) for sample, k in batch if reader.length(k) >= 2]
            if not batch:
                state["step"] += 1
                continue
            negatives = _negatives(o, kind, target_head, step)
            lengths = [reader.length(k) - 1 for _, k in batch]  # training indices per document
            positions = [sum(max(0, n - i) for n in lengths) for i in range(steps)]  # per chained step, whole batch
            head.train()
            opt.zero_grad(set_to_none=True)
            total_loss = torch.zeros((), device=device)
            mine = batch[ranks.rank :: ranks.world]
            for micro in (mine[i : i + o.micro_docs] for i in range(0, len(mine), o.micro_docs)):
                docs = [reader.read(k) for _, k in micro]
                gens = [torch.Generator().manual_seed(o.seed * 1_000_003 + sample) for sample, _ in micro]
                with autocast():
                    results = recipe.unroll(head, docs, steps, target_head, draft_ids, o.noise_for(kind), gens, negatives)
                    loss = recipe.weighted_loss(results, positions)  # this micro-batch's share of the batch's mean
                loss.backward()
                total_loss += loss.detach()
            if ranks.world > 1:  # the rank's share summed over the ranks (a rank with no document adds zeros)
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                for p, g in zip(params, grads):
                    p.grad = g
                ranks.sum_([*grads, total_loss])
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
            opt.step()
            sched.step()
            value = total_loss.item()
            running = value if running is None else 0.95 * running + 0.05 * value
            state["step"] += 1
            state["train_tokens"] += sum(reader.length(k) for _, k in batch)
            state["losses"].append(round(value, 5))
            done = state["step"]
            if heldout and ranks.main and (done % o.eval_every == 0 or done == total):
                state["heldout"].append(score())
            advance(1, description=_bar(running, state["heldout"]))
            if ranks.main and (done % o.checkpoint_every == 0 or done == total or done % per_epoch == 0):
                _checkpoint(ckpt, head, opt, sched, state)
    head.eval()
    return {**state, "train_docs": len(train), "heldout_docs": len(heldout)}


def _negatives(o: OptimConfig, kind: str, target_head: torch.Tensor, step: int) -> torch.Tensor | None:
    """EAGLE-1's uniform sample of head ids for step ``step`` (seeded by the seed and the step, so a resumed run draws
    the same); None for EAGLE-3 or ``negatives`` 0 (the whole head)."""
    if kind != EAGLE1 or o.negatives == 0:
        return None
    draw = torch.randperm(target_head.shape[0], generator=torch.Generator().manual_seed(o.seed * 7919 + step))
    return draw[: o.negatives].to(target_head.device)


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _bar(running: float | None, heldout: list[dict]) -> str:
    text = "training"
    if running is not None:
        text += f" · loss {running:.3f}"
    if heldout:
        text += f" · held-out top-1 {heldout[-1]['top1'][0]:.1%}"
    return text


def _train_settings(cfg: TrainDraftConfig, feature_settings: dict) -> dict:
    optim = {k: v for k, v in asdict(cfg.optim).items() if k != "micro_docs"}  # any micro-batch resumes
    return {"optim": optim, "arch": cfg.arch, "draft_vocab": cfg.draft_vocab, "bundle": cfg.bundle,
            "max_docs": cfg.corpus.max_docs, "features": feature_settings}


def _checkpoint(path: Path, head, opt, sched, state: dict) -> None:
    """Weights, optimizer, scheduler and progress, written whole."""
    weights = {k: v for k, v in head.state_dict().items() if k != "embed_tokens.weight" and "rotary_emb" not in k}
    blob = {"head": weights, "opt": opt.state_dict(), "sched": sched.state_dict(), "state": state}
    write_atomic(path, lambda p: torch.save(blob, p))


def _resume(path: Path, head, opt, sched, fresh: dict) -> dict:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise DynvocabError(f"cannot read the checkpoint {path} ({type(exc).__name__}); delete it to start training over") from exc
    if blob["state"]["settings"] != fresh["settings"]:
        raise DynvocabError(
            f"{path} was written with other training settings; rerun with the same options or delete it to start over"
        )
    head.load_state_dict(blob["head"], strict=False)
    opt.load_state_dict(blob["opt"])
    sched.load_state_dict(blob["sched"])
    return blob["state"]


@torch.no_grad()
def evaluate(head, reader, docs: list[int], target_head, draft_ids, steps: int, autocast=contextlib.nullcontext) -> dict:
    """Held-out loss and top-1 agreement with the target's argmax at each chained step, and the acceptance length
    they imply if steps were independent: 1 + Σ_k Π_{i<k} top1_i (an estimate, not a measured MAL)."""
    head.eval()
    agree, count, loss = [0] * steps, [0] * steps, 0.0
    for k in docs:
        doc = reader.read(k)
        if doc["ids"].numel() < 2:
            continue
        with autocast():
            results = recipe.unroll(head, [doc], steps, target_head, draft_ids)
            loss += float(recipe.weighted_loss(results))
        for i, r in enumerate(results):
            agree[i] += r.agree
            count[i] += r.positions
    top1 = [a / c if c else 0.0 for a, c in zip(agree, count)]
    chain, est = 1.0, 1.0
    for a in top1:
        chain *= a
        est += chain
    return {"loss": round(loss / max(1, len(docs)), 5), "top1": [round(a, 5) for a in top1], "est_accept_len": round(est, 4)}
