"""train-draft --self-distill and the sampled EAGLE-1 loss: the target's own continuations (batched = one prompt
at a time, cut at end tokens, seeded sampling, resumed and refused like the features), the candidate rows'
importance weights, and a head trained end to end on self-distilled documents that drafts losslessly."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_one_line_error, run
from tiny_models import make_model, make_tokenizer, sentences

from dynvocab.builders.corpus import CorpusConfig, encode_documents
from dynvocab.builders.draft import OptimConfig, TrainDraftConfig, distill, recipe, trainer
from dynvocab.builders.draft.features import FeatureConfig
from dynvocab.builders.models import fingerprint
from dynvocab.errors import DynvocabError
from dynvocab.progress import SilentReporter, callback_reporter

pytestmark = [pytest.mark.transformers_api, pytest.mark.usefixtures("one_thread")]  # CI: again at the lower bound


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("distill_target")
    tokenizer = make_tokenizer(root / "tokenizer")
    return make_model(root / "target", tokenizer, hidden=32, seed=0, rows=len(tokenizer) + 20, layers=2)


@pytest.fixture(scope="module")
def loaded(target_dir):
    from dynvocab.models import load_model, load_tokenizer, resolve_model

    spec = resolve_model(str(target_dir))
    tokenizer = load_tokenizer(spec)
    return spec, tokenizer, load_model(spec, "cpu", "float32")


@pytest.fixture(scope="module")
def corpus_txt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("distill_corpus") / "docs.txt"
    path.write_text("\n".join(sentences(40, seed=7)) + "\n")
    return path


def prompts(tokenizer, corpus: Path, n: int, tokens: int = 6) -> list[list[int]]:
    docs = encode_documents(CorpusConfig(sources=(str(corpus),), max_docs=n), tokenizer, 24)
    return [d[:tokens] for d in docs]


def greedy_alone(model, prompt: list[int], new: int, end_ids: set[int]) -> list[int]:
    """The target's greedy continuation of one prompt, one full forward per token (no cache, no padding)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt in end_ids:
                break
    return ids


def test_batched_greedy_continuations_equal_one_prompt_at_a_time(loaded, corpus_txt):
    spec, tokenizer, model = loaded
    batch = [p[: 3 + k % 4] for k, p in enumerate(prompts(tokenizer, corpus_txt, 6))]  # several lengths: left padding
    assert len({len(p) for p in batch}) > 1
    cfg = distill.DistillConfig(new_tokens=10)
    end = [tokenizer.eos_token_id]
    got = distill.continue_batch(model, batch, cfg, tokenizer.pad_token_id or 0, end, seed=0)
    for p, doc in zip(batch, got):
        assert doc == greedy_alone(model, p, 10, set(end))


def test_continuations_stop_after_an_end_token(loaded, corpus_txt):
    spec, tokenizer, model = loaded
    batch = prompts(tokenizer, corpus_txt, 3)
    free = distill.continue_batch(model, batch, distill.DistillConfig(new_tokens=8), 0, [tokenizer.eos_token_id], 0)
    stop = free[0][len(batch[0]) + 2]  # the third token the target writes for the first prompt, now an end token
    cut = distill.continue_batch(model, batch, distill.DistillConfig(new_tokens=8), 0, [stop], 0)
    first = cut[0][len(batch[0]):]
    assert first[-1] == stop and stop not in first[:-1] and len(first) <= 3


def test_sampling_is_seeded_and_leaves_the_global_generator_alone(loaded, corpus_txt):
    spec, tokenizer, model = loaded
    batch = prompts(tokenizer, corpus_txt, 4)
    cfg = distill.DistillConfig(new_tokens=12, temperature=1.5)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = distill.continue_batch(model, batch, cfg, 0, [tokenizer.eos_token_id], seed=5)
    assert torch.equal(torch.rand(1), before)  # the global state is as it was
    assert a == distill.continue_batch(model, batch, cfg, 0, [tokenizer.eos_token_id], seed=5)
    assert a != distill.continue_batch(model, batch, cfg, 0, [tokenizer.eos_token_id], seed=6)
    greedy = distill.continue_batch(model, batch, distill.DistillConfig(new_tokens=12), 0, [tokenizer.eos_token_id], 5)
    assert a != greedy


def test_sample_by_cdf_draws_from_the_tempered_distribution():
    """The inverse-CDF sampler's frequencies match softmax(scores / T) within sampling error (a chi-square test at
    a 1e-4 false-alarm rate; a sampler off by a temperature or a position fails it), and ids at -inf never come."""
    critical = 23.51  # chi2.ppf(1 - 1e-4, df=4) (scipy, not a dependency): each row has 5 live ids
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5], [0.0, 0.0, 3.0, float("-inf"), -2.0, 1.0]])
    n, temperature = 20_000, 0.7
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([distill.sample_by_cdf(scores, temperature, generator) for _ in range(n)])  # [n, 2]
    for row in range(2):
        want = torch.softmax(scores[row] / temperature, -1)
        counts = torch.bincount(draws[:, row], minlength=6).double()
        assert counts[want == 0].sum() == 0
        live = want > 0
        stat = (((counts[live] - n * want[live]) ** 2) / (n * want[live])).sum().item()
        assert int(live.sum()) == 5 and stat < critical, (row, counts, n * want)
        wrong = torch.softmax(scores[row] / 1.0, -1)[live]  # the same scores at temperature 1: must be told apart
        assert (((counts[live] - n * wrong) ** 2) / (n * wrong)).sum().item() > critical


def test_with_bos_follows_the_tokenizer(loaded):
    _, tokenizer, _ = loaded

    class Bos:
        bos_token_id = 7

        def __call__(self, text):
            return {"input_ids": [7, 1]}

    assert distill.with_bos([3, 4], Bos()) == [7, 3, 4]
    assert distill.with_bos([7, 4], Bos()) == [7, 4]
    assert distill.with_bos([3, 4], tokenizer) == [3, 4]  # the tiny BPE puts no BOS before a prompt


def test_generation_resumes_and_refuses_other_settings(loaded, corpus_txt, tmp_path, monkeypatch):
    spec, tokenizer, model = loaded
    cfg = distill.DistillConfig(prompt_tokens=5, new_tokens=6, batch=3)
    fp = fingerprint(spec, tokenizer)
    settings = distill.settings_of(cfg, {"sources": ["x"], "max_docs": 7})
    folder = tmp_path / "docs"
    manifest = distill.open_manifest(folder, fp, settings)
    end = [tokenizer.eos_token_id]
    first = distill.generate(model, tokenizer, iter(prompts(tokenizer, corpus_txt, 7, 24)), folder, manifest, cfg, 7, end,
                             SilentReporter())
    docs = list(distill.documents(folder, 7, 100))
    assert first["docs"] == 7 and len(docs) == 7 and sorted(p.name for p in folder.glob("docs-*")) == [
        "docs-00000.safetensors", "docs-00001.safetensors", "docs-00002.safetensors"]
    assert distill.summary(folder, 7)["new_tokens"] == sum(len(d) for d in docs) - distill.summary(folder, 7)["prompt_tokens"]
    (folder / "docs-00001.safetensors").unlink()  # as if killed before that shard was written
    calls = []
    real = distill.continue_batch
    monkeypatch.setattr(distill, "continue_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    seen, logs = [], []
    distill.generate(model, tokenizer, iter(prompts(tokenizer, corpus_txt, 7, 24)), folder, manifest, cfg, 7, end,
                     callback_reporter(lambda *call: seen.append(call), logs.append))
    assert seen[0][1:] == (0, 3) and seen[-1][1:] == (3, 3)  # the bar counts the missing shard only: a true ETA
    assert logs == ["self-distilled documents: 4 of 7 written before; resuming"]
    assert len(calls) == 1 and list(distill.documents(folder, 7, 100)) == docs  # only the missing shard, the same documents
    assert [len(d) for d in distill.documents(folder, 7, 8)] == [min(8, len(d)) for d in docs]
    other = distill.settings_of(distill.DistillConfig(prompt_tokens=5, new_tokens=6, batch=3, temperature=0.7), {"sources": ["x"]})
    with pytest.raises(DynvocabError, match="other settings"):
        distill.open_manifest(folder, fp, other)


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def chat_corpus(tmp_path) -> Path:
    rows = [
        {"conversations": [{"from": "human", "value": "Write a short def in python"}, {"from": "gpt", "value": "def f(): pass"}]},
        {"messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Name a fast model"},
                      {"role": "assistant", "content": "The draft"}, {"role": "user", "content": "Another one"}]},
        {"conversations": [{"from": "gpt", "value": "An answer with no question"}]},  # opens with the assistant
        {"text": "A plain text row is one user turn of its own " * 6},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("template", [None, TEMPLATE])
def test_turn_prompts_are_the_first_user_turns_encoded_as_the_runtime_encodes_prompts(loaded, chat_corpus, template):
    """--distill-prompts turn: each row's first user turn (system turn kept, a plain-text row as one turn, a
    conversation opening with the assistant skipped), cut beyond prompt_tokens, encoded by the runtime's own
    encode_prompt: with the chat template and the model's turn opened, or as plain text without one."""
    import copy

    from dynvocab.prompts import encode_prompt

    tokenizer = copy.deepcopy(loaded[1])
    tokenizer.chat_template = template
    cfg = distill.DistillConfig(prompt_tokens=30)
    assert all(len(tokenizer(t)["input_ids"]) < 30 for t in ("Write a short def in python", "Name a fast model"))
    got = list(distill.prompt_ids(cfg, CorpusConfig(sources=(str(chat_corpus),), max_docs=10), iter(()), tokenizer))
    long = "A plain text row is one user turn of its own " * 6
    cut = tokenizer.decode(tokenizer(long, add_special_tokens=False)["input_ids"][:30]).rstrip() + " …"
    want = [[{"role": "user", "content": "Write a short def in python"}],
            [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Name a fast model"}],
            [{"role": "user", "content": cut}]]
    assert got == [encode_prompt(tokenizer, m) for m in want]
    if template:
        assert tokenizer.decode(got[1]).endswith("<user>Name a fast model</user><assistant>")
    assert len(list(distill.prompt_ids(cfg, CorpusConfig(sources=(str(chat_corpus),), max_docs=2), iter(()), tokenizer))) == 2


def test_text_prompts_are_the_documents_first_tokens_after_a_bos(loaded):
    _, tokenizer, _ = loaded
    cfg = distill.DistillConfig(prompts="text", prompt_tokens=3)
    docs = [[5, 6, 7, 8, 9], [10, 11]]
    assert list(distill.prompt_ids(cfg, None, iter(docs), tokenizer)) == [distill.with_bos(d[:3], tokenizer) for d in docs]


def test_text_caches_made_before_the_prompt_styles_still_serve_their_runs():
    """Caches made before --distill-prompts are all text caches and record no `prompts` key; a text run's settings
    equal theirs, and a turn run's differ."""
    old = {"prompt_tokens": 64, "new_tokens": 192, "temperature": 0.0, "batch": 32, "dtype": "bfloat16", "seed": 0}
    text = distill.DistillConfig(prompts="text", prompt_tokens=64, batch=32, dtype="bfloat16")
    assert distill.as_settings(text) == old
    assert distill.as_settings(replace(text, prompts="turn")) == {**old, "prompts": "turn"}


def test_refusals_of_impossible_settings():
    for cfg, flag in ((distill.DistillConfig(new_tokens=0), "--distill-new-tokens"),
                      (distill.DistillConfig(batch=0), "--distill-batch"),
                      (distill.DistillConfig(prompts="chat"), "--distill-prompts"),
                      (distill.DistillConfig(temperature=-1), "--distill-temperature")):
        with pytest.raises(DynvocabError, match=flag):
            cfg.check()


# ---- the sampled loss ----------------------------------------------------------------------------------------


def test_candidate_rows_weigh_the_sample_for_the_rest_of_the_head():
    torch.manual_seed(0)
    head = torch.randn(1000, 8)
    topk = torch.tensor([[1, 2, 3], [3, 4, 5]])
    argmax = torch.tensor([1, 9])
    negatives = torch.tensor([2, 100, 200, 300, 400])  # 2 is a top id: dropped from the sample
    rows, shift, ids = recipe.candidate_rows(head, topk, argmax, negatives)
    assert ids.tolist() == [1, 2, 3, 4, 5, 9, 100, 200, 300, 400]
    assert torch.equal(rows, head[ids])
    assert shift[:6].eq(0).all() and torch.allclose(shift[6:], torch.full((4,), math.log((1000 - 6) / 4)))


def test_sampled_loss_with_every_other_id_sampled_is_the_full_loss():
    """With the rest of the head as the sample (weight log 1 = 0) the sampled cross-entropy is the full one."""
    torch.manual_seed(0)
    head, out, teacher = torch.randn(50, 8), torch.randn(6, 8), torch.randn(6, 8)
    argmax = (teacher @ head.T).argmax(-1)
    topk = (teacher @ head.T).topk(3).indices
    rows, shift, ids = recipe.candidate_rows(head, topk, argmax, torch.randperm(50))
    full = recipe._eagle1_loss(out, teacher, head, argmax)
    sampled = recipe._eagle1_loss(out, teacher, rows, argmax, shift, ids)
    torch.testing.assert_close(sampled.loss, full.loss)
    assert sampled.agree == full.agree


def test_sampled_loss_estimates_the_full_one():
    """A uniform sample of a quarter of the rest gives, on average over samples, nearly the full cross-entropy."""
    torch.manual_seed(1)
    head, out, teacher = torch.randn(400, 8), torch.randn(16, 8), torch.randn(16, 8)
    argmax = (teacher @ head.T).argmax(-1)
    topk = (teacher @ head.T).topk(4).indices
    full = float(recipe._eagle1_loss(out, teacher, head, argmax).loss)
    gen = torch.Generator().manual_seed(0)
    values = []
    for _ in range(200):
        rows, shift, ids = recipe.candidate_rows(head, topk, argmax, torch.randperm(400, generator=gen)[:100])
        values.append(float(recipe._eagle1_loss(out, teacher, rows, argmax, shift, ids).loss))
    assert abs(sum(values) / len(values) - full) < 0.05 * abs(full)


# ---- end to end ----------------------------------------------------------------------------------------------


def small(corpus: Path, **optim) -> TrainDraftConfig:
    return TrainDraftConfig(
        arch="eagle1", corpus=CorpusConfig(sources=(str(corpus),), max_docs=20),
        features=FeatureConfig(max_tokens=24, shard_docs=4),
        optim=OptimConfig(**{"epochs": 1, "lr": 3e-3, "warmup_steps": 2, "eval_every": 10, "checkpoint_every": 5,
                             "negatives": 64, **optim}),
        device="cpu", distill=distill.DistillConfig(prompt_tokens=5, new_tokens=12, batch=8), save_dtype="bfloat16",
    )


def test_self_distilled_head_trains_records_and_drafts_losslessly(target_dir, corpus_txt, tmp_path):
    report = trainer.train_draft(str(target_dir), tmp_path / "head", small(corpus_txt))
    info = json.loads((tmp_path / "head" / "training.json").read_text())
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(tmp_path / "head" / "model.safetensors")).values()} == {torch.bfloat16}
    made = info["data"]["self_distilled"]
    assert made["docs"] == 20 and made["new_tokens"] > 0 and made["settings"]["new_tokens"] == 12
    assert info["config"]["distill"]["dtype"] == "float32" or info["config"]["distill"]["dtype"] == "bfloat16"
    assert info["heldout"][-1]["loss"] < info["heldout"][0]["loss"]
    folder = tmp_path / "head" / "work" / "features"
    assert (folder / "documents" / distill.MANIFEST).is_file()
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["settings"]["corpus"]["self_distill"]["prompt_tokens"] == 5
    # the features are the generated documents': their tokens are the prompts and the target's continuations
    ids = load_file(str(folder / "shard-00000.safetensors"))["ids"].tolist()
    docs = list(distill.documents(folder / "documents", 4, 24))
    assert ids == [t for d in docs for t in d]
    ar = run("generate", "Def fast draft(x): return the model", "--target", target_dir, "--draft", report.path,
             "--no-chat-template", "--quiet", "--dtype", "float32", "--strategy", "ar", "--max-new-tokens", 12,
             "--json", "--threads", 1)
    for strategy in ("ar", "full", "microspec"):
        out = run("generate", "Def fast draft(x): return the model", "--target", target_dir, "--draft", report.path,
                  "--no-chat-template", "--quiet", "--dtype", "float32", "--strategy", strategy, "--max-new-tokens", 12,
                  "--json", "--threads", 1)
        assert out.exit_code == 0, out.output
        assert json.loads(out.output.strip().splitlines()[-1])["token_ids"] == json.loads(ar.output.strip().splitlines()[-1])["token_ids"]


def test_cli_self_distill_refusals(target_dir, corpus_txt, tmp_path):
    assert_one_line_error(run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--out", tmp_path / "h",
                              "--self-distill", "--distill-new-tokens", 0), "--distill-new-tokens must be at least 1")
    assert_one_line_error(run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--out", tmp_path / "h",
                              "--negatives", -1), "--negatives must be 0")
    assert_one_line_error(run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--out", tmp_path / "h",
                              "--self-distill", "--distill-prompts", "chat"), "unknown --distill-prompts 'chat'")
    assert_one_line_error(run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--out", tmp_path / "h",
                              "--self-distill", "--max-tokens", 200), "--max-tokens 200 would cut the target's answers")
    assert_one_line_error(run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--out", tmp_path / "h",
                              "--self-distill", "--distill-prompts", "text"), "--max-tokens 256 would cut the target's answers")
    assert_one_line_error(run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--out", tmp_path / "h",
                              "--self-distill", "--distill-engine", "sglang"), "unknown --distill-engine 'sglang'")
    assert_one_line_error(run("train-draft", "--target", target_dir, "--corpus", corpus_txt, "--out", tmp_path / "h",
                              "--self-distill", "--distill-engine", "vllm", "--vllm-python", tmp_path / "none"),
                          "does not exist; pass the python of an environment with vLLM")
    assert not (tmp_path / "h").exists()


def test_self_distill_documents_default_to_room_for_a_whole_answer():
    """Turn prompts get --max-tokens for prompt + answer + the template's markers unless given; text prompts keep
    the feature default (the shipped heads' text runs were made with it)."""
    from dynvocab.cli.train_draft import DISTILL_ROOM, _max_tokens

    assert _max_tokens(None, True, "turn", 448) == 448 + DISTILL_ROOM
    assert _max_tokens(300, True, "turn", 448) == 300
    assert _max_tokens(None, True, "text", 448) is None and _max_tokens(None, False, "turn", 448) is None
