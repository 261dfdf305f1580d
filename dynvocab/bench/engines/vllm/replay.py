"""Replayed conversations for the vLLM rows: every turn of a conversation a request of its own, after plain vLLM's
answers to the turns before it.

The loop replays each turn after ``ar``'s answers (:func:`dynvocab.bench.loop.runner.run_bench`). Every greedy vLLM
row answers as plain vLLM does (the bench checks it: ``= vllm``), so turn ``t``'s history is plain vLLM's answers
to turns ``1 … t-1``, written turn by turn (one plain engine per turn beyond the first, every conversation's turn in
one call), trimmed as the loop trims it (:meth:`~dynvocab.bench.loop.items.BenchItem.context`). The rows then run
every turn's prompt: the same prompts for every row, so their figures compare.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dynvocab.bench.loop.items import HISTORY_CHARS, BenchItem


@dataclass(frozen=True)
class Turn:
    """One request of the vLLM rows: 0-based ``turn`` of ``item``, encoded as ``prompt``."""

    item: BenchItem
    turn: int
    prompt: list[int]

    @property
    def id(self) -> str:
        """The generation id: the item's, or ``<id>/t<turn+1>`` for a replayed conversation."""
        return self.item.row_id(self.turn)

    @property
    def task(self) -> str:
        """The item's task."""
        return self.item.task

    @property
    def segment(self) -> str | None:
        """The label of this turn's segment (:meth:`~dynvocab.bench.loop.items.BenchItem.segment`)."""
        return self.item.segment(self.turn)


def replay_turns(
    items: list[BenchItem],
    encode: Callable[[list[dict]], list[int]],
    answer: Callable[[list[list[int]]], list[list[int]]],
    decode: Callable[[list[int]], str],
    history_chars: int = HISTORY_CHARS,
    log: Callable[[str], None] = print,
) -> list[Turn]:
    """Every turn of ``items`` (item by item, turns in order) with its prompt. ``encode`` makes a prompt of
    messages, ``answer`` writes the answers to a list of prompts (one call per turn that a later turn follows),
    ``decode`` makes an answer text to replay (as the loop decodes it)."""
    turns = [[Turn(item, 0, encode(item.context(0, [], history_chars)))] for item in items]
    answers: list[list[str]] = [[] for _ in items]
    for t in range(1, max(item.turns for item in items)):
        going = [i for i, item in enumerate(items) if item.turns > t]
        log(f"replaying turn {t + 1} of {len(going)} conversation(s) after plain vLLM's answers to turn {t}")
        for i, ids in zip(going, answer([turns[i][t - 1].prompt for i in going])):
            answers[i].append(decode(ids))
            turns[i].append(Turn(items[i], t, encode(items[i].context(t, answers[i], history_chars))))
    return [turn for item_turns in turns for turn in item_turns]
