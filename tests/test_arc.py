"""EvoSpec's ARC cache: admission, promotion, eviction, ghost hits moving p, warm-up, minimum residency."""

from __future__ import annotations

import pytest

from dynvocab.runtime.selection.evospec.arc import ARCCache


def cache(capacity=4, ghost=4, p=2, residency=0, warmup=0) -> ARCCache:
    return ARCCache(capacity, ghost, p, residency, warmup)


def test_new_ids_enter_t1_and_a_second_hit_promotes_to_t2():
    c = cache()
    assert c.admit([1, 2, 3]) == [1, 2, 3]
    assert list(c.t1) == [1, 2, 3] and not c.t2
    assert c.admit([2]) == []  # a hit admits nothing new
    assert list(c.t1) == [1, 3] and list(c.t2) == [2]
    c.admit([5, 2])  # a repeated hit in T2 moves it to the MRU end
    c.touch(4)  # a use of a non-resident id never admits it
    assert 4 not in c
    c.admit([6])
    c.admit([2])
    assert list(c.t2)[-1] == 2
    assert c.stats.hits == 3 and c.stats.admitted == 5 and c.stats.evicted == 1


def test_touch_counts_a_use_as_a_hit():
    c = cache()
    c.admit([7])
    assert c.touch(7) and list(c.t2) == [7]
    assert not c.touch(8)


def test_duplicates_in_one_event_are_one_request_and_the_cap_counts_new_ids_only():
    c = cache(capacity=8)
    assert c.admit([1, 1, 2, 2, 3]) == [1, 2, 3]
    assert list(c.t1) == [1, 2, 3]  # no self-promotion inside one event
    assert c.admit([1, 4, 2, 5, 6, 7], max_new=2) == [4, 5]  # hits 1 and 2 do not use up the cap
    assert set(c.t2) == {1, 2} and 6 not in c and 7 not in c


def test_eviction_takes_the_lru_of_t1_when_t1_exceeds_p_and_remembers_it_in_b1():
    c = cache(capacity=3, p=1)
    c.admit([1, 2])
    c.admit([1])  # T1 = [2], T2 = [1]
    c.admit([3])  # T1 = [2, 3]: full now
    c.admit([4])  # |T1| = 2 > p = 1: evict T1's LRU (2)
    assert list(c.t1) == [3, 4] and list(c.t2) == [1] and list(c.b1) == [2]
    assert len(c) == 3 and c.stats.evicted == 1


def test_eviction_takes_the_lru_of_t2_when_t1_is_within_p():
    c = cache(capacity=3, p=2)
    c.admit([1, 2])
    c.admit([1, 2])  # both promoted: T2 = [1, 2]
    c.admit([3])  # T1 = [3]
    c.admit([4])  # |T1| = 1 ≤ p = 2: evict T2's LRU (1)
    assert list(c.t2) == [2] and list(c.t1) == [3, 4] and list(c.b2) == [1]


def test_ghost_lists_are_bounded():
    c = cache(capacity=1, ghost=2, p=0)
    for t in range(6):
        c.admit([t])
    assert list(c.t1) == [5] and list(c.b1) == [3, 4]


def test_ghost_hits_adapt_p_and_readmit_into_t2():
    c = cache(capacity=2, p=1)
    c.admit([1, 2])
    c.admit([3])  # evicts 1 from T1 (|T1| = 2 > p) -> B1 = [1]
    assert list(c.b1) == [1]
    c.admit([1])  # B1 hit: T1 was too small, p grows by max(1, |B2|/|B1|) = 1; T2 is empty, so 2 goes
    assert c.p == 2 and 1 in c.t2 and list(c.b1) == [2]
    assert c.stats.ghost_hits_b1 == 1
    # Fill T2 and push one out to B2, then hit it: p shrinks.
    c.admit([3])  # promote 3: T2 = [1, 3]
    c.admit([4])  # full, |T1| = 0 ≤ p: evict T2's LRU (1) -> B2
    assert list(c.b2) == [1]
    c.admit([1])  # B2 hit: p shrinks; |T1| = p on a B2 hit evicts from T1 (4)
    assert c.p == 1 and c.stats.ghost_hits_b2 == 1 and list(c.t2) == [3, 1] and list(c.b1) == [2, 4]


def test_p_stays_fixed_during_the_warm_up_events():
    c = cache(capacity=2, p=1, warmup=4)
    c.admit([1, 2])  # event 1
    c.admit([3])  # event 2: 1 -> B1
    c.admit([1])  # event 3: a B1 hit (2 -> B1), but still warming up
    assert c.p == 1 and 1 in c.t2 and list(c.b1) == [2]  # the hit still re-admits; only p is frozen
    c.admit([5])  # event 4: |T1| = 1 = p, so T2's LRU (1) -> B2
    assert list(c.b2) == [1] and not c.adapting
    c.admit([2])  # event 5, past the warm-up: the B1 hit moves p
    assert c.adapting and c.p == 2


def test_min_residency_protects_young_ids_and_blocks_when_all_are_young():
    c = cache(capacity=2, p=0, residency=3)
    c.admit([1, 2])
    assert c.admit([3]) == [] and c.stats.blocked == 1  # both residents are 0 ticks old
    c.tick(2)
    assert c.admit([3]) == []  # 2 ticks < 3
    c.tick()
    assert c.admit([3]) == [3] and 1 not in c  # the LRU (1) has resided 3 ticks
    assert c.admit([4]) == [4] and 2 not in c  # 2 is old enough too; 3 (0 ticks) is not a victim
    assert set(c.resident()) == {3, 4}


def test_min_residency_falls_back_to_the_other_list():
    c = cache(capacity=3, p=0, residency=2)
    c.admit([1, 2])
    c.admit([1, 2])  # T2 = [1, 2], admitted at tick 0
    c.tick(2)
    c.admit([3])  # T1 = [3], admitted at tick 2
    # |T1| = 1 > p = 0 prefers T1, but 3 is too young: T2's LRU goes instead.
    assert c.admit([4]) == [4] and list(c.b2) == [1] and 3 in c


def test_promotion_keeps_the_admission_tick():
    c = cache(capacity=1, residency=2)
    c.admit([1])
    c.tick(2)
    c.admit([1])  # promoted to T2, still admitted at tick 0
    assert c.admit([2]) == [2] and 1 not in c


def test_version_changes_only_with_membership():
    c = cache()
    c.admit([1])
    v = c.version
    c.admit([1])
    c.touch(1)
    assert c.version == v
    c.admit([2])
    assert c.version > v


def test_capacity_is_strict_under_a_long_stream():
    c = ARCCache(capacity=16, ghost_capacity=16, p_init=8, min_residency=2, warmup_events=5)
    for step in range(200):
        c.admit([(step * 7 + i) % 50 for i in range(9)], max_new=4)
        c.tick()
        assert len(c) <= 16 and len(c.b1) <= 16 and len(c.b2) <= 16
        assert not set(c.t1) & set(c.t2) and not set(c.resident()) & (set(c.b1) | set(c.b2))
        assert 0 <= c.p <= 16


def test_bad_capacity_is_refused():
    with pytest.raises(ValueError):
        ARCCache(0)
