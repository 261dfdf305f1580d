"""The bench's shifted tasks: traffic a static English-built table serves worst, from Debian's documentation.

Every item reads the **evaluation split** of :mod:`dynvocab.data.debian_docs` only (the Debian FAQ in English and
eight translations, and the licence texts), which no builder or training run reads.

* ``multilingual`` — explain a FAQ section in its own language; one task per language (``multilingual:de``, …,
  ``multilingual:en`` the English control), items ``faq-<lang>-<section>``.
* ``translation`` — a FAQ section from English into each language (``translation:en-de``) and back
  (``translation:de-en``), items ``tr-<from>-<to>-<section>``.
* ``lang-switch`` — one conversation whose user turns change language each turn (English, German, Russian,
  Japanese, Korean, Chinese, French, Italian, Portuguese, …), replayed like ``topic-switch``; each row's segment
  is its language.
* ``legal`` — explain a paragraph of a licence text (GPL, Apache, MPL, …) in plain English: a specialised domain.
* ``code-legal`` — EvoSpec's topic-switching stream: N HumanEval prompts, then N licence paragraphs, in one
  conversation.

``--tasks multilingual`` runs every language; ``--tasks multilingual:ru,translation:ja-en`` picks; ``--num-prompts``
counts per language (or direction). They need Debian's FAQ packages: a missing one is named with the
``apt-get install`` line.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

from dynvocab.bench.loop.items import BenchItem, user_turn
from dynvocab.data import debian_docs as docs
from dynvocab.errors import DynvocabError

SHIFTED_TASKS = ("multilingual", "translation", "lang-switch", "legal", "code-legal")
SWITCH_ORDER = ("en", "de", "ru", "ja", "ko", "zh-cn", "fr", "it", "pt")  # each script in the first five turns
LANG_SWITCH_ID = "lang-switch"
CODE_LEGAL_ID = "code-legal"


def is_shifted(task: str) -> bool:
    """Whether ``task`` (``multilingual`` or ``multilingual:de``, …) is one of these tasks."""
    return task.split(":", 1)[0] in SHIFTED_TASKS


def expand(task: str) -> list[str]:
    """The per-language tasks a name stands for: ``multilingual`` -> every ``multilingual:<lang>``; a named
    language or direction is checked and kept."""
    base, _, sub = task.partition(":")
    every = {
        "multilingual": [f"multilingual:{lang}" for lang in docs.LANGUAGES],
        "translation": [f"translation:{a}-{b}" for lang in docs.SHIFTED_LANGUAGES for a, b in (("en", lang), (lang, "en"))],
    }.get(base, [base])
    if not sub:
        return every
    if task not in every:
        raise DynvocabError(f"unknown task '{task}'; use one of {', '.join(every)}")
    return [task]


def items(task: str, n: int, code_prompts: Callable[[], Iterator[tuple[str, str]]]) -> Iterator[BenchItem]:
    """The items of one expanded task (``multilingual:de``, ``translation:en-ja``, ``legal``, …).

    ``code_prompts`` gives the HumanEval prompts of ``code-legal`` (the ``code`` task's source)."""
    base, _, sub = task.partition(":")
    if base == "multilingual":
        return (BenchItem(f"faq-{sub}-{s.number}", task, (user_turn(docs.explain_prompt(s)),))
                for s in docs.faq_sections(sub, "eval"))
    if base == "translation":
        src = next(code for code in docs.LANGUAGES if sub.startswith(f"{code}-"))  # codes hold "-" (zh-cn)
        dst = sub[len(src) + 1 :]
        return (BenchItem(f"tr-{src}-{dst}-{s.number}", task, (user_turn(docs.translate_prompt(s, dst)),))
                for s in docs.faq_sections(src, "eval"))
    if base == "legal":
        return (BenchItem(f"lic-{c.licence}-{c.index}", task, (user_turn(docs.clause_prompt(c)),))
                for c in _interleaved_clauses())
    if base == "lang-switch":
        return iter([lang_switch_item(n)])
    return iter([code_legal_item(n, code_prompts)])


def lang_switch_item(n: int) -> BenchItem:
    """One conversation of ``max(n, 9)`` user turns, the k-th in language ``SWITCH_ORDER[k % 9]`` (its next
    evaluation section each time round)."""
    sections = {lang: docs.faq_sections(lang, "eval") for lang in SWITCH_ORDER}
    turns, labels = [], []
    for k in range(max(n, len(SWITCH_ORDER))):
        lang = SWITCH_ORDER[k % len(SWITCH_ORDER)]
        turns.append(docs.explain_prompt(sections[lang][(k // len(SWITCH_ORDER)) % len(sections[lang])]))
        labels.append(lang)
    return BenchItem.conversation(LANG_SWITCH_ID, "lang-switch", turns, tuple(labels))


def code_legal_item(n: int, code_prompts: Callable[[], Iterator[tuple[str, str]]]) -> BenchItem:
    """One conversation: ``n`` HumanEval prompts (from the end of the set), then ``n`` licence paragraphs."""
    code = [text for _, text in itertools.islice(reversed(list(code_prompts())), n)]
    legal = [docs.clause_prompt(c) for c in itertools.islice(_interleaved_clauses(), n)]
    labels = ("code",) * len(code) + ("legal",) * len(legal)
    return BenchItem.conversation(CODE_LEGAL_ID, "code-legal", code + legal, labels)


def may_hold(task: str, item_id: str) -> bool:
    """Whether an id of this form can belong to the expanded ``task``."""
    base, _, sub = task.partition(":")
    prefix = {"multilingual": f"faq-{sub}-", "translation": f"tr-{sub}-", "legal": "lic-"}.get(base)
    return item_id.startswith(prefix) if prefix else item_id == base


def _interleaved_clauses() -> Iterator[docs.Clause]:
    """Evaluation paragraphs, one licence after another in turn (so the first few span several licences)."""
    by_licence: dict[str, list[docs.Clause]] = {}
    for clause in docs.licence_paragraphs("eval"):
        by_licence.setdefault(clause.licence, []).append(clause)
    return docs.interleave(list(by_licence.values()))
