"""Phase 1 of ``train-draft``: the target's features over the training documents, computed once, cached in shards.

Each shard holds ``shard_docs`` consecutive documents and is written whole (``dynvocab.files.write_atomic``), so a
run killed at any moment leaves finished shards and no half-written one; a rerun skips the finished shards. The
target runs over ``batch_docs`` documents of a shard at a time, right-padded (see :func:`batch_features`). Under
``torchrun`` each rank computes the shards ``i ≡ rank (mod world)`` into the one shared folder (no two ranks write
the same shard) and rank 0 alone writes the manifest, once all shards are written. The manifest records the
target's fingerprint and the settings the features depend on; features of another target or other settings are
refused rather than mixed. One cache can serve several heads (``train-draft --features DIR``):
a run of fewer documents reads the cache's first documents, a run of more extends it, and a cache with EAGLE-3's
layer taps serves EAGLE-1 too.

Per document of tokens x_0..x_{T-1} a shard keeps, at every position s:

- ``last`` [T, d]: the target's final *normed* hidden state f_s (what its LM head multiplies; EAGLE-1's feature and
  the teacher of both recipes),
- ``aux`` [T, 3d] (EAGLE-3 only): the hidden states *entering* target layers ``EagleConfig.target_layers(L)``
  (default (2, L//2, L-3)), concatenated low to high, exactly as :class:`dynvocab.models.eagle.LayerTap` taps
  them at run time,
- ``argmax`` [T]: the target's greedy next token after position s (held-out agreement, EAGLE-3's loss mask),
- ``topk`` [T, k]: the target's ``topk`` most likely next tokens (EAGLE-1's sampled loss scores these ids and a
  uniform sample of the rest instead of all V rows).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch

from dynvocab.artifacts import ModelFingerprint
from dynvocab.builders.draft import manifest as manifests
from dynvocab.builders.draft.manifest import MANIFEST
from dynvocab.builders.draft.ranks import Ranks
from dynvocab.errors import DynvocabError
from dynvocab.files import write_atomic
from dynvocab.progress import Reporter

FORMAT_VERSION = 3


@dataclass(frozen=True)
class FeatureConfig:
    """What the cached features are made of (any change means other features)."""

    max_tokens: int = 256  # tokens per document (ShareGPT: chat-template encoded)
    shard_docs: int = 16  # documents per shard: the unit of resumption, and of the work split between ranks
    dtype: str | None = None  # the target's dtype for the pass; None: float32 on CPU (bf16 prefill is ~5x slower
    # there), bfloat16 on a GPU. train_draft resolves it, so the manifest records the dtype that ran
    store_dtype: str = "bfloat16"  # features on disk (half the bytes; training upcasts)
    topk: int = 16  # the target's most likely next ids kept per position (EAGLE-1's sampled loss)
    batch_docs: int | None = None  # documents per target pass (speed only: not part of what the features are);
    # None: 8 on a GPU, 1 on CPU, where a 256-token document already fills the matmuls (8 per pass measured no
    # faster, docs/measurements/2026-11-23-train-feature-batch-cpu.md) and padding only adds work

    def resolved(self, device: str) -> "FeatureConfig":
        """This config with the pass dtype and batch chosen for ``device``."""
        from dataclasses import replace

        gpu = device.startswith("cuda")
        return replace(self, dtype=self.dtype or ("bfloat16" if gpu else "float32"),
                       batch_docs=self.batch_docs or (8 if gpu else 1))


@dataclass(frozen=True)
class FeatureSet:
    """The first ``docs`` documents of a feature cache: its folder, manifest and the shard files holding them."""

    folder: Path
    manifest: dict
    shards: list[Path]
    docs: int


def shard_path(folder: Path, index: int) -> Path:
    """The file of shard ``index`` (documents ``[index·shard_docs, (index+1)·shard_docs)``)."""
    return folder / f"shard-{index:05d}.safetensors"


def settings_of(cfg: FeatureConfig, corpus: dict, entering: tuple[int, ...] | None) -> dict:
    """What the features depend on, as the manifest records it. The corpus's document limit is not part of it: a
    cache grows when a run asks for more documents and serves its first documents to a run that asks for fewer."""
    corpus = {k: v for k, v in corpus.items() if k != "max_docs"}
    features = {k: v for k, v in asdict(cfg).items() if k != "batch_docs"}
    return {"features": features, "corpus": corpus, "entering_layers": list(entering or ())}


def open_manifest(folder: Path, fingerprint: ModelFingerprint, settings: dict) -> dict:
    """The manifest of ``folder`` (created when absent). A cache serves a run when the target, the feature settings
    and the corpus match and, for EAGLE-3, it holds the same layer taps (an EAGLE-3 cache also serves EAGLE-1, whose
    feature is the final hidden state every cache keeps); anything else is refused rather than mixed."""
    return manifests.open_manifest(
        folder, FORMAT_VERSION, fingerprint, settings, changed=_changed, cached="features", outs="--out/--features",
        old_format="{folder} holds features in an older format; delete that folder to rebuild them",
        other_target="{folder} holds features of another target ({diff}); use another --out/--features or delete it",
    )


def _changed(have: dict, want: dict) -> list[str] | None:
    """The settings in which a cache differs from a run (None: it serves the run; its EAGLE-3 layer taps count only
    when the run taps layers)."""
    changed = sorted(k for k in ("features", "corpus") if have[k] != want[k])
    changed = [manifests.corpus_change(have[k], want[k]) if k == "corpus" else k for k in changed]
    if want["entering_layers"] and have["entering_layers"] != want["entering_layers"]:
        changed.append("entering_layers (EAGLE-3 layer taps)")
    return changed or None


def needs_extraction(manifest: dict, max_docs: int) -> bool:
    """Whether the cache lacks documents a run of ``max_docs`` documents reads."""
    return manifest["docs"] < max_docs and not manifest["exhausted"]


@torch.inference_mode()
def batch_features(model, batch: list[list[int]], entering: tuple[int, ...] | None, tap, topk: int = 16) -> dict[str, torch.Tensor]:
    """Documents through the target in one pass: ``last`` [N, d], ``argmax`` [N], ``topk`` [N, k] and (EAGLE-3)
    ``aux`` [N, 3d] over their N = Σ T_b tokens, document after document.

    The documents are right-padded to the longest: causal attention already keeps every real position from the
    padding, which only ever comes after it, so each document's features are those of its own pass (to float
    rounding; ``tests/test_train_draft.py`` compares them) and no attention mask is needed.
    """
    body = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    device = head.weight.device
    lengths = torch.tensor([len(ids) for ids in batch])  # [B]
    x = torch.zeros(len(batch), int(lengths.max()), dtype=torch.long)  # [B, T]
    for b, ids in enumerate(batch):
        x[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    real = (torch.arange(x.shape[1])[None] < lengths[:, None]).to(device)  # [B, T]
    last = body(input_ids=x.to(device)).last_hidden_state[real]  # [N, d]
    argmax, top = [], []
    for c in last.split(256):  # chunks bound the [c, V] logits
        logits = head(c)  # [c, V]
        argmax.append(logits.argmax(-1))
        top.append(logits.topk(min(topk, logits.shape[-1]), dim=-1).indices)
    out = {"last": last, "argmax": torch.cat(argmax).to(torch.int32), "topk": torch.cat(top).to(torch.int32)}
    if entering:
        out["aux"] = tap.batch_features()[real]  # [N, 3d]
    return out


def extract(
    model,
    documents: Iterator[list[int]],
    folder: Path,
    manifest: dict,
    cfg: FeatureConfig,
    max_docs: int,
    reporter: Reporter,
    ranks: Ranks = Ranks(),
) -> dict:
    """Fill ``folder`` with the shards of the first ``max_docs`` documents not yet written; returns the manifest.

    ``documents`` yields token-id lists in a fixed order (the same on every rank); shard i holds documents
    ``[i·shard_docs, (i+1)·shard_docs)`` and is computed by rank ``i % world``. Documents of finished shards, and of
    other ranks' shards, are read but not run through the target. The layer taps are the cache's own
    (``manifest["settings"]["entering_layers"]``), so every shard of a cache holds the same tensors. Every rank
    returns the manifest rank 0 wrote once all ranks were done.
    """
    from dynvocab.models.eagle import LayerTap

    entering = tuple(manifest["settings"]["entering_layers"]) or None
    store = getattr(torch, cfg.store_dtype)
    tap = LayerTap(model, entering) if entering else None
    docs, ran, started = 0, 0, time.perf_counter()
    cached = manifests.finished_docs(lambda i: _shard_docs(shard_path(folder, i)), cfg.shard_docs, max_docs)
    if cached:
        reporter.log(f"target features: {cached:,} of {max_docs:,} documents cached before; resuming")
    try:
        with reporter.task("target features (documents)", total=max_docs - cached) as advance:
            chunks = _chunks(itertools.islice(documents, max_docs), cfg.shard_docs)
            for index, batch in enumerate(chunks):
                if index % ranks.world == ranks.rank:
                    now = _shard(model, batch, index, docs, folder, store, entering, tap, cfg)
                    ran += now
                    if now:  # rank 0's bar counts every rank's documents, taking the others to keep its pace
                        advance(len(batch) * ranks.world, description=_rate("target features", ran * ranks.world, started))
                docs += len(batch)
    finally:
        if tap is not None:
            tap.remove()
    if docs == 0:
        raise DynvocabError("the corpus gave no documents; check --corpus and --max-docs")
    total = torch.tensor([float(ran)], dtype=torch.float64)
    ranks.sum_([total])  # also waits for every rank's last shard
    ran, seconds = int(total.item()), time.perf_counter() - started
    manifest = {**manifest, "docs": max(docs, manifest["docs"]), "exhausted": docs < max_docs}
    if ran:
        manifest["extract"] = {"tokens": ran, "seconds": round(seconds, 2), "tokens_per_s": round(ran / seconds, 1),
                               "ranks": ranks.world}

    def write() -> dict:
        manifests.write_manifest(folder, manifest)
        return manifest

    return ranks.on_main(write)


def _chunks(items: Iterator[list[int]], size: int) -> Iterator[list[list[int]]]:
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def _rate(label: str, tokens: int, started: float) -> str:
    seconds = time.perf_counter() - started
    return f"{label} · {tokens / seconds:,.0f} tok/s" if tokens and seconds > 0 else label


def _shard_docs(path: Path) -> int:
    """Documents in a finished shard file (0 when there is none)."""
    from safetensors import safe_open

    if not path.is_file():
        return 0
    with safe_open(str(path), framework="pt") as f:
        return f.get_slice("doc").get_shape()[0]


def _shard(model, batch, index, first_doc, folder, store, entering, tap, cfg: FeatureConfig) -> int:
    """Write shard ``index`` unless a shard of the same documents exists (a shorter last shard left by a run of
    fewer documents is recomputed); returns the tokens computed now. The target runs over ``cfg.batch_docs`` documents
    at a time, taken in length order so that little is padded."""
    path = shard_path(folder, index)
    if _shard_docs(path) == len(batch):
        return 0
    per_pass = cfg.batch_docs or 1
    order = sorted(range(len(batch)), key=lambda k: len(batch[k]))
    docs: dict[int, dict[str, torch.Tensor]] = {}
    for start in range(0, len(order), max(1, per_pass)):
        group = order[start : start + max(1, per_pass)]
        out = batch_features(model, [batch[k] for k in group], entering, tap, cfg.topk)
        split = [len(batch[k]) for k in group]
        for name, tensor in out.items():
            for k, part in zip(group, tensor.split(split)):
                docs.setdefault(k, {})[name] = part
    parts = [docs[k] for k in range(len(batch))]
    tensors = {
        "ids": torch.tensor([i for ids in batch for i in ids], dtype=torch.int32),  # [N]
        "offsets": torch.tensor([0, *torch.tensor([len(b) for b in batch]).cumsum(0).tolist()], dtype=torch.int64),  # [D+1]
        "doc": torch.arange(first_doc, first_doc + len(batch), dtype=torch.int64),  # [D]
        "argmax": torch.cat([p["argmax"] for p in parts]).cpu(),  # [N]
        "topk": torch.cat([p["topk"] for p in parts]).cpu(),  # [N, k]
        "last": torch.cat([p["last"] for p in parts]).to("cpu", store),  # [N, d]
    }
    if entering:
        tensors["aux"] = torch.cat([p["aux"] for p in parts]).to("cpu", store)  # [N, 3d]
    write_shard(path, tensors)
    return sum(map(len, batch))


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write one shard whole (a temp file renamed into place)."""
    from safetensors.torch import save_file

    write_atomic(path, lambda p: save_file({k: v.contiguous() for k, v in tensors.items()}, str(p)))


def load_features(folder: Path, max_docs: int) -> FeatureSet:
    """The first ``max_docs`` documents of a feature cache (refused unless the cache holds them all, or all the
    corpus had: shards are only read once every one they need is written)."""
    path = folder / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    if not manifest or needs_extraction(manifest, max_docs):
        raise DynvocabError(f"{folder} has no finished feature cache; run train-draft to (re)build it")
    docs = min(max_docs, manifest["docs"])
    per = manifest["settings"]["features"]["shard_docs"]
    shards = [shard_path(folder, i) for i in range(-(-docs // per))]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise DynvocabError(f"{folder} lacks feature shard {missing[0]}; rerun train-draft to rebuild it")
    return FeatureSet(folder, manifest, shards, docs)


class FeatureReader:
    """Reads one document's features at a time from the shards (memory-mapped slices, nothing else loaded);
    ``aux``: whether to read the EAGLE-3 layer taps too."""

    def __init__(self, features: FeatureSet, aux: bool = True):
        from safetensors import safe_open

        self.files = [safe_open(str(p), framework="pt") for p in features.shards]
        self.index: list[tuple[int, int, int, int]] = []  # (shard, start, end, doc) per document
        for s, f in enumerate(self.files):
            offsets, doc = f.get_tensor("offsets").tolist(), f.get_tensor("doc").tolist()
            self.index += [(s, offsets[k], offsets[k + 1], doc[k]) for k in range(len(doc))]
        self.index = self.index[: features.docs]
        self.has_aux = aux and bool(self.files) and "aux" in self.files[0].keys()

    def __len__(self) -> int:
        return len(self.index)

    @property
    def tokens(self) -> int:
        """Tokens (positions) in the documents read."""
        return sum(end - start for _, start, end, _ in self.index)

    def length(self, k: int) -> int:
        """Tokens in document ``k`` (nothing read)."""
        _, start, end, _ = self.index[k]
        return end - start

    def doc_id(self, k: int) -> int:
        """The corpus position of document ``k``."""
        return self.index[k][3]

    def read(self, k: int) -> dict[str, torch.Tensor]:
        """Document ``k``: ``ids`` [T] long, ``argmax`` [T] long, ``topk`` [T, k] long, ``last`` [T, d] float32,
        ``aux`` [T, 3d] float32."""
        s, a, b, _ = self.index[k]
        f = self.files[s]
        out = {
            "ids": f.get_slice("ids")[a:b].long(),
            "argmax": f.get_slice("argmax")[a:b].long(),
            "topk": f.get_slice("topk")[a:b].long(),
            "last": f.get_slice("last")[a:b].float(),
        }
        if self.has_aux:
            out["aux"] = f.get_slice("aux")[a:b].float()
        return out


def extra_manifest(folder: Path, topk: int) -> dict:
    """The manifest of another run's cache named by ``--extra-features``, refused in one line when the folder holds
    no finished cache of this format or keeps another top-k than this run's ``topk``."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise DynvocabError(f"--extra-features {folder} is no feature cache (no {MANIFEST}); pass a --features folder of a finished run")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DynvocabError(f"--extra-features {folder} holds features in another format; rebuild it with this version")
    if not manifest["docs"]:
        raise DynvocabError(f"--extra-features {folder} holds no documents yet; finish the run that makes it first")
    if manifest["settings"]["features"]["topk"] != topk:
        raise DynvocabError(f"--extra-features {folder} keeps the top-{manifest['settings']['features']['topk']} ids, "
                            f"this run the top-{topk}; use caches of one top-k")
    return manifest


def open_extra(folder: Path, fingerprint: ModelFingerprint, settings: dict) -> FeatureSet:
    """All documents of another run's finished cache, to train on beside this run's (``--extra-features``). Its
    documents and pass may differ (corpus, prompts, dtype, length); besides :func:`extra_manifest`'s refusals, it is
    refused when made for another target, encoded with or without a BOS token where this run's are not, or, when this
    run taps layers (EAGLE-3), not holding the same taps."""
    manifest = extra_manifest(folder, settings["features"]["topk"])
    diffs = ModelFingerprint.from_dict(manifest["target"]).differences(fingerprint)
    if diffs:
        raise DynvocabError(f"--extra-features {folder} holds features of another target ({diffs[0]})")
    if manifests.bos_differs(manifest["settings"]["corpus"], settings["corpus"]):
        made, run = ("with", "without") if manifest["settings"]["corpus"].get("bos") else ("without", "with")
        raise DynvocabError(f"--extra-features {folder} holds documents encoded {made} a BOS token, this run's are {run} "
                            "(a cache from before caches recorded it, or another tokenizer conversion); rebuild that cache")
    taps = manifest["settings"]["entering_layers"]
    if settings["entering_layers"] and taps != settings["entering_layers"]:
        raise DynvocabError(f"--extra-features {folder} taps layers {taps}, this head {settings['entering_layers']}; "
                            "use a cache made for this EAGLE-3 head")
    return load_features(folder, manifest["docs"])


class MixedReader:
    """Several caches' documents read as one: interleaved in proportion to their sizes (so the held-out documents
    scored first come from every cache), each keeping its own held-out documents.

    ``doc_id`` is the document's corpus position in its cache plus an offset per cache that is a multiple of
    ``holdout_every``, so a document is held out here exactly when it was held out in its own cache's run."""

    def __init__(self, readers: list[FeatureReader], holdout_every: int):
        self.readers = readers
        top = max((r.doc_id(k) for r in readers for k in range(len(r))), default=0) + 1
        self.stride = holdout_every * -(-top // holdout_every)
        keyed = [((k + 0.5) / len(r), c, k) for c, r in enumerate(readers) for k in range(len(r))]
        self.index = [(c, k) for _, c, k in sorted(keyed)]

    def __len__(self) -> int:
        return len(self.index)

    @property
    def tokens(self) -> int:
        """Tokens (positions) in the documents read."""
        return sum(r.tokens for r in self.readers)

    def length(self, k: int) -> int:
        """Tokens in document ``k`` (nothing read)."""
        c, j = self.index[k]
        return self.readers[c].length(j)

    def doc_id(self, k: int) -> int:
        """Document ``k``'s corpus position in its cache, offset by its cache's multiple of the held-out period."""
        c, j = self.index[k]
        return c * self.stride + self.readers[c].doc_id(j)

    def read(self, k: int) -> dict[str, torch.Tensor]:
        """Document ``k``, as :meth:`FeatureReader.read` gives it."""
        c, j = self.index[k]
        return self.readers[c].read(j)
