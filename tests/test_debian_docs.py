"""The shifted text of Debian's documentation: parsing, the fixed evaluation split, the bench's shifted tasks, the
corpora builders read, and each corpus group's share of a static set.

Most tests read a small FAQ written here in Debian's HTML layout (FAQ_DIR pointed at it); the last ones read the
installed packages (`.ci/run` installs them) and skip where Debian's FAQ is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import tiny_dirs  # noqa: F401  (fixture)

from dynvocab.bench.loop import shifted_tasks
from dynvocab.bench.loop.tasks import embedded_items
from dynvocab.builders import freq
from dynvocab.builders.corpus import CorpusConfig, iter_documents, iter_labelled_documents
from dynvocab.builders.counting import count_corpus
from dynvocab.data import debian_docs as docs
from dynvocab.data.debian_docs import Language
from dynvocab.errors import DynvocabError

SECTION = (
    '<div class="section"><div class="titlepage"><h2 class="title"><a id="s{n}"></a>{n}. {title}</h2></div>'
    "<p>\n{n} {body}\n</p><ul><li><p>{item}</p></li></ul><h3>sub heading, not text</h3><p>{tail}</p></div>"
)
BODIES = {
    "en": ("What is it?", "Debian is a free\noperating system " * 8, "an item", "the end."),
    "de": ("Was ist das?", "Debian ist ein freies\nBetriebssystem " * 8, "ein Punkt", "das Ende."),
    "ja": ("これは何ですか", "Debianは自由な\nオペレーティングシステムです。" * 8, "項目", "終わり。"),
    "ko": ("이것은 무엇인가요?", "데비안은 자유\n운영 체제입니다. " * 8, "항목", "끝."),
}


def _page(lang: str, numbers: list[str]) -> str:
    title, body, item, tail = BODIES[lang]
    toc = "".join(f'<div class="toc"><dt><span class="section"><a>{n}. {title}</a></span></dt></div>' for n in numbers)
    sections = "".join(SECTION.format(n=n, title=title, body=body, item=item, tail=tail) for n in numbers)
    return f"<html><body><h1>Chapter</h1>{toc}{sections}</body></html>"


NUMBERS = [f"{c}.{s}" for c in range(1, 4) for s in range(1, 13)]


@pytest.fixture
def faq(tmp_path, monkeypatch):
    """A FAQ of 36 sections in English, German, Japanese and Korean, laid out as Debian installs it."""
    for lang in BODIES:
        folder = tmp_path if lang == "en" else tmp_path / lang
        folder.mkdir(exist_ok=True)
        for k, chapter in enumerate(docs.CHAPTERS):
            numbers = [n for n in NUMBERS if int(n.split(".")[0]) == k + 1]
            (folder / f"{chapter}.{lang}.html").write_text(_page(lang, numbers), encoding="utf-8")
    monkeypatch.setattr(docs, "FAQ_DIR", tmp_path)
    monkeypatch.setattr(docs, "LANGUAGES", {lang: docs.LANGUAGES[lang] for lang in BODIES})
    monkeypatch.setattr(docs, "SHIFTED_LANGUAGES", ("de", "ja", "ko"))
    docs._all_sections.cache_clear()
    yield tmp_path
    docs._all_sections.cache_clear()


def test_sections_parse_and_split_the_same_way_in_every_language(faq):
    for lang in BODIES:
        sections = docs.faq_sections(lang, "eval") + docs.faq_sections(lang, "train")
        assert sorted(s.number for s in sections) == sorted(NUMBERS)
        assert all(s.title == BODIES[lang][0] for s in sections)
        assert all("sub heading" not in p for s in sections for p in s.paragraphs)  # subsection titles are no text
    evals = {lang: [s.number for s in docs.faq_sections(lang, "eval")] for lang in BODIES}
    assert evals["en"] == evals["de"] == evals["ja"] == evals["ko"]
    assert evals["en"] == [n for n in NUMBERS if docs.is_eval_key(n)]
    assert 0 < len(evals["en"]) < len(NUMBERS) / 2


def test_line_breaks_join_by_script(faq):
    de, ja, ko = (docs.faq_sections(lang, "train")[0].paragraphs[0] for lang in ("de", "ja", "ko"))
    assert "freies Betriebssystem" in de
    assert "自由なオペレーティングシステム" in ja  # Japanese puts no space between words
    assert "자유 운영" in ko  # Korean does
    assert docs.join_paragraphs(["see (https:", "//www.debian.org/) and", "more"]) == [
        "see (https://www.debian.org/) and more"
    ]


def test_passages_stop_near_the_script_limit():
    long_latin = ["A sentence that goes on. " * 60]
    cut = docs.cut_passage(long_latin, "Latin")
    assert docs.MIN_PASSAGE_CHARS["Latin"] <= len(cut) <= docs.PASSAGE_CHARS["Latin"] and cut.endswith(".")
    assert docs.cut_passage(["短い。", "二つ目。"], "CJK") == "短い。\n\n二つ目。"
    assert len(docs.cut_passage(["字" * 1000], "CJK")) <= docs.PASSAGE_CHARS["CJK"] + 2


def test_a_missing_language_names_its_package(faq, monkeypatch):
    monkeypatch.setattr(docs, "LANGUAGES", {**docs.LANGUAGES, "ru": Language("ru", "Russian", "Cyrillic", "debian-faq-ru", "", "")})
    with pytest.raises(DynvocabError, match="apt-get install debian-faq-ru"):
        docs.faq_sections("ru", "eval")
    with pytest.raises(DynvocabError, match="unknown language 'xx'"):
        docs.faq_path("xx")


def test_corpus_reads_the_training_split_only_in_every_installed_language(faq):
    rows = list(docs.corpus_rows(docs.CORPUS_NAME))
    assert {r["lang"] for r in rows} == set(BODIES)
    eval_text = {docs.explain_prompt(s) for lang in BODIES for s in docs.faq_sections(lang, "eval")}
    assert eval_text and not eval_text & {r["text"] for r in rows}
    assert [r["lang"] for r in rows[:4]] == ["en", "de", "ja", "ko"]  # interleaved: any prefix spans the languages
    labelled = list(iter_labelled_documents(CorpusConfig(sources=(docs.CORPUS_NAME,), max_docs=8)))
    assert [g for g, _ in labelled[:4]] == ["debian-faq:en", "debian-faq:de", "debian-faq:ja", "debian-faq:ko"]
    assert [t for _, t in labelled] == list(iter_documents(CorpusConfig(sources=(docs.CORPUS_NAME,), max_docs=8)))


def test_translation_corpus_asks_each_english_training_section_into_every_other_language(faq):
    rows = list(docs.corpus_rows(docs.TRANSLATION_CORPUS_NAME))
    others = [lang for lang in docs.LANGUAGES if lang in BODIES and lang != "en"]
    train = docs.faq_sections("en", "train")
    assert [r["lang"] for r in rows] == others * len(train)  # interleaved: any prefix spans the languages
    assert rows[0]["text"] == docs.translate_prompt(train[0], others[0])
    eval_passages = {s.passage() for s in docs.faq_sections("en", "eval")}
    assert eval_passages and not any(p in r["text"] for p in eval_passages for r in rows)


def test_shifted_tasks_read_the_evaluation_split_only(faq):
    items = embedded_items(["multilingual"], 3)
    assert {i.task for i in items} == {f"multilingual:{lang}" for lang in BODIES}
    for item in items:
        lang, number = item.id[len("faq-"):].rsplit("-", 1)
        assert docs.is_eval_key(number) and item.messages[0]["content"].startswith(docs.LANGUAGES[lang].explain)
    both = embedded_items(["translation:en-ja", "translation:ja-en"], 2)
    assert [i.task for i in both] == ["translation:en-ja"] * 2 + ["translation:ja-en"] * 2
    assert "into Japanese" in both[0].messages[0]["content"]
    assert both[2].messages[0]["content"].startswith(docs.LANGUAGES["ja"].to_english)
    with pytest.raises(DynvocabError, match="unknown task 'multilingual:xx'"):
        embedded_items(["multilingual:xx"], 1)
    assert embedded_items(["multilingual"], 8, ids=["faq-ko-" + items[0].id.rsplit("-", 1)[1]])[0].task == "multilingual:ko"


def test_lang_switch_changes_language_every_turn(faq, monkeypatch):
    monkeypatch.setattr(shifted_tasks, "SWITCH_ORDER", ("en", "de", "ja", "ko"))
    (item,) = embedded_items(["lang-switch"], 6)
    assert item.turns == 6 and item.labels == ("en", "de", "ja", "ko", "en", "de")
    assert item.followups[1].startswith(docs.LANGUAGES["ja"].explain)


def test_legal_paragraphs_split_and_prompt(tmp_path, monkeypatch):
    text = "\n\n".join(f"Clause {k}: " + "the licensee shall keep this notice " * 8 for k in range(40))
    (tmp_path / "GPL-3").write_text(text + "\n\nshort", encoding="utf-8")
    monkeypatch.setattr(docs, "LICENCE_DIR", tmp_path)
    evals, train = docs.licence_paragraphs("eval"), docs.licence_paragraphs("train")
    assert len(evals) + len(train) == 40 and evals and all(docs.is_eval_key(c.key) for c in evals)
    items = embedded_items(["legal"], 3)
    assert [i.id for i in items] == [f"lic-GPL-3-{c.index}" for c in evals[:3]]
    assert "GNU General Public License, version 3" in items[0].messages[0]["content"]
    rows = list(docs.corpus_rows(docs.LICENCE_CORPUS_NAME))
    assert {r["text"] for r in rows} == {docs.clause_prompt(c) for c in train}
    monkeypatch.setattr(docs, "LICENCE_DIR", tmp_path / "none")
    with pytest.raises(DynvocabError, match="base-files"):
        docs.licence_paragraphs("eval")


def test_counts_per_group_and_each_groups_share_of_the_static_set(tiny_dirs):  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dirs[0])
    pairs = [("a.txt", "the cat sat on the mat"), ("b.txt", "zebra quartz jumps"), ("a.txt", "the mat")]
    counts = count_corpus(pairs, tok, len(tok), bigrams=False, labelled=True, batch_docs=2)  # batches span groups
    assert set(counts.groups) == {"a.txt", "b.txt"}
    assert np.array_equal(sum(counts.groups.values()), counts.unigrams)
    only_a = count_corpus([t for g, t in pairs if g == "a.txt"], tok, len(tok), bigrams=False)
    assert np.array_equal(counts.groups["a.txt"], only_a.unigrams)
    plain = count_corpus([t for _, t in pairs], tok, len(tok), bigrams=False)
    assert np.array_equal(plain.unigrams, counts.unigrams) and plain.groups is None
    table = freq.build(freq.FreqConfig(), counts.unigrams, eos_ids=[])
    k = int((counts.groups["a.txt"] > 0).sum())  # a static set of exactly a.txt's ids (a.txt is the bigger)
    kept = table.ranking[:k].numpy()
    shares = freq.group_shares(kept, counts.groups)
    assert shares["a.txt"] > shares["b.txt"]
    assert shares["a.txt"] == pytest.approx(counts.groups["a.txt"][kept].sum() / counts.groups["a.txt"].sum())
    stats = freq.summary(freq.FreqConfig(share_sizes=(k,)), table, counts.groups)
    assert stats[f"top_{k}_share_by_group"] == shares


def _installed() -> bool:
    return all(docs.is_installed(lang) for lang in docs.LANGUAGES)


@pytest.mark.skipif(not _installed(), reason="Debian's FAQ packages are not installed (`.ci/run` installs them)")
def test_the_installed_faq_gives_every_language_enough_evaluation_prompts():
    docs._all_sections.cache_clear()
    scripts = set()
    for lang, language in docs.LANGUAGES.items():
        evals = docs.faq_sections(lang, "eval")
        assert len(evals) >= 8, lang
        scripts.add(language.script)
        for section in evals:
            passage = section.passage()
            assert docs.MIN_PASSAGE_CHARS[language.script] <= len(passage) <= docs.PASSAGE_CHARS[language.script] + 2
    assert scripts == {"Latin", "Cyrillic", "CJK", "Hangul"}
    assert len(docs.licence_paragraphs("eval")) >= 8
