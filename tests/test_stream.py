"""Streaming through the Python API on tiny local models: ``Pair.stream`` and ``Pair.start`` run the loop on the
caller's thread (no thread is started), closing either runs no further cycle, and what they give is
``Pair.generate``'s output token for token."""

from __future__ import annotations

import threading

import pytest

import dynvocab
from dynvocab.api import TextStream
from dynvocab.errors import DynvocabError

pytestmark = [pytest.mark.transformers_api, pytest.mark.usefixtures("one_thread")]

PROMPT = "w1 w2 w3 w4 w5"
ARGS = {"chat_template": False, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    return dynvocab.load(target=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]), dtype="float32")


@pytest.mark.parametrize("strategy", ["ar", "full", "microspec"])
def test_stream_starts_no_thread_and_gives_generates_text(pair, strategy):
    whole = pair.generate(PROMPT, strategy, **ARGS)
    threads = threading.active_count()
    pieces = []
    for piece in pair.stream(PROMPT, strategy, **ARGS):
        assert threading.active_count() == threads
        pieces.append(piece)
    assert "".join(pieces) == whole.text and all(pieces)


def test_closing_the_stream_stops_after_the_cycle_in_flight(pair, cycles_run):
    per_cycle: list[list[int]] = []
    whole = pair.generate(PROMPT, "full", on_tokens=per_cycle.append, **ARGS)
    assert len(per_cycle) > 2  # enough cycles that stopping early shows
    shown = TextStream(pair.tokenizer)
    needed = next(i + 1 for i, new in enumerate(per_cycle) if shown.push(new))  # the cycles of the first piece
    cycles_run[0] = 0
    stream = pair.stream(PROMPT, "full", **ARGS)
    assert cycles_run[0] == 0  # nothing runs before the first piece is asked for
    first = next(stream)
    assert cycles_run[0] == needed  # no cycle ran ahead of the consumer
    stream.close()
    assert cycles_run[0] == needed and whole.text.startswith(first)
    assert pair.generate(PROMPT, "full", **ARGS).token_ids == whole.token_ids  # the pair stays usable


def test_breaking_out_of_a_reply_leaves_its_result_so_far(pair, cycles_run):
    whole = pair.generate(PROMPT, "full", **ARGS)
    cycles_run[0] = 0
    reply = pair.start(PROMPT, "full", **ARGS)
    got = []
    for new in reply:
        got += new
        if len(got) >= 3:
            break
    with pytest.raises(DynvocabError, match="still running"):
        reply.result
    reply.close()
    ran = cycles_run[0]
    assert list(reply) == [] and cycles_run[0] == ran  # closed: no further cycle
    result = reply.result
    assert result.token_ids == got == whole.token_ids[: len(got)] and result.strategy == "full"
    assert result.metrics.cycles == ran and result.metrics.new_tokens == len(got)
    assert result.text == pair.tokenizer.decode(got, skip_special_tokens=True)


def test_generate_hands_on_tokens_each_cycle(pair):
    seen: list[list[int]] = []
    result = pair.generate(PROMPT, "full", on_tokens=seen.append, **ARGS)
    assert sum(seen, []) == result.token_ids and len(seen) == result.metrics.cycles


def test_a_bad_argument_is_refused_before_anything_runs(pair, cycles_run):
    with pytest.raises(DynvocabError, match="unknown decoding setting"):
        pair.start(PROMPT, "full", max_tokens=3)
    with pytest.raises(DynvocabError, match="unknown strategy"):
        next(pair.stream(PROMPT, "nope"))
    assert cycles_run[0] == 0
