"""Shifted text from Debian's documentation packages: the Debian FAQ in nine languages and the licence texts.

Every prompt dynvocab embedded before this was English chat or code, where a static FR-Spec table holds most of a
target's tokens. These sources give the other traffic a served model sees, offline, from Debian's registry:

* **The Debian FAQ** (packages ``debian-faq`` and ``debian-faq-{de,fr,it,ja,ko,pt,ru,zh-cn}``, GPL-2+): one book,
  the same ~110 numbered sections in English and eight translations over four scripts (Latin, Cyrillic, CJK,
  Hangul), read from the HTML build under ``/usr/share/doc/debian/FAQ/`` (its text build wraps Korean and
  Chinese lines mid-word, so a line break there cannot be read back as a space or none).
* **Licence texts** (``/usr/share/common-licenses``, package ``base-files``, on every Debian system; each text
  allows verbatim copies): legal prose, EvoSpec's specialised domain.

Nothing is copied into this project: the text is read where Debian installs it, and a missing package is named in
a one-line error with the ``apt-get install`` that fixes it.

**The evaluation split.** A FAQ section is evaluation text when the CRC-32 of its number (``"3.1"``) is ≡ 4 (mod
5), in every language alike, so a section and its translations are on one side; a licence paragraph when the
CRC-32 of ``"<file>:<paragraph index>"`` is (a fifth of each, so every language has
at least 8 evaluation sections). The bench's shifted tasks read :func:`faq_sections` and
:func:`licence_paragraphs` with ``split="eval"`` only; the corpora that builders and ``train-draft`` read
(:func:`corpus_rows`) take ``split="train"`` only, and no caller can ask them for the other.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import zlib
from dataclasses import dataclass
from functools import cache
from html.parser import HTMLParser
from pathlib import Path
from typing import Iterator

from dynvocab.errors import DynvocabError

FAQ_DIR = Path("/usr/share/doc/debian/FAQ")
LICENCE_DIR = Path("/usr/share/common-licenses")
CHAPTERS = ("basic-defs", "getting-debian", "choosing", "compatibility", "software", "ftparchives", "pkg-basics",
            "pkgtools", "uptodate", "kernel", "customizing", "support", "contributing", "redistributing",
            "nextrelease", "faqinfo")  # the book's chapters in order (their HTML pages' names)
EVAL_EVERY = 5  # a fifth: ~22 of the FAQ's ~110 sections, so every language has at least 8 evaluation prompts
EVAL_REMAINDER = 4
CORPUS_NAME = "debian-faq"  # the build-index / train-draft corpus of the training split, every language
TRANSLATION_CORPUS_NAME = "debian-faq-translate"  # the training split's English sections, into each other language
LICENCE_CORPUS_NAME = "licences"
CORPORA = (CORPUS_NAME, TRANSLATION_CORPUS_NAME, LICENCE_CORPUS_NAME)


@dataclass(frozen=True)
class Language:
    """One language of the FAQ: its code, English name, script, and the instructions a prompt in it opens with."""

    code: str
    name: str
    script: str
    package: str
    explain: str  # asks for the section's main points, answered in this language
    to_english: str  # asks for a translation of the text into English


LANGUAGES: dict[str, Language] = {
    lang.code: lang
    for lang in (
        Language("en", "English", "Latin", "debian-faq",
                 "Read this section of the Debian FAQ, then explain its main points in a few sentences, in English.",
                 "Rewrite the following text in plain English. Reply with the rewritten text only."),
        Language("de", "German", "Latin", "debian-faq-de",
                 "Lies diesen Abschnitt der Debian-FAQ und erkläre seine wichtigsten Punkte in einigen Sätzen auf Deutsch.",
                 "Übersetze den folgenden Text ins Englische. Antworte nur mit der Übersetzung."),
        Language("fr", "French", "Latin", "debian-faq-fr",
                 "Lis cette section de la FAQ Debian, puis explique ses points principaux en quelques phrases, en français.",
                 "Traduis le texte suivant en anglais. Réponds uniquement avec la traduction."),
        Language("it", "Italian", "Latin", "debian-faq-it",
                 "Leggi questa sezione delle FAQ di Debian e spiega i suoi punti principali in alcune frasi, in italiano.",
                 "Traduci il seguente testo in inglese. Rispondi solo con la traduzione."),
        Language("pt", "Portuguese", "Latin", "debian-faq-pt",
                 "Leia esta seção do FAQ do Debian e explique os pontos principais em algumas frases, em português.",
                 "Traduza o texto a seguir para o inglês. Responda apenas com a tradução."),
        Language("ru", "Russian", "Cyrillic", "debian-faq-ru",
                 "Прочитай этот раздел FAQ по Debian и объясни его главные мысли в нескольких предложениях на русском языке.",
                 "Переведи следующий текст на английский язык. Ответь только переводом."),
        Language("ja", "Japanese", "CJK", "debian-faq-ja",
                 "Debian FAQのこの節を読んで、要点を日本語で数文にまとめて説明してください。",
                 "次の文章を英語に翻訳してください。翻訳だけを答えてください。"),
        Language("zh-cn", "Chinese", "CJK", "debian-faq-zh-cn",
                 "阅读 Debian FAQ 的这一节，然后用中文以几句话解释它的要点。",
                 "把下面的文字翻译成英文。只回答译文。"),
        Language("ko", "Korean", "Hangul", "debian-faq-ko",
                 "Debian FAQ의 이 절을 읽고 핵심 내용을 한국어로 몇 문장으로 설명해 주세요.",
                 "다음 글을 영어로 번역해 주세요. 번역문만 답해 주세요."),
    )
}
SHIFTED_LANGUAGES = tuple(code for code in LANGUAGES if code != "en")
TRANSLATE_FROM_ENGLISH = "Translate the following text into {name}. Reply with the translation only."
EXPLAIN_CLAUSE = "Explain in plain English what this part of the {name} says and what it requires of a user."
LICENCES = {  # file -> the name a prompt gives it
    "GPL-3": "GNU General Public License, version 3",
    "GPL-2": "GNU General Public License, version 2",
    "LGPL-3": "GNU Lesser General Public License, version 3",
    "LGPL-2.1": "GNU Lesser General Public License, version 2.1",
    "Apache-2.0": "Apache License, version 2.0",
    "MPL-2.0": "Mozilla Public License, version 2.0",
    "GFDL-1.3": "GNU Free Documentation License, version 1.3",
    "Artistic": "Artistic License",
    "CC0-1.0": "Creative Commons CC0 1.0 Universal",
}
PASSAGE_CHARS = {"Latin": 700, "Cyrillic": 700, "CJK": 300, "Hangul": 350}  # ~150-250 target tokens each
MIN_PASSAGE_CHARS = {"Latin": 200, "Cyrillic": 200, "CJK": 80, "Hangul": 90}
_UNSPACED = re.compile(r"[\u2e80-\u9fff\uf900-\ufaff\uff00-\uffef]")  # Han, kana, CJK punctuation: no spaces
_URL_TAIL = re.compile(r"\(?https?:(//[^\s)]*)?$")  # a link the text build wrapped mid-way


@dataclass(frozen=True)
class Section:
    """A numbered FAQ section in one language: ``number`` as ``"3.1"``, its title and its body paragraphs."""

    lang: str
    number: str
    title: str
    paragraphs: tuple[str, ...]

    def passage(self) -> str:
        """The section's opening paragraphs, cut at a sentence end near the language's passage length."""
        return cut_passage(self.paragraphs, LANGUAGES[self.lang].script)


def is_eval_key(key: str) -> bool:
    """Whether a section number or licence paragraph key is in the evaluation split (CRC-32 ≡ 4 mod 5)."""
    return zlib.crc32(key.encode("utf-8")) % EVAL_EVERY == EVAL_REMAINDER


def install_hint(packages: list[str] | tuple[str, ...]) -> str:
    """The command that installs Debian packages."""
    return "apt-get install " + " ".join(packages)


def faq_path(lang: str, chapter: str = "basic-defs") -> Path:
    """Where Debian installs a chapter of the FAQ's HTML build in ``lang``; a one-line error if that package is
    missing."""
    if lang not in LANGUAGES:
        raise DynvocabError(f"unknown language '{lang}'; use one of {', '.join(LANGUAGES)}")
    path = FAQ_DIR / f"{chapter}.en.html" if lang == "en" else FAQ_DIR / lang / f"{chapter}.{lang}.html"
    if not path.is_file():
        raise DynvocabError(
            f"the Debian FAQ in {LANGUAGES[lang].name} is not installed ({path}); run "
            f"`{install_hint([LANGUAGES[lang].package])}` (or all of them: `{install_hint(all_packages())}`)"
        )
    return path


def is_installed(lang: str) -> bool:
    """Whether the FAQ in ``lang`` is installed."""
    try:
        faq_path(lang)
    except DynvocabError:
        return False
    return True


def all_packages() -> list[str]:
    """Every Debian package the shifted tasks and corpora read (the licences ship with base-files)."""
    return [lang.package for lang in LANGUAGES.values()]


def faq_sections(lang: str, split: str) -> list[Section]:
    """The numbered sections of the FAQ in ``lang`` of one split (``"eval"`` or ``"train"``), in book order; a
    section whose passage is too short to prompt with is left out."""
    if split not in ("eval", "train"):
        raise ValueError(f"split must be 'eval' or 'train', not {split!r}")
    want_eval = split == "eval"
    script = LANGUAGES[lang].script
    return [
        s for s in _all_sections(lang)
        if is_eval_key(s.number) == want_eval and len(s.passage()) >= MIN_PASSAGE_CHARS[script]
    ]


@cache
def _all_sections(lang: str) -> tuple[Section, ...]:
    out: list[Section] = []
    for chapter in CHAPTERS:
        parser = _FaqPage(lang)
        parser.feed(faq_path(lang, chapter).read_text(encoding="utf-8"))
        parser.close()
        out += parser.sections
    return tuple(out)


class _FaqPage(HTMLParser):
    """The ``N.M`` sections of one chapter page of Debian's HTML build: each ``<h2>`` title opens a section, and
    its paragraphs are the text of the ``<p>``, ``<li>`` and ``<pre>`` blocks up to the next ``<h2>`` (subsection
    titles and the table of contents left out)."""

    _BLOCKS = {"p", "li", "pre", "dd", "td"}
    _TITLES = {"h1", "h3", "h4", "dt"}

    def __init__(self, lang: str):
        super().__init__(convert_charrefs=True)
        self.lang = lang
        self.sections: list[Section] = []
        self._title: list[str] | None = None  # inside an <h2>: its text so far
        self._number = ""
        self._heading = ""
        self._paragraphs: list[str] = []
        self._block: list[str] | None = None
        self._depth = 0  # open block elements (a <p> inside an <li> is one block)
        self._skip = 0  # open title elements, whose text is no paragraph

    def handle_starttag(self, tag, attrs):
        if tag == "h2":
            self._flush()
            self._title = []
        elif tag in self._TITLES:
            self._skip += 1
        elif tag in self._BLOCKS:
            if self._depth == 0:
                self._block = []
            self._depth += 1

    def handle_endtag(self, tag):
        if tag == "h2" and self._title is not None:
            heading = re.match(r"(\d+)\.(\d+)\.?\s+(.*)", " ".join("".join(self._title).split()), re.S)
            self._number, self._heading = (f"{heading[1]}.{heading[2]}", heading[3]) if heading else ("", "")
            self._title = None
        elif tag in self._TITLES:
            self._skip = max(0, self._skip - 1)
        elif tag in self._BLOCKS and self._depth:
            self._depth -= 1
            if self._depth == 0 and self._block is not None:
                text = join_paragraphs("".join(self._block).splitlines())
                if text and self._number:
                    self._paragraphs.append(" ".join(text))
                self._block = None

    def handle_data(self, data):
        if self._title is not None:
            self._title.append(data)
        elif self._block is not None and not self._skip:
            self._block.append(data)

    def close(self):
        """Finish the page: its last section is kept too."""
        super().close()
        self._flush()

    def _flush(self):
        if self._number and self._paragraphs:
            self.sections.append(Section(self.lang, self._number, self._heading, tuple(self._paragraphs)))
        self._number, self._paragraphs = "", []


def join_paragraphs(lines: list[str]) -> list[str]:
    """Blank-line separated paragraphs of wrapped, indented lines, each on one line; a line break between two Han
    or kana characters joins without a space (Chinese and Japanese put none between words; Korean does), and so
    does one inside a link."""
    out, cur = [], ""
    for raw in lines + [""]:
        line = raw.replace("\u00a0", " ").strip()
        if not line:
            if cur:
                out.append(cur)
            cur = ""
            continue
        if line.startswith("* ") and cur:
            out.append(cur)
            cur = ""
        glue = " "
        if cur and ((_UNSPACED.match(cur[-1]) and _UNSPACED.match(line[0])) or _URL_TAIL.search(cur)):
            glue = ""
        cur = f"{cur}{glue}{line}" if cur else line
    return out


def cut_passage(paragraphs: tuple[str, ...] | list[str], script: str) -> str:
    """Whole paragraphs up to the script's passage length; past it, the paragraph that crosses the limit is cut at
    its last sentence end before the limit (or at the limit)."""
    limit = PASSAGE_CHARS[script]
    text = ""
    for para in paragraphs:
        joined = f"{text}\n\n{para}" if text else para
        if len(joined) <= limit:
            text = joined
            continue
        if len(text) >= MIN_PASSAGE_CHARS[script]:
            break
        head = joined[:limit]
        ends = [m.end() for m in re.finditer(r"[.!?。！？](\s|$)|[。！？]", head)]
        text = head[: ends[-1]].rstrip() if ends and ends[-1] > len(text) + 1 else head.rstrip() + " …"
        break
    return text


def explain_prompt(section: Section) -> str:
    """The multilingual task's user turn: explain a FAQ section, in the section's own language."""
    return f"{LANGUAGES[section.lang].explain}\n\n{section.passage()}"


def translate_prompt(section: Section, into: str) -> str:
    """The translation task's user turn: ``section`` (English, or another language) into ``into`` (English, or
    another language; one side is English)."""
    if into == "en":
        return f"{LANGUAGES[section.lang].to_english}\n\n{section.passage()}"
    return f"{TRANSLATE_FROM_ENGLISH.format(name=LANGUAGES[into].name)}\n\n{section.passage()}"


@dataclass(frozen=True)
class Clause:
    """One paragraph of a licence text: its file, its index among the file's kept paragraphs, and its text."""

    licence: str
    index: int
    text: str

    @property
    def key(self) -> str:
        """The split key: ``"<file>:<index>"``."""
        return f"{self.licence}:{self.index}"


def licence_paragraphs(split: str) -> list[Clause]:
    """Paragraphs of at least 200 characters of the licence texts under ``/usr/share/common-licenses``, one split."""
    if split not in ("eval", "train"):
        raise ValueError(f"split must be 'eval' or 'train', not {split!r}")
    missing = [name for name in LICENCES if not (LICENCE_DIR / name).is_file()]
    if len(missing) == len(LICENCES):
        raise DynvocabError(f"no licence texts under {LICENCE_DIR}; run `{install_hint(['base-files'])}`")
    out = []
    for name in LICENCES:
        if name in missing:
            continue
        paragraphs = join_paragraphs((LICENCE_DIR / name).read_text(encoding="utf-8", errors="replace").splitlines())
        kept = [p for p in paragraphs if len(p) >= 200]
        out += [Clause(name, k, text[:PASSAGE_CHARS["Latin"]]) for k, text in enumerate(kept)]
    return [c for c in out if is_eval_key(c.key) == (split == "eval")]


def clause_prompt(clause: Clause) -> str:
    """The legal task's user turn: explain a licence paragraph in plain English."""
    return f"{EXPLAIN_CLAUSE.format(name=LICENCES[clause.licence])}\n\n{clause.text}"


def corpus_rows(name: str) -> Iterator[dict]:
    """The training split as corpus rows ``{"text": prompt, "lang": code}``: ``debian-faq`` the FAQ's sections in
    every installed language, interleaved (one section of each language in turn); ``debian-faq-translate`` each
    English section asked into every other installed language in turn (``lang`` is the language asked for);
    ``licences`` the licence paragraphs. Each row is a prompt as the bench's tasks write them, so ``train-draft
    --self-distill`` has the target answer the same kind of request."""
    if name == LICENCE_CORPUS_NAME:
        yield from ({"text": clause_prompt(c), "lang": "en"} for c in licence_paragraphs("train"))
        return
    installed = [code for code in LANGUAGES if is_installed(code)]
    if not installed:
        faq_path("en")  # raises the install hint
    if name == TRANSLATION_CORPUS_NAME:
        others = [code for code in installed if code != "en"]
        yield from ({"text": translate_prompt(s, code), "lang": code}
                    for s in faq_sections("en", "train") for code in others)
        return
    queues = [[{"text": explain_prompt(s), "lang": code} for s in faq_sections(code, "train")] for code in installed]
    yield from interleave(queues)


def interleave(queues: list[list]) -> Iterator:
    """One item of each queue in turn, skipping queues that ran out (so any prefix spans every queue)."""
    for row in itertools.zip_longest(*queues):
        yield from (item for item in row if item is not None)


def describe(name: str) -> dict:
    """What a corpus's rows depend on, for manifests: the split rule and the Debian packages' versions."""
    packages = ["base-files"] if name == LICENCE_CORPUS_NAME else all_packages()
    return {"split": f"train (CRC-32 of the key not ≡ {EVAL_REMAINDER} mod {EVAL_EVERY})",
            "packages": package_versions(packages)}


def package_versions(packages: list[str]) -> dict[str, str | None]:
    """Installed version of each Debian package (None where it is not installed or dpkg is absent)."""
    out: dict[str, str | None] = {}
    for pkg in packages:
        try:
            res = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True, timeout=10)
            out[pkg] = res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            out[pkg] = None
    return out
