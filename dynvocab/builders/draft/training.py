"""``train-draft``'s phase 2: the head trained over the cached features, resumable, data-parallel under ``torchrun``.

Batch order and noise depend only on the seed, the epoch and the step, so a run killed and rerun ends with the same
weights as one that never stopped. Each optimizer step's global batch of ``batch_docs`` documents is dealt out
across the ranks, each rank runs its share in micro-batches of ``micro_docs``, and the gradients are summed over
the ranks before one identical optimizer step on each; every loss term is divided by the global batch's token
count, so the step is the same for any number of ranks or micro-batch size (to float rounding). A checkpoint
(weights, optimizer, scheduler, progress) is written whole every ``checkpoint_every`` steps and at the end of each
epoch, by rank 0 only.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from dynvocab.builders.draft import recipe
from dynvocab.builders.draft.config import OptimConfig, TrainDraftConfig
from dynvocab.builders.draft.ranks import Ranks
from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic
from dynvocab.models.eagle import EAGLE1


@dataclass(frozen=True)
class _Setup:
    """What every optimizer step reads: the head, its data and targets, and how it steps."""

    head: torch.nn.Module
    reader: object  # features.FeatureReader
    target_head: torch.Tensor  # EAGLE-1 [V, d]; EAGLE-3 [K, d]: the target's LM-head rows
    draft_ids: torch.Tensor | None  # EAGLE-3 [K] target ids of the draft vocabulary; None for EAGLE-1
    optim: OptimConfig
    steps: int  # chained training-time-test steps
    autocast: Callable
    ranks: Ranks


def train(head, reader, target_head, draft_ids, cfg: TrainDraftConfig, work: Path, settings: dict, reporter,
          ranks: Ranks = Ranks()) -> dict:
    """Train ``head`` on ``reader``'s documents (resuming ``work/checkpoint.pt``); returns the progress record:
    step, tokens, losses, the held-out scores before and during training, and the document counts."""
    o = cfg.optim
    train_docs = [k for k in range(len(reader)) if not o.held_out(reader.doc_id(k))]
    heldout = [k for k in range(len(reader)) if o.held_out(reader.doc_id(k))][: o.eval_docs]
    if not train_docs:
        raise DynvocabError(f"no training documents after holding out every {o.holdout_every}th; raise --max-docs")
    per_epoch = -(-len(train_docs) // o.batch_docs)
    total = o.epochs * per_epoch
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(0.9, 0.95), weight_decay=o.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, o.warmup_steps, total))
    state = {"step": 0, "train_tokens": 0, "losses": [], "heldout": [], "settings": _train_settings(cfg, settings)}
    ckpt = work / "checkpoint.pt"
    if ckpt.is_file():
        state = _resume(ckpt, head, opt, sched, state)
        reporter.log(f"resuming training at step {state['step']:,} of {total:,}")
    autocast = _autocast(head.fc.weight.device.type, cfg.train_dtype)
    run = _Setup(head, reader, target_head, draft_ids, o, o.steps_for(head.kind), autocast, ranks)
    score = lambda: {"step": state["step"], **evaluate(head, reader, heldout, target_head, draft_ids, run.steps, autocast)}
    if heldout and ranks.main and not state["heldout"]:  # the starting point, for the report's before/after
        state["heldout"].append(score())
    unit = "documents" if o.batch_docs == 1 else f"steps of {o.batch_docs} documents"
    with reporter.task(f"training ({unit})", total=total - state["step"]) as advance:  # the work left: a true ETA
        running = None
        while state["step"] < total:
            batch = _batch(run, train_docs, state["step"], per_epoch)
            if not batch:
                state["step"] += 1
                continue
            value = _step(run, batch, params, opt, sched, state["step"])
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
    return {**state, "train_docs": len(train_docs), "heldout_docs": len(heldout)}


def _batch(run: _Setup, train_docs: list[int], step: int, per_epoch: int) -> list[tuple[int, int]]:
    """Step ``step``'s global batch: (the run's number of the document, its reader index) for each document of two
    tokens or more, in the epoch's seeded order (the same on every rank and after a resume)."""
    o = run.optim
    epoch, s = divmod(step, per_epoch)
    order = torch.randperm(len(train_docs), generator=torch.Generator().manual_seed(o.seed * 1000 + epoch))
    first = epoch * len(train_docs) + s * o.batch_docs  # the run's number of the batch's first document (its noise seed)
    batch = [(first + j, train_docs[int(k)]) for j, k in enumerate(order[s * o.batch_docs : (s + 1) * o.batch_docs])]
    return [(sample, k) for sample, k in batch if run.reader.length(k) >= 2]


def _step(run: _Setup, batch: list[tuple[int, int]], params: list, opt, sched, step: int) -> float:
    """One optimizer step over ``batch`` (this rank's share, in micro-batches; gradients summed over the ranks);
    returns the batch's mean loss."""
    o, head, ranks = run.optim, run.head, run.ranks
    negatives = _negatives(o, head.kind, run.target_head, step)
    lengths = [run.reader.length(k) - 1 for _, k in batch]  # training indices per document
    positions = [sum(max(0, n - i) for n in lengths) for i in range(run.steps)]  # per chained step, whole batch
    head.train()
    opt.zero_grad(set_to_none=True)
    total_loss = torch.zeros((), device=str(head.fc.weight.device))
    mine = batch[ranks.rank :: ranks.world]
    for micro in (mine[i : i + o.micro_docs] for i in range(0, len(mine), o.micro_docs)):
        docs = [run.reader.read(k) for _, k in micro]
        gens = [torch.Generator().manual_seed(o.seed * 1_000_003 + sample) for sample, _ in micro]
        with run.autocast():
            results = recipe.unroll(head, docs, run.steps, run.target_head, run.draft_ids, o.noise_for(head.kind),
                                    gens, negatives)
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
    return total_loss.item()


def _negatives(o: OptimConfig, kind: str, target_head: torch.Tensor, step: int) -> torch.Tensor | None:
    """EAGLE-1's uniform sample of head ids for step ``step`` (seeded by the seed and the step, so a resumed run draws
    the same); None for EAGLE-3 or ``negatives`` 0 (the whole head)."""
    if kind != EAGLE1 or o.negatives == 0:
        return None
    draw = torch.randperm(target_head.shape[0], generator=torch.Generator().manual_seed(o.seed * 7919 + step))
    return draw[: o.negatives].to(target_head.device)


def _autocast(device_type: str, dtype: str | None) -> Callable:
    """The training's autocast: bfloat16 matmuls on ``device_type`` (losses and softmaxes stay float32), or none."""
    if dtype != "bfloat16":
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type, dtype=torch.bfloat16)


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
            "train_dtype": cfg.train_dtype, "max_docs": cfg.corpus.max_docs, "features": feature_settings,
            **({"init_from": cfg.init_from} if cfg.init_from else {}),  # absent when unset: older checkpoints resume
            **({"extra_features": list(cfg.extra_features)} if cfg.extra_features else {})}


def _checkpoint(path: Path, head, opt, sched, state: dict) -> None:
    """Weights, optimizer, scheduler and progress, written whole."""
    blob = {"head": head.own_state(), "opt": opt.state_dict(), "sched": sched.state_dict(), "state": state}
    write_atomic(path, lambda p: torch.save(blob, p))


def _resume(path: Path, head, opt, sched, fresh: dict) -> dict:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise DynvocabError(f"cannot read the checkpoint {path} ({type(exc).__name__}); delete it to start training over") from exc
    settings = blob["state"]["settings"]
    # a checkpoint from before train_dtype trained as training then did: bfloat16 on CUDA, float32 elsewhere
    settings.setdefault("train_dtype", "bfloat16" if head.fc.weight.device.type == "cuda" else "float32")
    if settings != fresh["settings"]:
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
