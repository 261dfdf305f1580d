"""``Tally``'s arithmetic against hand-computed values for a scripted run of three cycles."""

from __future__ import annotations

import pytest
import torch

from dynvocab.runtime.decoding.metrics import Tally
from dynvocab.runtime.heads.active_set import ActiveSet


def scripted_tally() -> Tally:
    """γ = 3; sets: ``small`` = ids 0..9, ``full`` = all 100 ids.

    1. three steps over ``small``; one chain token accepted, then 42 recovered (not in step 1's set: a miss).
    2. two steps over ``full``, both accepted, a bonus after them; one runner-up leaf verified.
    3. three steps over ``small``; the chain rejected at once, the leaf at depth 0 accepted, then 3 (in step 1's
       set: a hit); two leaves verified.
    """
    small, full = ActiveSet.of(torch.arange(10)), ActiveSet.full(100)
    tally = Tally(3)
    tally.cycle(3, 1, 1, [5, 42], [small] * 3, 0, False)
    tally.cycle(2, 2, 2, [1, 2, 3], [full] * 2, 1, False)
    tally.cycle(3, 0, 1, [7, 3], [small] * 3, 2, True)
    return tally


def test_tally_of_a_scripted_run():
    m = scripted_tally().finish(2.0, speculative=True, rows_copied=17)
    assert (m.cycles, m.new_tokens, m.draft_steps) == (3, 7, 8)
    assert m.mean_accepted_length == pytest.approx(7 / 3)
    assert m.tokens_per_s == pytest.approx(3.5) and m.wall_s == 2.0
    assert m.mean_active_vocab == pytest.approx((3 * 10 + 2 * 100 + 3 * 10) / 8)
    # per chain position: drafted in 3, 3, 2 cycles; accepted in 2 (cycles 1, 2), 1 (cycle 2), 0
    assert m.accept_by_position == pytest.approx([2 / 3, 1 / 3, 0.0])
    # emitted tokens inside their step's set, over those with a step: 1 + 0 (42), 2, 1 + 1 (3) of 2 + 2 + 2
    assert m.active_hit_rate == pytest.approx(5 / 6)
    assert (m.leaves, m.leaf_hits, m.head_rows_copied) == (3, 1, 17)


def test_tally_without_a_draft():
    tally = Tally(0)
    for _ in range(4):
        tally.cycle(0, 0, 0, [9], [], 0, False)
    m = tally.finish(0.5, speculative=False)
    assert (m.cycles, m.new_tokens, m.draft_steps, m.mean_accepted_length) == (4, 4, 0, 1.0)
    assert m.mean_active_vocab is None and m.active_hit_rate is None and m.accept_by_position == []
    assert m.tokens_per_s == pytest.approx(8.0)


def test_an_empty_generation():
    m = Tally(2).finish(0.0, speculative=True)
    assert (m.mean_accepted_length, m.tokens_per_s, m.mean_active_vocab, m.active_hit_rate) == (0.0, 0.0, None, None)
    assert m.accept_by_position == [0.0, 0.0]
