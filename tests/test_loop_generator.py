"""The loop as an iterator (:class:`~dynvocab.runtime.decoding.loop.Decoding`) on tiny random models: its cycles are
``speculative_generate``'s, closing it runs no further cycle and still finishes the metrics, ``on_end`` runs once
however it ends (dropped unclosed included), and inference mode does not leak into the consumer's code between
cycles."""

from __future__ import annotations

import gc

import pytest
import torch

from dynvocab.runtime.decoding import loop
from dynvocab.runtime.decoding.loop import DecodeConfig, Decoding, speculative_generate
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.selection import FullPolicy

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 1, 4, 1, 5]
CFG = DecodeConfig(gamma=4, max_new_tokens=30)


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair
    return CausalLM(target), DraftModel(draft)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_iterating_yields_each_cycle_and_ends_with_the_whole_generation(pair, temperature):
    target, draft = pair
    cfg = DecodeConfig(gamma=4, max_new_tokens=30, temperature=temperature, seed=5)
    whole = speculative_generate(target, PROMPT, cfg, set(), draft, FullPolicy(draft.vocab_size))
    decoding = Decoding(target, PROMPT, cfg, set(), draft, FullPolicy(draft.vocab_size))
    assert decoding.generation is None  # nothing runs before the first next
    pieces = list(decoding)
    assert [len(p) for p in pieces] == whole.cycle_lengths and sum(pieces, []) == whole.token_ids
    g = decoding.generation
    assert g.token_ids == whole.token_ids and g.metrics.cycles == len(pieces) and g.cycle_lengths == whole.cycle_lengths
    assert list(decoding) == []  # an ended decoding stays ended


def test_closing_stops_after_the_cycle_in_flight_and_finishes_the_metrics(pair, cycles_run):
    target, draft = pair
    ended = []
    decoding = Decoding(target, PROMPT, CFG, set(), draft, FullPolicy(draft.vocab_size), on_end=lambda: ended.append(1))
    first, second = next(decoding), next(decoding)
    assert cycles_run[0] == 2 and not ended
    decoding.close()
    decoding.close()
    assert cycles_run[0] == 2 and ended == [1]  # no third cycle; on_end once
    g = decoding.generation
    assert g.token_ids == first + second and g.metrics.cycles == 2 and g.metrics.new_tokens == len(g.token_ids)
    assert g.metrics.wall_s > 0 and g.metrics.mean_accepted_length == len(g.token_ids) / 2
    with pytest.raises(StopIteration):
        next(decoding)
    assert cycles_run[0] == 2
    whole = speculative_generate(target, PROMPT, CFG, set(), draft, FullPolicy(draft.vocab_size))
    assert whole.token_ids[: len(g.token_ids)] == g.token_ids  # the models are left fit for the next generation


def test_closed_before_the_first_cycle_nothing_runs(pair, cycles_run):
    target, draft = pair
    ended = []
    decoding = Decoding(target, PROMPT, CFG, set(), draft, on_end=lambda: ended.append(1))
    decoding.close()
    assert cycles_run[0] == 0 and ended == [1]
    assert decoding.generation.token_ids == [] and decoding.generation.metrics.cycles == 0


def test_on_end_runs_once_at_the_end_and_after_a_failure(pair, monkeypatch):
    target, draft = pair
    ended = []
    Decoding(target, PROMPT, CFG, set(), draft, on_end=lambda: ended.append("end")).run()
    assert ended == ["end"]

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(loop, "run_cycle", fail)
    decoding = Decoding(target, PROMPT, CFG, set(), draft, on_end=lambda: ended.append("failed"))
    with pytest.raises(RuntimeError, match="boom"):
        next(decoding)
    assert ended == ["end", "failed"] and decoding.generation.token_ids == []


def test_a_decoding_dropped_unclosed_still_calls_on_end(pair):
    target, draft = pair
    ended = []
    decoding = Decoding(target, PROMPT, CFG, set(), draft, on_end=lambda: ended.append(1))
    next(decoding)
    del decoding
    gc.collect()
    assert ended == [1]


def test_the_consumer_runs_outside_inference_mode(pair):
    target, draft = pair
    modes = [torch.is_inference_mode_enabled() for _ in Decoding(target, PROMPT, CFG, set(), draft)]
    assert modes and not any(modes)


def test_an_empty_prompt_is_refused_at_once(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        Decoding(target, [], CFG, set())
