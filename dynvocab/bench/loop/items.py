"""What the bench replays: a conversation to generate after (:class:`BenchItem`), and the limits on its turns.

Every user turn is cut to :data:`MAX_CHARS` characters (prefill is CPU-bound here), and a replayed history is
trimmed from its oldest turns to :data:`HISTORY_CHARS` characters.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CHARS = 1500  # a user turn longer than this is cut (and marked with " …")
HISTORY_CHARS = 6000  # a replayed conversation keeps its newest turns within this many characters


@dataclass(frozen=True)
class BenchItem:
    """A conversation to bench: one generation after ``messages``, then one per follow-up user turn.

    Follow-up turns are replayed with an answer fed back before each (the caller chooses whose answer).
    ``labels`` names the segment of each turn (topic-switch: ``code`` / ``chat``); empty when not used.
    """

    id: str
    task: str
    messages: tuple[dict, ...]
    followups: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()

    @classmethod
    def conversation(cls, item_id: str, task: str, turns: list[str], labels: tuple[str, ...]) -> BenchItem:
        """A conversation replayed turn by turn: the first user turn, then ``turns[1:]`` as follow-ups (each cut to
        :data:`MAX_CHARS`), ``labels`` naming each turn's segment."""
        return cls(item_id, task, (user_turn(turns[0]),), tuple(clip(t) for t in turns[1:]), tuple(labels))

    @property
    def turns(self) -> int:
        """Generations this item produces."""
        return 1 + len(self.followups)

    def row_id(self, turn: int) -> str:
        """The generation id of 0-based ``turn``: the item id, or ``<id>/t<turn+1>`` for a replayed conversation."""
        return self.id if not self.followups else f"{self.id}/t{turn + 1}"

    def segment(self, turn: int) -> str | None:
        """The label of 0-based ``turn``'s segment (``lang-switch``: its language), or None where none are named."""
        return self.labels[turn] if self.labels else None

    def context(self, turn: int, answers: list[str], history_chars: int = HISTORY_CHARS) -> list[dict]:
        """The messages that 0-based ``turn`` is generated after, given the answers to the turns before it."""
        msgs = list(self.messages)
        for t in range(turn):
            msgs += [{"role": "assistant", "content": answers[t]}, {"role": "user", "content": self.followups[t]}]
        return trim_history(msgs, history_chars) if turn else msgs


def trim_history(messages: list[dict], budget: int) -> list[dict]:
    """Drop the oldest user/assistant pairs until the text fits ``budget`` characters (system turns stay).

    The last user turn always stays, so the result still ends with the turn to answer.
    """
    system = [m for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    while len(rest) > 2 and sum(len(m["content"]) for m in system + rest) > budget:
        rest = rest[2:]
    return system + rest


def clip(text: str, limit: int = MAX_CHARS) -> str:
    """``text`` cut to ``limit`` characters (marked with " …" when cut)."""
    text = text.strip()
    return text if len(text) <= limit else text[:limit].rstrip() + " …"


def user_turn(text: str) -> dict:
    """A user message of ``text``, cut to :data:`MAX_CHARS`."""
    return {"role": "user", "content": clip(text)}
