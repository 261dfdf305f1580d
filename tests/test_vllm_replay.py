"""The vLLM rows' replayed conversations (:mod:`dynvocab.bench.engines.vllm.replay`): each turn after the answers
written to the turns before it, one call per turn, single-turn items a request each; no engine (the answers are
written by a function here; tests/test_bench_vllm.py runs it on vLLM)."""

from __future__ import annotations

from dynvocab.bench.engines.vllm.replay import replay_turns
from dynvocab.bench.loop.items import BenchItem


def _encode(messages: list[dict]) -> list[int]:
    return [ord(c) for c in "|".join(f"{m['role']}:{m['content']}" for m in messages)]


def _decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def test_each_turn_follows_the_answers_to_the_turns_before_it_one_call_per_turn():
    calls = []

    def answer(prompts):
        calls.append(len(prompts))
        return [[ord("A"), ord(str(len(calls)))] for _ in prompts]  # "A<call>": which call wrote it

    items = [BenchItem.conversation("talk", "lang-switch", ["hallo", "bonjour", "ciao"], ("de", "fr", "it")),
             BenchItem("single", "chat", ({"role": "user", "content": "hi"},)),
             BenchItem.conversation("short", "lang-switch", ["one", "two"], ("en", "en"))]
    turns = replay_turns(items, _encode, answer, _decode, log=lambda text: None)
    assert [t.id for t in turns] == ["talk/t1", "talk/t2", "talk/t3", "single", "short/t1", "short/t2"]
    assert calls == [2, 1]  # turn 1 of both conversations, then turn 2 of the one that goes on
    text = {t.id: _decode(t.prompt) for t in turns}
    assert text["talk/t3"] == "user:hallo|assistant:A1|user:bonjour|assistant:A2|user:ciao"
    assert text["short/t2"] == "user:one|assistant:A1|user:two"
    assert text["single"] == "user:hi" and turns[3].segment is None
    assert [t.segment for t in turns[:3]] == ["de", "fr", "it"] and {t.task for t in turns[:3]} == {"lang-switch"}


def test_a_history_over_the_budget_drops_its_oldest_turns_as_the_loop_does():
    item = BenchItem.conversation("long", "lang-switch", ["a" * 50, "b" * 50, "c"], ())
    turns = replay_turns([item], _encode, lambda prompts: [[ord("x")] * 40 for _ in prompts], _decode,
                         history_chars=150, log=lambda text: None)
    assert _decode(turns[2].prompt) == _decode(_encode(item.context(2, ["x" * 40] * 2, 150)))
    assert "a" * 50 not in _decode(turns[2].prompt)
