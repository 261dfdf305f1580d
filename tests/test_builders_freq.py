"""Corpus readers, the counting pass and the freq stage."""

from __future__ import annotations

import io
import itertools
import json
from collections import Counter

import numpy as np
import pytest
from tiny_models import corpus_jsonl, sentences, tiny_dirs  # noqa: F401  (fixtures)

from dynvocab.builders import corpus as corpus_mod
from dynvocab.builders import freq
from dynvocab.builders.corpus import CorpusConfig, iter_documents
from dynvocab.builders.counting import BigramCounter, count_corpus
from dynvocab.data import is_eval_position, iter_json_array, sharegpt_records, to_messages
from dynvocab.errors import DynvocabError


@pytest.fixture(scope="module")
def tokenizer(tiny_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dirs[0])


def test_json_array_walk_drops_the_cut_off_record():
    text = json.dumps([{"id": i, "v": "x" * i} for i in range(50)])
    cut = text[: text.rindex('{"id": 49') + 12]  # ends mid-record, like the ShareGPT file
    got = list(iter_json_array(io.StringIO(cut), chunk_chars=64))  # tiny chunks: records span reads
    assert [r["id"] for r in got] == list(range(49))
    assert [r["id"] for r in iter_json_array(io.StringIO(text), chunk_chars=7)] == list(range(50))


def test_sharegpt_split_positions():
    first = list(itertools.islice(sharegpt_records(), 30))
    assert [i for i, _ in first] == list(range(30))
    assert [i for i, _ in first if is_eval_position(i)] == [9, 19, 29]
    messages = to_messages(first[0][1])
    assert messages and messages[0]["role"] == "user"


def test_sharegpt_corpus_skips_the_eval_split(monkeypatch):
    records = [(i, {"conversations": [{"from": "human", "value": f"doc {i}"}]}) for i in range(25)]
    monkeypatch.setattr("dynvocab.data.sharegpt.sharegpt_records", lambda: iter(records))
    docs = list(iter_documents(CorpusConfig(sources=("sharegpt",))))
    assert docs == [f"doc {i}" for i in range(25) if i % 10 != 9]
    assert len(list(iter_documents(CorpusConfig(sources=("sharegpt",), max_docs=4)))) == 4


def test_slimpajama_format_through_datasets_streaming(corpus_jsonl):  # noqa: F811
    rows = [json.loads(line) for line in corpus_jsonl.read_text().splitlines()]
    assert set(rows[0]) == {"text", "meta"}
    cfg = CorpusConfig(sources=("slimpajama",), slimpajama_id=str(corpus_jsonl), max_docs=50)
    docs = list(iter_documents(cfg))
    assert docs == [r["text"] for r in rows[:50]]
    assert list(iter_documents(CorpusConfig(sources=(str(corpus_jsonl),), max_docs=50))) == docs


def test_slimpajama_without_hub_is_one_line(monkeypatch):
    monkeypatch.setattr(corpus_mod, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(DynvocabError, match="cannot reach the Hugging Face hub") as exc:
        next(iter_documents(CorpusConfig(sources=("slimpajama",))))
    assert "\n" not in str(exc.value)


def test_local_formats(tmp_path):
    import datasets

    txt = tmp_path / "a.txt"
    txt.write_text("first line\n\nsecond line\n")
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}) + "\n")
    ds = datasets.Dataset.from_dict({"text": ["p1", "p2"]})
    ds.to_parquet(str(tmp_path / "b.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    sources = (str(txt), str(chat), str(tmp_path / "b.parquet"), str(tmp_path / "saved"))
    assert list(iter_documents(CorpusConfig(sources=sources))) == ["first line", "second line", "hi\n\nyo", "p1", "p2", "p1", "p2"]


@pytest.mark.parametrize(
    "source, message",
    [("missing.jsonl", "does not exist"), ("x.csv", "unknown type")],
)
def test_bad_sources(tmp_path, source, message):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DynvocabError, match=message):
        iter_documents(CorpusConfig(sources=(str(tmp_path / source),)))


def test_sharegpt_documents_are_chat_template_encoded(monkeypatch, tmp_path):
    from tiny_models import make_tokenizer

    tokenizer = make_tokenizer(tmp_path)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    )
    turns = [{"from": "human", "value": "the model"}, {"from": "gpt", "value": "a draft " * 50}]
    records = [{"conversations": turns}] * 5
    monkeypatch.setattr(corpus_mod, "sharegpt_train", lambda: iter(records))
    docs = list(corpus_mod.encode_documents(CorpusConfig(sources=("sharegpt",), max_docs=3), tokenizer, 16))
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert len(docs) == 3 and all(len(d) == 16 and d[0] == start for d in docs)


def test_bigram_counter_matches_a_plain_count():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 7, size=rng.integers(0, 40)) for _ in range(60)]
    counter = BigramCounter(vocab=7, flush_at=50)  # many compactions
    expected = Counter()
    for d in docs:
        counter.add(d)
        expected.update(zip(d[:-1].tolist(), d[1:].tolist()))
    keys, counts = counter.result()
    assert np.all(np.diff(keys) > 0)
    assert {(int(k) // 7, int(k) % 7): int(c) for k, c in zip(keys, counts)} == dict(expected)


def test_count_corpus_counts_every_token(tokenizer):
    docs = sentences(40, seed=3)
    rows = len(tokenizer) + 20
    counts = count_corpus(docs, tokenizer, rows, bigrams=True, batch_docs=7)
    ids = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]
    assert counts.docs == 40 and counts.tokens == sum(map(len, ids))
    assert np.array_equal(counts.unigrams, np.bincount(np.concatenate(ids), minlength=rows))
    bigrams = sum(len(i) - 1 for i in ids)  # never across documents
    assert int(counts.bigram_counts.sum()) == bigrams


def test_count_corpus_refuses_foreign_ids(tokenizer):
    with pytest.raises(DynvocabError, match="outside the LM head"):
        count_corpus(["hello there"], tokenizer, vocab_rows=5, bigrams=False)


def test_freq_ranking_puts_end_tokens_first():
    counts = np.array([3, 10, 0, 10, 7, 0], dtype=np.int64)
    table = freq.build(freq.FreqConfig(), counts, eos_ids=[5, 2, 99])  # 99: outside the vocabulary
    assert table.eos_ids.tolist() == [2, 5]
    assert table.ranking.tolist() == [2, 5, 1, 3, 4, 0]  # then count desc, ties by id
    assert table.top_k_share(3) == pytest.approx(10 / 30)
    assert sorted(table.ranking.tolist()) == list(range(6))
    stats = freq.summary(freq.FreqConfig(share_sizes=(4,)), table)
    assert stats["coverage"] == {"4": pytest.approx(20 / 30, abs=1e-6)} and stats["distinct_tokens"] == 4
