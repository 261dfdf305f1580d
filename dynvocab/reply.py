"""A reply as the Python API hands it out: :class:`Reply` (the generation, iterated cycle by cycle),
:class:`GenerationResult` (what it produced) and :class:`TextStream` (its text, piece by piece).

:meth:`dynvocab.api.Pair.start` returns a :class:`Reply`; :meth:`~dynvocab.api.Pair.generate` runs one to the end,
:meth:`~dynvocab.api.Pair.stream` turns one into text pieces, and ``dynvocab generate`` prints one as it comes.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynvocab.errors import DynvocabError
from dynvocab.runtime.decoding.loop import Decoding
from dynvocab.runtime.decoding.metrics import Metrics


@dataclass(frozen=True)
class GenerationResult:
    """One generation: the new ``text`` and ``token_ids``, the ``strategy`` that ran, its :class:`Metrics`, and
    whether an end-of-sequence token stopped it."""

    text: str
    token_ids: list[int]
    strategy: str
    metrics: Metrics
    stopped_by_eos: bool = False

    def as_dict(self) -> dict:
        """What ``dynvocab generate --json`` prints: text, token_ids, strategy, metrics."""
        return {"text": self.text, "token_ids": self.token_ids, "strategy": self.strategy,
                "metrics": self.metrics.as_dict()}


class Reply:
    """A generation that runs as it is iterated: each step runs one draft-verify cycle and yields the token ids it
    committed. Nothing runs before the first step, and nothing runs on another thread.

    :attr:`result` is the :class:`GenerationResult` once the reply has ended: iterated to the end, or closed early
    with ``close()`` (which stops after the cycle in flight; the result then holds the tokens so far, with their
    metrics).
    """

    def __init__(self, decoding: Decoding, tokenizer, strategy: str):
        self.decoding = decoding
        self.tokenizer = tokenizer
        self.strategy = strategy

    def __iter__(self) -> Reply:
        return self

    def __next__(self) -> list[int]:
        return next(self.decoding)

    def close(self) -> None:
        """Run no further cycle (idempotent); :attr:`result` then holds what was generated so far."""
        self.decoding.close()

    @property
    def result(self) -> GenerationResult:
        """What the reply generated, once it has ended (iterated to the end or closed)."""
        g = self.decoding.generation
        if g is None:
            raise DynvocabError("the reply is still running; iterate it to the end or close() it first")
        text = self.tokenizer.decode(g.token_ids, skip_special_tokens=True)
        return GenerationResult(text, g.token_ids, self.strategy, g.metrics, g.stopped_by_eos)


class TextStream:
    """The text of a growing list of token ids, handed out piece by piece: ``push(ids)`` returns the new text
    since the last piece (empty while the text ends in a split character), ``tail(text, final=True)`` the rest of
    the finished text.
    Shared by :meth:`~dynvocab.api.Pair.stream` and ``dynvocab generate``'s streamed output."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def push(self, new: list[int]) -> str:
        """Add ``new`` ids; the text they complete (possibly empty)."""
        self.ids.extend(new)
        return self.tail(self.text())

    def text(self) -> str:
        """The whole text of the ids so far."""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def tail(self, text: str, final: bool = False) -> str:
        """What ``text`` adds to the pieces handed out so far: empty when it does not continue them, or — unless
        ``final`` — ends in a split character."""
        if not text.startswith(self.shown) or (text.endswith("\ufffd") and not final):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece
