"""train-draft: an EAGLE head trained end to end on a tiny target, resumed after interruptions, refusals, the
training-time-test attention, the draft vocabulary as speculators builds it, the output loaded back."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from cli_helpers import assert_one_line_error, run
from tiny_models import make_model, make_tokenizer, sentences

from dynvocab.builders.corpus import CorpusConfig, encode_documents
from dynvocab.builders.draft import OptimConfig, TrainDraftConfig, distill, features, recipe, trainer, vocab
from dynvocab.builders.draft.features import FeatureConfig
from dynvocab.errors import DynvocabError
from dynvocab.models.eagle import EAGLE1, EAGLE3, EagleModel, config_like, load_eagle
from dynvocab.progress import SilentReporter, callback_reporter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny random 4-layer Qwen2 target (EAGLE-3 reads layers 2, 2, 1 entering) with a real BPE tokenizer."""
    root = tmp_path_factory.mktemp("draft_target")
    tokenizer = make_tokenizer(root / "tokenizer")
    return make_model(root / "target", tokenizer, hidden=32, seed=0, rows=len(tokenizer) + 20, layers=4)


@pytest.fixture(scope="module")
def corpus_txt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("draft_corpus") / "docs.txt"
    path.write_text("\n".join(sentences(60, seed=5)) + "\n")
    return path


def small_config(corpus: Path, arch: str = "eagle3", train_dtype: str = "float32", **optim) -> TrainDraftConfig:
    """A small run; float32 matmuls by default, so that every CPU kind trains the same head (the default,
    bfloat16 on CPUs with native bf16, is tested on its own)."""
    return TrainDraftConfig(
        arch=arch, draft_vocab=96, corpus=CorpusConfig(sources=(str(corpus),), max_docs=30),
        features=FeatureConfig(max_tokens=24, shard_docs=4),
        optim=OptimConfig(**{"epochs": 2, "lr": 3e-3, "warmup_steps": 2, "eval_every": 20, "checkpoint_every": 5, **optim}),
        device="cpu", train_dtype=train_dtype,
    )


def target_embeddings(target_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir).get_input_embeddings().weight.detach()


def head_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def test_cli_eagle3_end_to_end(target_dir, corpus_txt, tmp_path):
    out = tmp_path / "head"
    result = run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--out", out, "--arch", "eagle3",
                 "--draft-vocab", 96, "--max-docs", 30, "--max-tokens", 24, "--epochs", 1, "--lr", 3e-3,
                 "--device", "cpu", "--threads", 1)
    assert result.exit_code == 0, result.output
    assert "held-out top-1" in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 96
    weights = head_weights(out)
    d2t = weights["d2t"]
    kept = torch.arange(96) + d2t
    assert torch.all(kept[1:] > kept[:-1])  # ascending target ids: d2t holds offsets, not ids
    assert torch.equal(weights["t2d"].nonzero().flatten(), kept)
    info = json.loads((out / "training.json").read_text())
    assert info["data"]["docs"] == 30 and info["data"]["tokens"] > 0 and info["steps"] == info["data"]["train_docs"]
    assert info["target"]["hidden_size"] == 32 and len(info["target"]["tokenizer_sha256"]) == 64
    assert info["target_layers"] == [2, 2, 1]
    assert info["peak_memory_mb"] > 0 and 0.0 <= info["heldout"][-1]["top1"][0] <= 1.0
    head = load_eagle(out, embeddings=target_embeddings(target_dir))
    assert head.kind == EAGLE3 and head.config.draft_vocab == 96


def test_speculators_format_and_eagle1(target_dir, corpus_txt, tmp_path):
    out = tmp_path / "spec"
    result = run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--out", out, "--format", "speculators",
                 "--draft-vocab", 96, "--max-docs", 12, "--max-tokens", 16, "--device", "cpu", "--threads", 1)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir.resolve())  # resolves offline
    weights = head_weights(out)
    assert any(k.startswith("layers.0.") for k in weights) and "embed_tokens.weight" in weights
    out1 = tmp_path / "e1"
    result = run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--out", out1, "--arch", "eagle1",
                 "--max-docs", 12, "--max-tokens", 16, "--eval-every", 5, "--device", "cpu", "--threads", 1)
    assert result.exit_code == 0, result.output
    head = load_eagle(out1, embeddings=target_embeddings(target_dir))
    assert head.kind == EAGLE1 and "fc.bias" in head_weights(out1)
    info = json.loads((out1 / "training.json").read_text())
    steps = info["steps"]
    assert [h["step"] for h in info["heldout"]] == sorted({0, *range(5, steps + 1, 5), steps})


def unroll_failing_at(call: int):
    """``recipe.unroll`` that raises "power cut" at its ``call``-th call (a crash mid-training)."""
    real, calls = recipe.unroll, []

    def unroll(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("power cut")
        return real(*args, **kwargs)

    return unroll


@pytest.mark.parametrize("train_dtype", ["float32", "bfloat16"])
def test_training_lowers_heldout_loss(target_dir, corpus_txt, tmp_path, train_dtype):
    report = trainer.train_draft(str(target_dir), tmp_path / "h", small_config(corpus_txt, train_dtype=train_dtype, epochs=3))
    assert report.info["config"]["train_dtype"] == train_dtype
    first, last = report.info["heldout"][0], report.info["heldout"][-1]
    assert first["step"] == 0 and last["step"] == report.info["steps"]
    assert last["loss"] < first["loss"], report.info["heldout"]  # soft CE: bounded below by the teacher's entropy
    assert last["top1"][0] >= first["top1"][0] + 0.05, report.info["heldout"]


@pytest.mark.parametrize("arch,train_dtype", [("eagle3", "float32"), ("eagle1", "float32"), ("eagle1", "bfloat16")])
def test_resume_after_interruptions_equals_one_run(target_dir, corpus_txt, tmp_path, monkeypatch, arch, train_dtype):
    cfg = small_config(corpus_txt, arch, train_dtype)
    whole = trainer.train_draft(str(target_dir), tmp_path / "whole", cfg)

    out = tmp_path / "resumed"
    real_write, real_unroll = features.write_shard, recipe.unroll
    written = []

    def crash_on_third_shard(path, tensors):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(path)
        real_write(path, tensors)

    monkeypatch.setattr(features, "write_shard", crash_on_third_shard)
    with pytest.raises(KeyboardInterrupt):
        trainer.train_draft(str(target_dir), out, cfg)
    shards = sorted((out / "work" / "features").glob("shard-*"))
    assert [p.name for p in shards] == ["shard-00000.safetensors", "shard-00001.safetensors"]  # nothing half-written
    assert not list((out / "work" / "features").glob(".*"))
    monkeypatch.setattr(features, "write_shard", real_write)

    monkeypatch.setattr(recipe, "unroll", unroll_failing_at(20))
    seen, logs = [], []
    with pytest.raises(RuntimeError, match="power cut"):
        trainer.train_draft(str(target_dir), out, cfg, callback_reporter(lambda *call: seen.append(call), logs.append))
    assert (out / "work" / "checkpoint.pt").is_file() and not (out / "config.json").exists()
    assert ("target features (documents)", 0, 30 - 8) in seen  # the bar counts the work left, so its ETA is true
    assert "target features: 8 of 30 documents cached before; resuming" in logs
    monkeypatch.setattr(recipe, "unroll", real_unroll)

    step = torch.load(out / "work" / "checkpoint.pt", weights_only=False)["state"]["step"]
    seen.clear()
    resumed = trainer.train_draft(str(target_dir), out, cfg, callback_reporter(lambda *call: seen.append(call)))
    training = [call for call in seen if call[0].startswith("training")]
    assert 0 < step and training[0][1:] == (0, whole.info["steps"] - step) and training[-1][1] == whole.info["steps"] - step
    assert resumed.info["steps"] == whole.info["steps"]
    assert resumed.info["losses"] == whole.info["losses"]
    a, b = head_weights(tmp_path / "whole"), head_weights(out)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_cli_reports_on_rank_0_only(target_dir, corpus_txt, tmp_path, monkeypatch):
    """Under torchrun a rank other than 0 draws no bar and prints no summary (only its errors)."""
    monkeypatch.setenv("RANK", "1")
    result = run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--out", tmp_path / "h", "--draft-vocab", 96,
                 "--max-docs", 6, "--max-tokens", 12, "--device", "cpu", "--threads", 1)
    assert result.exit_code == 0 and result.output.strip() == "", result.output


def test_refuses_empty_corpus_and_eval_split(target_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    result = run("train-draft", "--target", target_dir, "--corpus", empty, "--out", tmp_path / "a", "--device", "cpu")
    assert_one_line_error(result, "no documents")
    result = run("train-draft", "--target", target_dir, "--corpus", "sharegpt-eval", "--out", tmp_path / "b")
    assert_one_line_error(result, "evaluation split")
    result = run("train-draft", "--target", target_dir, "--arch", "eagle2", "--out", tmp_path / "c")
    assert_one_line_error(result, "--arch")


def test_train_dtype_default_refusal_and_older_checkpoints(target_dir, corpus_txt, tmp_path, monkeypatch):
    """--train-dtype: an unknown one refused in one line; unset, the device's default dtype; a checkpoint written
    before the setting existed (float32 on CPU) resumes at float32 and is refused at bfloat16."""
    result = run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--train-dtype", "float16",
                 "--out", tmp_path / "x", "--device", "cpu")
    assert_one_line_error(result, "--train-dtype")
    monkeypatch.setattr(trainer, "default_dtype", lambda device: "bfloat16")
    unset = TrainDraftConfig(**{**small_config(corpus_txt, "eagle1", epochs=1).__dict__, "train_dtype": None})
    assert trainer.train_draft(str(target_dir), tmp_path / "d", unset).info["config"]["train_dtype"] == "bfloat16"

    out = tmp_path / "old"
    cfg = small_config(corpus_txt, "eagle1", epochs=1)
    real_unroll = recipe.unroll
    monkeypatch.setattr(recipe, "unroll", unroll_failing_at(12))
    with pytest.raises(RuntimeError, match="power cut"):
        trainer.train_draft(str(target_dir), out, cfg)
    monkeypatch.setattr(recipe, "unroll", real_unroll)
    ckpt = out / "work" / "checkpoint.pt"
    blob = torch.load(ckpt, weights_only=False)
    del blob["state"]["settings"]["train_dtype"]
    torch.save(blob, ckpt)
    with pytest.raises(DynvocabError, match="other training settings"):
        trainer.train_draft(str(target_dir), out, TrainDraftConfig(**{**cfg.__dict__, "train_dtype": "bfloat16"}))
    assert trainer.train_draft(str(target_dir), out, cfg).info["steps"] > blob["state"]["step"] > 0


def test_refuses_features_of_other_settings(target_dir, corpus_txt, tmp_path):
    out = tmp_path / "h"
    trainer.train_draft(str(target_dir), out, small_config(corpus_txt, epochs=1))
    cfg = small_config(corpus_txt, epochs=1)
    other = TrainDraftConfig(**{**cfg.__dict__, "features": FeatureConfig(max_tokens=20, shard_docs=4)})
    with pytest.raises(DynvocabError, match="other settings"):
        trainer.train_draft(str(target_dir), out, other)


def test_caches_record_whether_documents_start_with_bos(target_dir, corpus_txt, tmp_path, monkeypatch):
    """Where the tokenizer puts a BOS token before each text, the cache records it: documents encoded without it (a
    tokenizer converted without GGUF's add_bos_token, or a cache from before) are refused as --features and as
    --extra-features; a tokenizer that adds none (the tiny one) records nothing, so its older caches still serve."""
    plain = tmp_path / "plain-f"
    cfg = TrainDraftConfig(**{**small_config(corpus_txt, "eagle1", epochs=1).__dict__, "features_dir": str(plain)})
    trainer.train_draft(str(target_dir), tmp_path / "plain", cfg)
    assert "bos" not in json.loads((plain / "manifest.json").read_text())["settings"]["corpus"]
    monkeypatch.setattr(distill, "adds_bos", lambda tokenizer: True)
    with pytest.raises(DynvocabError, match=r"other settings \(corpus \(a BOS token before each document\)\)"):
        trainer.train_draft(str(target_dir), tmp_path / "again", cfg)
    beside = TrainDraftConfig(**{**cfg.__dict__, "features_dir": str(tmp_path / "bos-f"), "extra_features": (str(plain),)})
    with pytest.raises(DynvocabError, match="encoded without a BOS token, this run's are with"):
        trainer.train_draft(str(target_dir), tmp_path / "mixed", beside)
    trainer.train_draft(str(target_dir), tmp_path / "bos", TrainDraftConfig(**{**cfg.__dict__, "features_dir": str(tmp_path / "bos-f")}))
    assert json.loads((tmp_path / "bos-f" / "manifest.json").read_text())["settings"]["corpus"]["bos"] is True


def test_heads_share_one_feature_cache(target_dir, corpus_txt, tmp_path, monkeypatch):
    """An EAGLE-3 cache serves an EAGLE-1 head and a smaller budget without running the target, and grows for a
    larger one (its shorter last shard recomputed); each head equals the one trained on its own features."""
    shared = str(tmp_path / "features")
    small = lambda arch, docs: TrainDraftConfig(**{**small_config(corpus_txt, arch, epochs=1).__dict__, "features_dir": shared,
                                                   "corpus": CorpusConfig(sources=(str(corpus_txt),), max_docs=docs)})
    trainer.train_draft(str(target_dir), tmp_path / "e3-10", small("eagle3", 10))
    assert json.loads((tmp_path / "features" / "manifest.json").read_text())["docs"] == 10

    def no_target_pass(*args, **kwargs):
        raise AssertionError("the target ran although the cache held the documents")

    real = features.batch_features
    monkeypatch.setattr(features, "batch_features", no_target_pass)
    e1 = trainer.train_draft(str(target_dir), tmp_path / "e1-6", small("eagle1", 6))
    assert e1.info["data"]["docs"] == 6 and e1.info["data"]["extract"] == {}
    monkeypatch.setattr(features, "batch_features", real)
    grown = trainer.train_draft(str(target_dir), tmp_path / "e3-14", small("eagle3", 14))
    assert grown.info["data"]["docs"] == 14 and grown.info["data"]["extract"]["tokens"] > 0
    for arch, docs, out in (("eagle1", 6, "e1-6"), ("eagle3", 14, "e3-14")):
        own = TrainDraftConfig(**{**small(arch, docs).__dict__, "features_dir": None})
        alone = trainer.train_draft(str(target_dir), tmp_path / f"alone-{out}", own)
        a, b = head_weights(tmp_path / out), head_weights(tmp_path / f"alone-{out}")
        assert alone.info["data"]["tokens"] == json.loads((tmp_path / out / "training.json").read_text())["data"]["tokens"]
        for name in a:
            assert torch.equal(a[name], b[name]), (out, name)

    e1_cache = str(tmp_path / "e1-features")
    trainer.train_draft(str(target_dir), tmp_path / "e1", TrainDraftConfig(**{**small("eagle1", 6).__dict__, "features_dir": e1_cache}))
    with pytest.raises(DynvocabError, match="entering_layers"):
        trainer.train_draft(str(target_dir), tmp_path / "e3", TrainDraftConfig(**{**small("eagle3", 6).__dict__, "features_dir": e1_cache}))


def test_extra_features_train_beside_this_runs_documents(target_dir, corpus_txt, tmp_path):
    """Another run's cache joins this run's: every document of both, interleaved, each held out exactly when its own
    run held it out; the run records it, and a resume with other extras is refused."""
    other = tmp_path / "other.txt"
    other.write_text("\n".join(sentences(30, seed=11)) + "\n")
    own = lambda corpus, docs, folder, **kw: TrainDraftConfig(**{
        **small_config(corpus, "eagle1", epochs=1).__dict__, "features_dir": str(folder),
        "corpus": CorpusConfig(sources=(str(corpus),), max_docs=docs), **kw})
    trainer.train_draft(str(target_dir), tmp_path / "chat", own(corpus_txt, 23, tmp_path / "chat-f"))
    mixed = trainer.train_draft(str(target_dir), tmp_path / "mixed",
                                own(other, 12, tmp_path / "code-f", extra_features=(str(tmp_path / "chat-f"),)))
    data = mixed.info["data"]
    assert data["extra"][0]["docs"] == 23 and data["extra"][0]["features_dir"] == str(tmp_path / "chat-f")
    assert data["train_docs"] == (12 - 1) + (23 - 2) and data["heldout_docs"] == 1 + 2
    o = OptimConfig()
    a = features.FeatureReader(features.load_features(tmp_path / "code-f", 12), aux=False)
    b = features.FeatureReader(features.load_features(tmp_path / "chat-f", 23), aux=False)
    reader = features.MixedReader([a, b], o.holdout_every)
    assert len(reader) == 35 and reader.tokens == a.tokens + b.tokens
    own_docs = {(c, r.doc_id(k)): (r.read(k)["ids"].tolist(), o.held_out(r.doc_id(k)))
                for c, r in enumerate((a, b)) for k in range(len(r))}
    seen = {}
    for k in range(len(reader)):
        c, j = reader.index[k]
        seen[(c, (a, b)[c].doc_id(j))] = (reader.read(k)["ids"].tolist(), o.held_out(reader.doc_id(k)))
        assert reader.length(k) == len(seen[(c, (a, b)[c].doc_id(j))][0])
    assert seen == own_docs  # the same documents, each held out as in its own run
    assert len({reader.doc_id(k) for k in range(len(reader))}) == 35
    first = [reader.index[k][0] for k in range(len(reader)) if o.held_out(reader.doc_id(k))][:2]
    assert sorted(first) == [0, 1]  # the held-out documents scored first come from both caches
    again = own(other, 12, tmp_path / "code-f", extra_features=())
    assert (tmp_path / "mixed" / "work" / "checkpoint.pt").is_file()
    with pytest.raises(DynvocabError, match="other training settings"):
        trainer.train_draft(str(target_dir), tmp_path / "mixed", again)


def test_extra_features_refusals(target_dir, corpus_txt, tmp_path):
    chat = tmp_path / "chat-f"
    trainer.train_draft(str(target_dir), tmp_path / "chat", TrainDraftConfig(**{
        **small_config(corpus_txt, "eagle1", epochs=1).__dict__, "features_dir": str(chat),
        "corpus": CorpusConfig(sources=(str(corpus_txt),), max_docs=6)}))
    base = ["train-draft", "--target", target_dir, "--corpus", corpus_txt, "--max-docs", 6, "--max-tokens", 24,
            "--out", tmp_path / "h", "--threads", 1, "--arch", "eagle1"]
    assert_one_line_error(run(*base, "--extra-features", tmp_path / "none"), "is no folder")
    assert_one_line_error(run(*base, "--features", chat, "--extra-features", chat), "this run's own --features folder")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run(*base, "--extra-features", tmp_path / "empty"), "is no feature cache")
    assert_one_line_error(run(*base[:-1], "eagle3", "--draft-vocab", 96, "--extra-features", chat), "taps layers")
    topk = TrainDraftConfig(**{**small_config(corpus_txt, "eagle1", epochs=1).__dict__,
                               "features": FeatureConfig(max_tokens=24, shard_docs=4, topk=8),
                               "extra_features": (str(chat),)})
    with pytest.raises(DynvocabError, match="top-16 ids, this run the top-8"):
        trainer.train_draft(str(target_dir), tmp_path / "k8", topk)


def test_features_only_builds_a_cache_that_a_later_run_trains_beside(target_dir, corpus_txt, tmp_path):
    """--features-only stops after phase 1: the cache is whole and no head is written; a later run trains on it
    beside its own documents (the EAGLE-3 layer taps included), and the flag refuses the extras it cannot use."""
    chat = tmp_path / "chat-f"
    base = ["train-draft", "--target", target_dir, "--max-tokens", 24, "--threads", 1, "--arch", "eagle3",
            "--draft-vocab", 96]
    made = run(*base, "--corpus", corpus_txt, "--max-docs", 10, "--features", chat, "--features-only")
    assert made.exit_code == 0, made.output
    assert "10 documents" in made.output and "no head trained (--features-only)" in made.output
    assert sorted(p.name for p in chat.iterdir() if not p.name.startswith("shard-")) == ["manifest.json"]
    cached = features.load_features(chat, 10)
    assert cached.docs == 10 and features.FeatureReader(cached, aux=True).read(0)["aux"].shape[-1] == 3 * 32
    again = run(*base, "--corpus", corpus_txt, "--max-docs", 10, "--features", chat, "--features-only",
                "--out", tmp_path / "cache")
    assert again.exit_code == 0 and "no head trained" in again.output  # a finished cache: nothing to redo
    other = tmp_path / "other.txt"
    other.write_text("\n".join(sentences(12, seed=11)) + "\n")
    trained = run(*base, "--corpus", other, "--max-docs", 12, "--extra-features", chat, "--epochs", 1,
                  "--out", tmp_path / "head")
    assert trained.exit_code == 0, trained.output
    info = json.loads((tmp_path / "head" / "training.json").read_text())
    assert info["data"]["extra"][0]["docs"] == 10 and info["data"]["train_docs"] == (12 - 1) + (10 - 1)
    assert_one_line_error(run(*base, "--corpus", other, "--features-only", "--extra-features", chat,
                              "--out", tmp_path / "x"), "--features-only trains nothing")
    assert_one_line_error(run(*base, "--corpus", other, "--features-only"), "pass --out")


# ---- the unroll -------------------------------------------------------------------------------------------


def tiny_head(kind: str) -> tuple[EagleModel, dict]:
    from transformers import LlamaConfig

    layer = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=40,
                        num_hidden_layers=4, max_position_embeddings=64)
    extra = {"draft_vocab_size": 40, "target_hidden_size": 16} if kind == EAGLE3 else {}
    torch.manual_seed(0)
    model = EagleModel(config_like(layer, kind, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    T = 9
    doc = {"ids": torch.randint(0, 40, (T,)), "argmax": torch.randint(0, 40, (T,)), "last": torch.randn(T, 16)}
    if kind == EAGLE3:
        doc["aux"] = torch.randn(T, 48)
    return model, doc


@pytest.mark.parametrize("kind", [EAGLE1, EAGLE3])
def test_step0_is_the_models_forward(kind):
    model, doc = tiny_head(kind)
    from transformers import DynamicCache

    n = doc["ids"].numel() - 1
    feats = (doc["last"] if kind == EAGLE1 else doc["aux"])[:n][None]
    ids, pos = doc["ids"][1:][None], torch.arange(n)[None]
    want = model(ids, feats, pos)
    got = recipe.forward_step(model, ids, feats, pos, DynamicCache(config=model.layer_config), recipe.attention_mask(n, 0, "cpu"))
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("kind", [EAGLE1, EAGLE3])
def test_unroll_never_sees_the_future(kind):
    """Step i at index t may read tokens up to x_{t+1+i} and features up to f_t, nothing later."""
    model, doc = tiny_head(kind)
    steps, t = 3, 3
    outs = []

    def capture(*args, **kwargs):
        out = real(*args, **kwargs)
        outs[-1].append(out[0][0, t].clone())
        return out

    real = recipe.forward_step
    for variant in range(2):
        d = {k: v.clone() for k, v in doc.items()}
        if variant:
            d["last"][t + 1 :] += 5.0
            if "aux" in d:
                d["aux"][t + 1 :] += 5.0
        outs.append([])
        recipe.forward_step = capture
        try:
            recipe.unroll(model, [d], steps, torch.randn(40, 16), torch.arange(40) if kind == EAGLE3 else None)
        finally:
            recipe.forward_step = real
    for i in range(steps):
        torch.testing.assert_close(outs[0][i], outs[1][i])
    changed = {k: v.clone() for k, v in doc.items()}
    changed["ids"][t + 1 + steps] = (changed["ids"][t + 1 + steps] + 1) % 40  # a token no step at t reads
    outs.append([])
    recipe.forward_step = capture
    try:
        recipe.unroll(model, [changed], steps, torch.randn(40, 16), torch.arange(40) if kind == EAGLE3 else None)
    finally:
        recipe.forward_step = real
    for i in range(steps):
        torch.testing.assert_close(outs[0][i], outs[2][i])


def test_attention_mask_shape():
    mask = recipe.attention_mask(3, 2, "cpu")[0, 0]
    assert mask.tolist() == [
        [True, False, False, True, False, False, True, False, False],
        [True, True, False, False, True, False, False, True, False],
        [True, True, True, False, False, True, False, False, True],
    ]


# ---- the draft vocabulary ----------------------------------------------------------------------------------


def speculators_reference(counts: dict[int, int], size: int) -> list[int]:
    """vllm-project/speculators train/vocab_mapping.py, build_vocab_mappings_from_distribution: kept ids."""
    order = sorted(counts, key=lambda tid: (-counts[tid], tid))[:size]
    return sorted(order)


def test_draft_vocab_matches_speculators():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 1000, 500).astype(np.int64)
    counts[7] = 10_000  # the end token is frequent anyway, so the forced-in end token changes nothing
    kept, info = vocab.from_counts(counts, [7], 64)
    ref = speculators_reference({i: int(c) for i, c in enumerate(counts) if c > 0}, 64)
    assert kept.tolist() == ref
    assert info["source"] == "training documents" and 0 < info["coverage"] < 1
    with pytest.raises(DynvocabError, match="--draft-vocab"):
        vocab.from_counts(counts, [7], 501)


# ---- the output as a draft ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(target_dir, corpus_txt, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trained")
    out = {}
    for name, arch, layout in (("eagle3", "eagle3", "eagle"), ("speculators", "eagle3", "speculators"), ("eagle1", "eagle1", "eagle")):
        cfg = TrainDraftConfig(**{**small_config(corpus_txt, arch, epochs=1).__dict__, "layout": layout})
        out[name] = trainer.train_draft(str(target_dir), root / name, cfg).path
    return out


@pytest.mark.parametrize("name", ["eagle3", "speculators", "eagle1"])
def test_trained_head_drafts_losslessly(target_dir, trained, tmp_path, name):
    token_map = tmp_path / "map.pt"
    torch.save(list(range(0, 200, 2)), token_map)

    def generate(strategy, *extra):
        result = run("generate", "Def fast draft(x): return the model", "--target", target_dir, "--draft", trained[name],
                     "--no-chat-template", "--quiet", "--dtype", "float32", "--strategy", strategy,
                     "--max-new-tokens", 16, "--json", "--threads", 1, *extra)
        assert result.exit_code == 0, result.output
        return json.loads(result.output.strip().splitlines()[-1])

    ar = generate("ar")["token_ids"]
    assert len(ar) == 16
    for strategy in ("full", "fr", "microspec", "hybrid"):
        extra = ["--token-map", token_map] if strategy in ("fr", "hybrid") else []
        out = generate(strategy, *extra)
        assert out["token_ids"] == ar, (name, strategy)
        assert out["metrics"]["cycles"] > 0


@pytest.mark.parametrize("name", ["eagle3", "eagle1"])
def test_init_from_continues_the_trained_head(target_dir, corpus_txt, trained, tmp_path, name):
    """--init-from starts from the trained head's own weights: the new run's step-0 held-out score is the trained
    run's last one (same documents), not a fresh start's, and training goes on from there."""
    before = json.loads((trained[name] / "training.json").read_text())["heldout"][-1]
    cfg = TrainDraftConfig(**{**small_config(corpus_txt, name, epochs=1).__dict__, "init_from": str(trained[name])})
    report = trainer.train_draft(str(target_dir), tmp_path / "more", cfg)
    start = report.info["heldout"][0]
    assert start["step"] == 0 and (start["loss"], start["top1"]) == (before["loss"], before["top1"])
    fresh = trainer.train_draft(str(target_dir), tmp_path / "fresh", small_config(corpus_txt, name, epochs=1))
    assert fresh.info["heldout"][0]["loss"] > start["loss"]
    assert report.info["config"]["init_from"] == str(trained[name]) and report.info["steps"] > 0


def test_init_from_refuses_another_kind_or_no_head(target_dir, corpus_txt, trained, tmp_path):
    common = ("--target", target_dir, "--corpus", corpus_txt, "--max-docs", 12, "--max-tokens", 16, "--device", "cpu",
              "--threads", 1, "--draft-vocab", 96)
    result = run("train-draft", *common, "--out", tmp_path / "a", "--arch", "eagle1", "--init-from", trained["eagle3"])
    assert_one_line_error(result, "is an eagle3 head; pass --arch eagle3")
    result = run("train-draft", *common, "--out", tmp_path / "b", "--arch", "eagle1", "--init-from", target_dir)
    assert_one_line_error(result, "is not an EAGLE head")
    assert not (tmp_path / "a" / "model.safetensors").exists() and not (tmp_path / "b" / "model.safetensors").exists()


# ---- batches and ranks -------------------------------------------------------------------------------------


def test_batched_features_equal_one_document_at_a_time(target_dir, corpus_txt, tmp_path):
    """Right-padded passes of several documents give each document the features of its own pass."""
    from dynvocab.builders.models import fingerprint
    from dynvocab.models import load_model, load_tokenizer, resolve_model

    spec = resolve_model(str(target_dir))
    tokenizer = load_tokenizer(spec)
    model = load_model(spec, "cpu", "float32")
    docs = list(itertools.islice(encode_documents(CorpusConfig(sources=(str(corpus_txt),), max_docs=10), tokenizer, 24), 10))
    assert len({len(d) for d in docs}) > 1  # documents of several lengths, so padding happens
    shards = {}
    for per_pass in (1, 4):
        cfg = FeatureConfig(max_tokens=24, shard_docs=5, dtype="float32", batch_docs=per_pass)
        folder = tmp_path / f"per-{per_pass}"
        settings = features.settings_of(cfg, {"sources": ["x"]}, (2, 2, 1))
        manifest = features.open_manifest(folder, fingerprint(spec, tokenizer), settings)
        features.extract(model, iter(docs), folder, manifest, cfg, 10, SilentReporter())
        shards[per_pass] = [load_file(str(features.shard_path(folder, i))) for i in range(2)]
    for one, batched in zip(shards[1], shards[4]):
        for name in ("ids", "offsets", "doc", "argmax", "topk"):
            assert torch.equal(one[name], batched[name]), name
        for name in ("last", "aux"):
            torch.testing.assert_close(one[name].float(), batched[name].float(), atol=2e-2, rtol=2e-2)  # stored bf16


@pytest.mark.parametrize("kind", [EAGLE1, EAGLE3])
def test_batched_unroll_equals_documents_one_by_one(kind):
    """One padded unroll over documents of several lengths: the same token-weighted loss and gradient as the
    documents unrolled one at a time, each divided by the whole batch's positions (noise drawn per document)."""
    model, _ = tiny_head(kind)
    gen = torch.Generator().manual_seed(1)
    docs = []
    for T in (9, 5, 2, 7):
        doc = {"ids": torch.randint(0, 40, (T,), generator=gen), "argmax": torch.randint(0, 40, (T,), generator=gen),
               "last": torch.randn(T, 16, generator=gen)}
        if kind == EAGLE3:
            doc["aux"] = torch.randn(T, 48, generator=gen)
        docs.append(doc)
    steps, head, draft = 3, torch.randn(40, 16), torch.arange(40) if kind == EAGLE3 else None
    positions = [sum(max(0, d["ids"].numel() - 1 - i) for d in docs) for i in range(steps)]
    noise = lambda: [torch.Generator().manual_seed(100 + b) for b in range(len(docs))]

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    together = recipe.weighted_loss(recipe.unroll(model, docs, steps, head, draft, 0.2, noise()), positions)
    g_together = grads(together)
    gens = noise()
    alone = sum(recipe.weighted_loss(recipe.unroll(model, [d], steps, head, draft, 0.2, [g]), positions)
                for d, g in zip(docs, gens))
    g_alone = grads(alone)
    torch.testing.assert_close(together, alone)
    for a, b in zip(g_together, g_alone):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)  # float32 rounding (float64: 1e-13)


def launch_ranks(spec: dict, tmp_path: Path, ranks: int = 2) -> int:
    """Run tests/draft_ranks.py on ``ranks`` gloo ranks (torchrun, a free port on 127.0.0.1); its exit code. The
    launch has a session of its own, which is killed whole if it outlives the time limit: no process is left."""
    import os
    import signal
    import subprocess
    import sys

    path = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    path.write_text(json.dumps(spec))
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": f"{here.parent}{os.pathsep}{here}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", str(here / "draft_ranks.py"), str(path)]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = out.decode(errors="replace")  # the ranks' own lines come first, torchrun's report of a failure last
    spec["log"] = log if len(log) <= 8000 else log[:5000] + "\n[…]\n" + log[-3000:]
    return proc.returncode


RANK_OPTIM = {"epochs": 2, "lr": 3e-3, "warmup_steps": 2, "eval_every": 20, "checkpoint_every": 5, "batch_docs": 4}


@pytest.fixture(scope="module")
def one_rank(target_dir, corpus_txt, tmp_path_factory):
    """(config, report, folder) of one process taking 4 documents per step (25 training documents: 7 steps an
    epoch, the last of a single document), in micro-batches of 4."""
    cfg = small_config(corpus_txt, **{**RANK_OPTIM, "micro_docs": 4})
    cfg = TrainDraftConfig(**{**cfg.__dict__, "corpus": CorpusConfig(sources=(str(corpus_txt),), max_docs=27)})
    out = tmp_path_factory.mktemp("one_rank") / "one"
    report = trainer.train_draft(str(target_dir), out, cfg)
    assert report.info["data"]["train_docs"] == 25 and report.info["steps"] == 2 * 7 and report.info["ranks"] == 1
    return cfg, report, out


def rank_spec(target_dir, corpus_txt, out: Path, **extra) -> dict:
    return {"target": str(target_dir), "arch": "eagle3", "draft_vocab": 96, "corpus": [str(corpus_txt)], "max_docs": 27,
            "features": {"max_tokens": 24, "shard_docs": 4}, "optim": {**RANK_OPTIM, "micro_docs": 1}, "out": str(out), **extra}


def test_two_ranks_train_the_head_of_one(target_dir, corpus_txt, tmp_path, one_rank):
    """2 gloo ranks (features split between them; each step's 4 documents split 2 + 2, the epoch's last single
    document 1 + 0; one document per pass) give the head of one process taking the same 4 documents per step."""
    _, one, one_out = one_rank
    spec = rank_spec(target_dir, corpus_txt, tmp_path / "two", features_dir=str(tmp_path / "features2"))
    assert launch_ranks(spec, tmp_path) == 0, spec["log"]
    two = json.loads((tmp_path / "two" / "training.json").read_text())
    assert two["ranks"] == 2 and two["data"]["extract"]["ranks"] == 2 and two["steps"] == one.info["steps"]
    mine, theirs = sorted((one_out / "work" / "features").glob("shard-*")), sorted((tmp_path / "features2").glob("shard-*"))
    assert [p.name for p in mine] == [p.name for p in theirs] and not list((tmp_path / "features2").glob(".*"))
    for a, b in zip(mine, theirs):
        for name, tensor in load_file(str(a)).items():
            assert torch.equal(tensor, load_file(str(b))[name]), (a.name, name)
    np.testing.assert_allclose(two["losses"], one.info["losses"], rtol=1e-4, atol=1e-5)
    assert_same_head(head_weights(one_out), head_weights(tmp_path / "two"))


def test_two_ranks_killed_then_resumed_on_one(target_dir, corpus_txt, tmp_path, one_rank):
    """Rank 0 of a 2-rank run is killed (SIGKILL) right after its first checkpoint: the cache and the checkpoint
    are whole, no head is written, and the run resumed on one rank ends with the uninterrupted run's head."""
    cfg, one, one_out = one_rank
    spec = rank_spec(target_dir, corpus_txt, tmp_path / "killed", die_after_checkpoint=True)
    assert launch_ranks(spec, tmp_path) != 0
    work = tmp_path / "killed" / "work"
    assert not (tmp_path / "killed" / "config.json").exists() and not list(work.glob(".*"))
    assert json.loads((work / "features" / "manifest.json").read_text())["docs"] == 27
    assert torch.load(work / "checkpoint.pt", weights_only=False)["state"]["step"] == 5
    resumed = trainer.train_draft(str(target_dir), tmp_path / "killed", cfg)
    assert resumed.info["ranks"] == 1 and resumed.info["data"]["extract"] == {}
    np.testing.assert_allclose(resumed.info["losses"], one.info["losses"], rtol=1e-4, atol=1e-5)
    assert_same_head(head_weights(one_out), head_weights(tmp_path / "killed"))


def assert_same_head(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4, msg=name)
