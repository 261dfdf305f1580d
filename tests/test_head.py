"""The packed draft head: logits over active rows equal the full head's, with incremental updates."""

from __future__ import annotations

import pytest
import torch

from dynvocab.runtime.heads.head import DraftHead, PackedHead


@pytest.fixture
def weight():
    torch.manual_seed(0)
    return torch.randn(200, 16)


def check(head, weight, hidden, ids):
    logits, cols = head.logits(hidden, ids)
    ids = ids if isinstance(ids, torch.Tensor) else ids.ids
    assert sorted(cols.tolist()) == sorted(ids.tolist())
    torch.testing.assert_close(logits, hidden @ weight[cols].T)


def test_full_head_over_the_full_set(weight):
    from dynvocab.runtime.heads.active_set import ActiveSet

    head = DraftHead(weight)
    h = torch.randn(3, 16)
    logits, cols = head.logits(h, ActiveSet.full(200))
    assert cols is None
    torch.testing.assert_close(logits, h @ weight.T)


def test_incremental_updates_copy_only_changed_rows(weight):
    head = PackedHead(weight)
    h = torch.randn(2, 16)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(200, generator=gen)[:60]
    check(head, weight, h, ids)
    for step in range(30):
        # Drop a few ids and add a few others (sometimes more, sometimes fewer), like a sliding window.
        keep = ids[torch.randperm(ids.numel(), generator=gen)[: ids.numel() - int(torch.randint(0, 12, (1,), generator=gen))]]
        pool = torch.tensor(sorted(set(range(200)) - set(keep.tolist())))
        add = pool[torch.randperm(pool.numel(), generator=gen)[: int(torch.randint(0, 12, (1,), generator=gen))]]
        new = torch.cat([keep, add])
        before = head.rows_copied
        check(head, weight, h, new)
        assert head.rows_copied - before <= add.numel() + (ids.numel() - keep.numel())
        ids = new
    assert (head.slot_of >= 0).sum() == ids.numel()


def test_prefix_views_of_a_ranking_do_not_copy(weight):
    from dynvocab.runtime.heads.active_set import Prefix

    head = PackedHead(weight)
    ranking = torch.randperm(200)[:90]
    h = torch.randn(1, 16)
    check(head, weight, h, Prefix(ranking, 60))
    assert head.rows_copied == 60
    for k in (60, 45, 30, 60, 75, 20, 90, 10):  # shorter prefixes are slices; a longer one copies only its new rows
        logits, cols = head.logits(h, Prefix(ranking, k))
        assert cols.tolist() == ranking[:k].tolist()
        torch.testing.assert_close(logits, h @ weight[ranking[:k]].T)
    assert head.rows_copied == 90
    logits, cols = head.logits(h, ranking[:30].clone())  # a bare tensor is a changed set: brought up to date
    assert sorted(cols.tolist()) == sorted(ranking[:30].tolist()) and head.rows_copied == 90
    torch.testing.assert_close(logits, h @ weight[cols].T)


def test_softcap_applies(weight):
    head = PackedHead(weight, softcap=2.0)
    h = torch.randn(1, 16) * 10
    cols = torch.arange(10)
    logits, _ = head.logits(h, cols)
    raw = h @ weight[cols].T  # [1, 10] uncapped
    assert logits.abs().max() <= 2.0
    torch.testing.assert_close(logits, torch.tanh(raw / 2.0) * 2.0)  # capped, not clipped or zeroed
    assert logits.abs().max() > 1.5  # large raw logits come out near the cap


def test_draft_head_segments_concatenate_and_keep_their_own_buffers(weight):
    from dynvocab.runtime.heads.active_set import ActiveSet

    head = DraftHead(weight)
    h = torch.randn(1, 16)
    core = torch.arange(100, 160)
    for step, k in enumerate((60, 60, 20, 15)):
        window = torch.tensor([3, 5, 7 + step])  # one id replaced per step, in the slot of the one it replaces
        expected = [3, 5, 7 + step] + list(range(100, 100 + k))  # the window's ids, then the core's prefix
        logits, cols = head.logits(h, ActiveSet.of(window, core[:k]))
        assert cols.tolist() == expected
        torch.testing.assert_close(logits, h @ weight[expected].T)
        assert head.segments[0].rows_copied == 3 + step  # packed once, then only the entering id's row
        assert head.segments[1].rows_copied == 60  # the core was packed once; its prefixes are slices
    assert len(head.segments) == 2
    active = ActiveSet.of(window, core[:15])
    assert active.size == 18
    assert active.contains(114) and not active.contains(115)
    assert active.mask(200).nonzero().flatten().tolist() == sorted(window.tolist() + core[:15].tolist())
    assert ActiveSet.full(200).contains(5) and not ActiveSet.full(200).contains(200)
    assert ActiveSet.full(200).size == 200 and int(ActiveSet.full(200).mask(300).sum()) == 200


def test_row_ranges_match_the_full_head_on_their_ids():
    from dynvocab.runtime.heads.active_set import ActiveSet, RowRanges, merge_ranges

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 8, generator=gen), torch.randn(40, generator=gen)
    order = torch.randperm(40, generator=gen)
    head = DraftHead(weight, bias, softcap=5.0)
    hidden = torch.randn(2, 8, generator=gen)
    full = torch.tanh((hidden @ weight.T + bias) / 5.0) * 5.0
    for starts, ends in (([10, 0, 30], [20, 5, 31]), ([5, 0], [10, 5]), ([], [])):
        ranges = RowRanges(order, *merge_ranges(starts, ends))
        extra = order[35:]
        active = ActiveSet.of(ranges, extra)
        logits, ids = head.logits(hidden, active)
        assert ids.tolist() == ranges.ids.tolist() + extra.tolist()
        torch.testing.assert_close(logits, full[:, ids])
        assert active.size == ranges.size + 5 and active.ids().tolist() == ids.tolist()
        assert active.contains(int(order[35])) and not active.contains(int(order[25]))
    assert merge_ranges([5, 0], [10, 5]) == ((0,), (10,))
    assert head.rows_copied == 40 + 5  # the order packed once; the extra segment once


def test_row_ranges_positions_cover_each_range_in_order():
    from dynvocab.runtime.heads.active_set import RowRanges

    order = torch.arange(100).flip(0)
    ranges = RowRanges(order, (3, 10, 50), (5, 11, 54))
    assert ranges.positions.tolist() == [3, 4, 10, 50, 51, 52, 53]
    assert torch.equal(ranges.ids, order[ranges.positions])
    assert RowRanges(order, (), ()).positions.numel() == 0
