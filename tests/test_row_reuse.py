"""Row sources and set identity: every source satisfies RowSource, segment keys say what a segment is, and every
head (EAGLE-3's mapped head included) reuses its packed rows from those keys alone."""

from __future__ import annotations

import pytest
import torch

from dynvocab.models.int8 import int8_supported
from dynvocab.models.rows import FloatRows, Int8Rows, RowSource, row_source
from dynvocab.runtime.heads.active_set import CHANGED, ActiveSet, Gathered, Prefix, RowRanges, SegmentKey, segment_key
from dynvocab.runtime.heads.head import DraftHead
from dynvocab.runtime.heads.mapped_head import MappedHead

VOCAB, DRAFT_VOCAB, DIM = 300, 120, 16
MEMBERS = ("shape", "device", "dtype", "row_dtype", "bias", "packs_prefixes", "ordered", "linear", "gather",
           "matmul", "prefix_linear", "prefix_pack")


def sources() -> list:
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))  # int8 kernels want d a multiple of 32
    out = [FloatRows(weight), FloatRows(weight.bfloat16(), torch.randn(64).bfloat16())]
    if int8_supported("cpu"):
        out.append(Int8Rows(weight, torch.randn(64), keep_rows=True))
    return out


@pytest.mark.parametrize("source", sources(), ids=lambda s: type(s).__name__)
def test_every_row_source_satisfies_the_protocol(source):
    assert isinstance(source, RowSource)
    assert all(hasattr(source, m) for m in MEMBERS)
    assert row_source(source) is source  # chosen once: a source passes through the chooser unchanged
    ids = torch.tensor([3, 0, 41])
    hidden = torch.randn(2, 128, generator=torch.Generator().manual_seed(1)).to(source.dtype)
    rows, scales, bias = source.gather(ids)
    assert rows.shape == (3, 128) and rows.dtype == source.row_dtype
    part = source.matmul(hidden, rows, scales, bias).float()
    full = source.linear(hidden).float()
    assert (part - full[:, ids]).abs().max() < 0.02 * full.abs().max()  # int8: fbgemm's activation rounding


def test_row_source_wraps_a_tensor_as_float_rows():
    weight, bias = torch.randn(10, 4), torch.randn(10)
    source = row_source(weight, bias)
    assert isinstance(source, FloatRows) and source.weight is weight and source.bias is bias
    assert source.prefix_linear(torch.randn(1, 4), torch.arange(10), 5) is None and not source.packs_prefixes


def test_segment_keys_name_the_ranking_by_identity_never_by_value():
    ranking = torch.arange(10)
    assert Prefix(ranking, 4).key == Prefix(ranking, 4).key == SegmentKey.prefix(ranking, 4)
    assert Prefix(ranking, 4).key != Prefix(ranking, 5).key
    assert Prefix(ranking, 4).key.same_order(Prefix(ranking, 9).key)
    assert Prefix(ranking, 4).key != Prefix(ranking.clone(), 4).key  # equal ids in another tensor: another ranking
    ranges = RowRanges(ranking, (0, 5), (2, 7))
    assert ranges.key == RowRanges(ranking, (3,), (4,)).key != Prefix(ranking, 0).key  # which ranges is not the key
    assert segment_key(ranking) is CHANGED and Gathered(ranking).key is CHANGED and CHANGED != CHANGED
    assert Prefix.whole(ranking).ids is ranking and Prefix(ranking, 4).ids.tolist() == [0, 1, 2, 3]
    assert len({Prefix(ranking, 4).key, SegmentKey.prefix(ranking, 4)}) == 1
    with pytest.raises(ValueError):
        Prefix(ranking, 11)


def test_a_kept_set_copies_nothing_until_it_is_replaced():
    weight = torch.randn(VOCAB, DIM)
    head = DraftHead(weight)
    h = torch.randn(1, DIM)
    window = torch.arange(20, 60)
    kept = Prefix.whole(window)
    for _ in range(3):
        logits, cols = head.logits(h, ActiveSet.of(kept))
        torch.testing.assert_close(logits, h @ weight[cols].T)
    assert head.rows_copied == 40
    moved = torch.cat([window[2:], torch.tensor([200, 201, 202])])  # a new tensor: two ids left, three entered
    logits, cols = head.logits(h, ActiveSet.of(Prefix.whole(moved)))
    assert sorted(cols.tolist()) == sorted(moved.tolist()) and head.rows_copied == 43
    torch.testing.assert_close(logits, h @ weight[cols].T)


# --- EAGLE-3: the mapped head -------------------------------------------------------------------------------------


@pytest.fixture
def mapped():
    """A draft vocabulary of DRAFT_VOCAB target ids, its rows, and a reference by hand: target id -> row."""
    gen = torch.Generator().manual_seed(7)
    row_token = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values  # [Vd] target ids
    weight = torch.randn(DRAFT_VOCAB, DIM, generator=gen)
    row_by_hand = {int(t): i for i, t in enumerate(row_token.tolist())}
    return weight, row_token, row_by_hand


def reference(weight, row_by_hand, hidden, targets: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Logits over the target ids in the draft vocabulary, in the given order, and those ids."""
    inside = [t for t in targets if t in row_by_hand]
    rows = torch.tensor([row_by_hand[t] for t in inside], dtype=torch.long)
    return hidden @ weight[rows].T, inside


def test_eagle3_prefixes_of_one_ranking_are_packed_once(mapped):
    weight, row_token, row_by_hand = mapped
    head = MappedHead(weight, row_token, VOCAB)
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))  # target ids, most outside
    hidden = torch.randn(2, DIM)
    copied = []
    for k in (240, 240, 180, 90, 30, 240, 5):
        logits, cols = head.logits(hidden, ActiveSet.of(Prefix(ranking, k)))
        ref, inside = reference(weight, row_by_hand, hidden, ranking[:k].tolist())
        assert cols.tolist() == inside  # in ranking order: the mapped ranking's prefix, a slice of the packed rows
        torch.testing.assert_close(logits, ref)
        copied.append(head.rows_copied)
    first = len(reference(weight, row_by_hand, hidden, ranking[:240].tolist())[1])
    assert copied == [first] * len(copied)  # the first pack, then slices only
    assert head.map(Prefix(ranking, 90)) is head.map(Prefix(ranking, 90))  # k' computed once per (ranking, k)


def test_eagle3_range_selections_of_one_order_gather_its_rows_once(mapped):
    weight, row_token, row_by_hand = mapped
    head = MappedHead(weight, row_token, VOCAB)
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))  # e.g. ids grouped by cluster
    hidden = torch.randn(1, DIM)
    inside_order = len(reference(weight, row_by_hand, hidden, order.tolist())[1])
    for starts, ends in (((0, 40, 200), (25, 90, 260)), ((10, 120), (60, 300)), ((0,), (150,))):
        ranges = RowRanges(order, starts, ends)
        extra = torch.tensor([t for t in range(VOCAB) if t not in set(ranges.ids.tolist())][:7])  # a changed set
        logits, cols = head.logits(hidden, ActiveSet.of(ranges, extra))
        ref, inside = reference(weight, row_by_hand, hidden, ranges.ids.tolist())
        _, extra_inside = reference(weight, row_by_hand, hidden, extra.tolist())
        n = len(inside)
        assert cols[:n].tolist() == inside and sorted(cols[n:].tolist()) == sorted(extra_inside)  # a set: any order
        torch.testing.assert_close(logits[:, :n], ref)
        torch.testing.assert_close(logits, hidden @ weight[[row_by_hand[t] for t in cols.tolist()]].T)
        mapped_ranges = head.map(ranges)
        assert isinstance(mapped_ranges, RowRanges) and mapped_ranges.key == head.map(RowRanges(order, (5,), (6,))).key
    assert head.inner.segments[0].rows_copied == inside_order  # the mapped order's rows, gathered once


def test_eagle3_changed_and_gathered_segments_and_the_empty_fallback(mapped):
    weight, row_token, row_by_hand = mapped
    head = MappedHead(weight, row_token, VOCAB)
    hidden = torch.randn(1, DIM)
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:50]
    for segment in (ids, Gathered(ids)):
        logits, cols = head.logits(hidden, ActiveSet.of(segment))
        ref, inside = reference(weight, row_by_hand, hidden, ids.tolist())
        assert sorted(cols.tolist()) == sorted(inside)
        torch.testing.assert_close(logits, hidden @ weight[[row_by_hand[t] for t in cols.tolist()]].T)
    outside = torch.tensor([t for t in range(VOCAB) if t not in row_by_hand][:5])
    logits, cols = head.logits(hidden, ActiveSet.of(Prefix.whole(outside)))  # nothing inside: the whole draft head
    assert torch.equal(cols, row_token)
    torch.testing.assert_close(logits, hidden @ weight.T)


def test_eagle3_position_aware_frequency_copies_its_rows_once(mapped):
    from dynvocab.runtime.selection import SelectorPolicy
    from dynvocab.runtime.selection.batch_select import eos_first
    from dynvocab.runtime.selection.frequency import PositionSelector

    weight, row_token, row_by_hand = mapped
    head = MappedHead(weight, row_token, VOCAB)
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(4))
    policy = SelectorPolicy(PositionSelector(eos_first(ranking, torch.tensor([11])), 200))
    hidden = torch.randn(1, DIM)
    copied = set()
    for step in (0, 1, 2, 3, 4, 0, 1, 2):
        active = policy.active_ids(step)
        logits, cols = head.logits(hidden, active)
        ref, inside = reference(weight, row_by_hand, hidden, active.ids().tolist())
        assert cols.tolist() == inside
        torch.testing.assert_close(logits, ref)
        copied.add(head.rows_copied)
    assert len(copied) == 1  # the ranking's rows gathered at the first step; every later prefix is a slice


def test_eagle3_hybrid_core_prefixes_are_slices(mapped):
    from dynvocab.runtime.selection.context.hybrid import HybridConfig, HybridPolicy

    weight, row_token, row_by_hand = mapped
    head = MappedHead(weight, row_token, VOCAB)
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))
    policy = HybridPolicy(HybridConfig(core_size=150, window=40, pa_core=True), VOCAB, "cpu", ranking)
    policy.prefill(torch.tensor([1, 2, 3, 250]), torch.randn(3, VOCAB), None)
    hidden = torch.randn(1, DIM)
    core_copied = []
    for step in range(5):
        active = policy.active_ids(step)
        logits, cols = head.logits(hidden, active)
        ref, inside = reference(weight, row_by_hand, hidden, active.ids().tolist())
        assert sorted(cols.tolist()) == sorted(inside)
        torch.testing.assert_close(logits, hidden @ weight[[row_by_hand[t] for t in cols.tolist()]].T)
        core_copied.append(head.inner.segments[1].rows_copied)
    assert len(set(core_copied)) == 1  # the core prefix packed once, then sliced
