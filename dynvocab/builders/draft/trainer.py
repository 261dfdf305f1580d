"""``train-draft``: build an EAGLE head for a target offline — features (phase 1), then training (phase 2).

Both phases resume. Phase 1 writes feature shards whole (see :mod:`.features`); phase 2 (:mod:`.training`) writes a
checkpoint whole every ``checkpoint_every`` steps and at the end of each epoch. Under ``torchrun`` (see
:mod:`.ranks`) training is data-parallel: every rank holds the whole head, and a checkpoint holds nothing
rank-specific, so a run resumes on another number of ranks. Rank 0 writes the checkpoints and the head. The output
folder is the head in a registered layout (the ``--format`` family's layout of its kind, written by
:func:`dynvocab.models.eagle.save_eagle`) plus ``training.json``; the work files sit under ``OUT/work/`` and may be
deleted once the head is written.
"""

from __future__ import annotations

import gc
import itertools
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from dynvocab.builders.corpus import encode_documents
from dynvocab.builders.draft import distill, vocab
from dynvocab.builders.draft import features as feats
from dynvocab.builders.draft.config import TrainDraftConfig, TrainDraftReport, check_config
from dynvocab.builders.draft.head import build_head, draft_vocab, head_config
from dynvocab.builders.draft.ranks import Ranks, joined
from dynvocab.builders.draft.training import train
from dynvocab.builders.models import end_token_ids, fingerprint
from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic
from dynvocab.models import default_device, default_dtype, load_model, load_tokenizer, resolve_model
from dynvocab.models.eagle import EAGLE1, EAGLE3, save_eagle
from dynvocab.models.eagle.layouts import Layout, families, layout_for
from dynvocab.models.eagle.modules import embedding_scale
from dynvocab.progress import Reporter, SilentReporter


def train_draft(target: str, out: str | Path, cfg: TrainDraftConfig = TrainDraftConfig(), reporter: Reporter = SilentReporter(),
                writer=None) -> TrainDraftReport:
    """Build an EAGLE head of ``cfg.arch`` for ``target`` into ``out`` (resuming whatever a previous run left): in
    this process, or data-parallel over the ranks of a ``torchrun`` launch (every rank returns the report). With
    ``cfg.features_only`` it stops once the feature cache is whole and reports the cache, not a head. ``writer``
    writes the self-distilled answers where ``cfg.distill.engine`` is not ``torch``
    (``dynvocab.bench.engines.vllm.answers.VllmWriter``)."""
    t0 = time.perf_counter()
    check_config(cfg)
    if cfg.distill is not None and cfg.distill.engine != "torch" and writer is None:  # refused before any load
        raise DynvocabError(f"--distill-engine {cfg.distill.engine} needs its writer: pass train_draft(…, "
                            "writer=dynvocab.bench.engines.vllm.answers.VllmWriter.for_target(target))")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DynvocabError(f"--out {out} is a file; pass a folder")
    with joined(cfg.device or default_device()) as ranks:
        return _build(target, out, cfg, reporter if ranks.main else SilentReporter(), ranks, t0, writer)


def _build(target: str, out: Path, cfg: TrainDraftConfig, reporter: Reporter, ranks: Ranks, t0: float,
           writer=None) -> TrainDraftReport:
    """Both phases on every rank; rank 0 publishes the head and ``training.json``."""
    device = ranks.device(cfg.device or default_device())
    cfg = replace(cfg, features=cfg.features.resolved(device))
    if cfg.distill is not None:
        cfg = replace(cfg, distill=replace(cfg.distill, dtype=cfg.distill.dtype or default_dtype(device)))
    cfg = replace(cfg, train_dtype=cfg.train_dtype or default_dtype(device))
    spec = resolve_model(target)
    tokenizer = load_tokenizer(spec)
    documents = encode_documents(cfg.corpus, tokenizer, cfg.features.max_tokens)  # ShareGPT: its training split
    first = next(documents, None)  # refuse an empty corpus before the target is loaded
    if first is None:
        raise DynvocabError("the corpus gave no documents (of 2 tokens or more); check --corpus and --max-docs")
    target_fp = fingerprint(spec, tokenizer)
    if cfg.kind == EAGLE3:
        vocab.check_size(cfg.draft_vocab, target_fp.head_rows)
    work = out / "work"
    model = load_model(spec, device, cfg.features.dtype)
    layout = _layout_for(cfg, model, target)
    layers = len(getattr(model, model.base_model_prefix).layers)
    head_cfg = head_config(model, cfg.kind, cfg, layers)
    entering = head_cfg.target_layers(layers) if cfg.kind == EAGLE3 else None
    phase1 = _features(cfg, spec, model, tokenizer, itertools.chain([first], documents), work, entering, target_fp,
                       device, reporter, ranks, writer)
    reader = phase1["reader"]
    if cfg.features_only:
        features = phase1["features"]
        return TrainDraftReport(phase1["folder"], {"features_only": True, "docs": features.docs, "tokens": reader.tokens,
                                                   "extract": features.manifest.get("extract", {}) if phase1["extracted"] else {},
                                                   "seconds": {"features": round(phase1["seconds"], 1)}})
    work.mkdir(parents=True, exist_ok=True)
    draft_ids, vocab_info = (None, {})
    if cfg.kind == EAGLE3:
        draft_ids, vocab_info = draft_vocab(cfg, reader, spec, tokenizer, target_fp)
    head = build_head(model, head_cfg, draft_ids, cfg.init_from)
    ranks.broadcast_([p.data for p in head.parameters() if p.requires_grad])  # one start on every rank, as DDP's
    weight = model.get_output_embeddings().weight.detach().float()  # [V, d] the target's LM head
    target_head = weight if cfg.kind == EAGLE1 else weight[draft_ids].clone()  # EAGLE-1 [V, d]; EAGLE-3 [K, d]
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the target's memory, for training
    start = time.perf_counter()
    history = train(head, reader, target_head, draft_ids, cfg, work, phase1["settings"], reporter, ranks)
    seconds = {"features": round(phase1["seconds"], 1), "training": round(time.perf_counter() - start, 1),
               "total": round(time.perf_counter() - t0, 1)}
    info = _info(cfg, target_fp, phase1, history, vocab_info, entering, seconds, device, ranks)

    def publish() -> None:
        # The verifier speculators records: the target's resolved folder (demo:target -> its converted cache
        # folder), which resolves offline and holds the very weights the head was trained on; a hub target stays
        # its hub id.
        save_eagle(head, out, layout=layout, embeddings=False, target_name=spec.path,
                   dtype=getattr(torch, cfg.save_dtype) if cfg.save_dtype else None)
        write_atomic(out / "training.json", lambda p: p.write_text(json.dumps(info, indent=2) + "\n"))

    ranks.on_main(publish)  # every rank returns once the head is written
    return TrainDraftReport(out, info)


def _features(cfg: TrainDraftConfig, spec, model, tokenizer, documents, work: Path, entering, target_fp, device: str,
              reporter: Reporter, ranks: Ranks, writer=None) -> dict:
    """Phase 1: the target's features over the documents (or its own continuations of them, ``--self-distill``),
    extracted where the cache lacks them; returns the reader, the cache's settings and what was done."""
    settings = feats.settings_of(cfg.features, _corpus_settings(cfg, tokenizer), entering)
    extras = [feats.open_extra(Path(f), target_fp, settings) for f in cfg.extra_features]  # refused before any work
    folder = Path(cfg.features_dir) if cfg.features_dir else work / "features"
    manifest = ranks.on_main(lambda: feats.open_manifest(folder, target_fp, settings))
    start = time.perf_counter()
    extracted = feats.needs_extraction(manifest, cfg.corpus.max_docs)
    made = {}
    if extracted:
        if cfg.distill is not None:
            docs_dir = folder / "documents"
            prompts = distill.prompt_ids(cfg.distill, cfg.corpus, documents, tokenizer)
            made = ranks.on_main(lambda: _self_distill(spec, model, tokenizer, prompts, docs_dir, cfg, device, target_fp,
                                                       reporter, writer))
            documents = distill.documents(docs_dir, cfg.corpus.max_docs, cfg.features.max_tokens)
        feats.extract(model, documents, folder, manifest, cfg.features, cfg.corpus.max_docs, reporter, ranks)
    features = feats.load_features(folder, cfg.corpus.max_docs)
    reader = feats.FeatureReader(features, aux=cfg.kind == EAGLE3)
    reporter.log(f"features: {features.docs:,} documents · {reader.tokens:,} tokens in {folder}")
    if extras:
        readers = [reader, *(feats.FeatureReader(x, aux=cfg.kind == EAGLE3) for x in extras)]
        for x, r in zip(extras, readers[1:]):
            reporter.log(f"extra features: {x.docs:,} documents · {r.tokens:,} tokens in {x.folder}")
        reader = feats.MixedReader(readers, cfg.optim.holdout_every)
    return {"reader": reader, "features": features, "folder": folder, "settings": settings, "extracted": extracted,
            "made": made, "extras": extras, "seconds": time.perf_counter() - start}


def _info(cfg: TrainDraftConfig, target_fp, phase1: dict, history: dict, vocab_info: dict, entering, seconds: dict,
          device: str, ranks: Ranks) -> dict:
    """``training.json``: what was trained, on what, for how long, and how well."""
    features, folder = phase1["features"], phase1["folder"]
    return {
        "arch": cfg.arch,
        "layout": cfg.layout,
        "target": target_fp.as_dict(),
        "config": _describe(cfg),
        "data": {"docs": features.docs, "tokens": phase1["reader"].tokens, "shards": len(features.shards),
                 "train_docs": history["train_docs"], "heldout_docs": history["heldout_docs"],
                 "extract": features.manifest.get("extract", {}) if phase1["extracted"] else {},
                 "features_dir": str(folder),
                 "self_distilled": _distill_summary(cfg, folder, features.docs, phase1["made"]),
                 **({"extra": [_extra_summary(x) for x in phase1["extras"]]} if phase1["extras"] else {})},
        "draft_vocab": vocab_info,
        "target_layers": list(entering or ()),
        "steps": history["step"],
        "train_tokens": history["train_tokens"],
        "losses": history["losses"],
        "heldout": history["heldout"],
        "seconds": seconds,
        "peak_memory_mb": _peak_memory_mb(device),
        "device": device,
        "ranks": ranks.world,
    }


def _documents_settings(cfg: TrainDraftConfig, tokenizer) -> dict:
    """The corpus as caches record it, with ``bos`` where the tokenizer puts a BOS token before each text: documents
    encoded without it (a tokenizer converted without GGUF's ``add_bos_token``, or a cache from before caches recorded
    it) are another encoding, refused rather than mixed. A tokenizer that adds none records no key, so its caches
    from before still serve."""
    corpus = cfg.corpus.describe()
    if distill.adds_bos(tokenizer):
        corpus["bos"] = True
    return corpus


def _corpus_settings(cfg: TrainDraftConfig, tokenizer) -> dict:
    """What the documents are, as the feature cache's manifest records it: the corpus, and how the target rewrote it."""
    corpus = _documents_settings(cfg, tokenizer)
    if cfg.distill is not None:
        corpus["self_distill"] = distill.as_settings(cfg.distill)
    return corpus


def _self_distill(spec, model, tokenizer, prompts, folder: Path, cfg: TrainDraftConfig, device: str, target_fp,
                  reporter: Reporter, writer=None) -> dict:
    """The target's own documents for the first ``max_docs`` prompts (resuming ``folder``); the target generates in
    the distill dtype (a second copy when it differs from the feature pass's), or ``writer`` does (its own engine).
    Returns what was generated now."""
    manifest = distill.open_manifest(folder, target_fp, distill.settings_of(cfg.distill, _documents_settings(cfg, tokenizer)))
    if not distill.needs_generation(manifest, cfg.corpus.max_docs):
        return {}
    if writer is not None:  # its own engine loads the target
        manifest = distill.generate(None, tokenizer, prompts, folder, manifest, cfg.distill, cfg.corpus.max_docs,
                                    end_token_ids(spec, tokenizer), reporter, writer=writer)
        return manifest.get("generate", {})
    same = cfg.distill.dtype == cfg.features.dtype
    answering = model if same else load_model(spec, device, cfg.distill.dtype)
    try:
        manifest = distill.generate(answering, tokenizer, prompts, folder, manifest, cfg.distill, cfg.corpus.max_docs,
                                    end_token_ids(spec, tokenizer), reporter)
    finally:
        del answering
        gc.collect()
    return manifest.get("generate", {})


def _extra_summary(extra: feats.FeatureSet) -> dict:
    """An ``--extra-features`` cache as ``training.json`` records it: where, how much, and what it was made from."""
    return {"features_dir": str(extra.folder), "docs": extra.docs, "settings": extra.manifest["settings"]}


def _distill_summary(cfg: TrainDraftConfig, folder: Path, docs: int, made: dict) -> dict:
    if cfg.distill is None:
        return {}
    return {**distill.summary(folder / "documents", docs), "generate": made, "settings": asdict(cfg.distill)}


def _layout_for(cfg: TrainDraftConfig, model, target: str) -> Layout:
    """The layout the head is written in (``--format``'s family, the head's kind), refused where its readers would
    run the head otherwise than it was trained: a layout whose readers embed without a target's embedding scale
    (Gemma's sqrt(d)), which the head here is trained with."""
    layout = layout_for(cfg.layout, cfg.kind)
    scale = embedding_scale(model)
    if not layout.scaled_embeddings and scale != 1.0:
        scaled = [f for f in families() if (other := layout_for(f, cfg.kind)) is not None and other.scaled_embeddings]
        raise DynvocabError(
            f"{target} scales its input embeddings (× {scale:.2f}) and {layout.name}' readers do not; "
            f"use --format {' or '.join(scaled)} (dynvocab runs it, pairing the scale from the target)"
        )
    return layout


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
