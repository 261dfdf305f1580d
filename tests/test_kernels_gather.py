"""The packed head buffer: slot bookkeeping against a brute-force model, the gather kernel against its reference."""

import pytest
import torch

from dynvocab.kernels import (
    PackedBuffer,
    SlotTable,
    WindowState,
    gather_rows,
    gather_rows_reference,
)
from triton_modes import KERNEL_DEVICES, needs_cuda, needs_triton

VOCAB = 500


def model_update(slots: list[int], new: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Brute-force model of the slot algorithm on Python lists: (live slots after, copies (slot, token))."""
    n = len(slots)
    wanted, present = set(new), set(slots)
    stale = [s for s in range(n) if slots[s] not in wanted]
    fresh = [t for t in new if t not in present]
    n_new = n - len(stale) + len(fresh)
    out = slots + [-1] * max(0, n_new - n)
    if len(fresh) >= len(stale):
        copies = list(zip(stale + list(range(n, n_new)), fresh))
    else:
        copies = list(zip(stale, fresh))
        holes = stale[len(fresh):]
        for s in holes:
            out[s] = -1
        movers = [s for s in range(n_new, n) if out[s] >= 0]
        copies += [(hole, out[m]) for hole, m in zip([h for h in holes if h < n_new], movers)]
    for slot, token in copies:
        out[slot] = token
    return out[:n_new], copies


def random_sets(steps: int, seed: int):
    """A sequence of token sets that drift like a sliding window, with occasional jumps, growth and collapse."""
    gen = torch.Generator().manual_seed(seed)
    current = torch.randperm(VOCAB, generator=gen)[:40]
    for step in range(steps):
        kind = step % 17
        if kind == 5:
            current = torch.randperm(VOCAB, generator=gen)[: int(torch.randint(0, 200, (1,), generator=gen))]
        elif kind == 11:
            current = current[:0]
        else:
            keep = current[torch.rand(current.numel(), generator=gen) > 0.15]
            pool = torch.ones(VOCAB, dtype=torch.bool)
            pool[keep] = False
            candidates = torch.nonzero(pool).flatten()
            n_add = int(torch.randint(0, 15, (1,), generator=gen))
            add = candidates[torch.randperm(candidates.numel(), generator=gen)[:n_add]]
            current = torch.cat([keep, add])[torch.randperm(keep.numel() + add.numel(), generator=gen)]
        yield current


def check_table(table: SlotTable, slots: list[int], ids: torch.Tensor) -> None:
    assert table.active.tolist() == slots
    assert sorted(slots) == sorted(ids.tolist())
    assert (table.ids[table.n:] == -1).all()
    placed = torch.nonzero(table.slot_of >= 0).flatten()
    assert sorted(placed.tolist()) == sorted(slots)
    assert torch.equal(table.ids[table.slot_of[placed]], placed)


@pytest.mark.parametrize("route", ["ids", "masks"])
def test_slot_table_matches_brute_force(route):
    table = SlotTable(VOCAB, capacity=4)
    slots: list[int] = []
    before = torch.zeros(VOCAB, dtype=torch.bool)
    compactions = 0
    for ids in random_sets(300, seed=1):
        now = torch.zeros(VOCAB, dtype=torch.bool)
        now[ids] = True
        if route == "ids":
            dst, src = table.update(ids)
        else:
            dst, src = table.update_changes(now & ~before, before & ~now)
        # Entering tokens take slots in the order the route lists them: as given, or ascending from a mask.
        slots, copies = model_update(slots, ids.tolist() if route == "ids" else sorted(ids.tolist()))
        assert list(zip(dst.tolist(), src.tolist())) == copies
        entered, left = int((now & ~before).sum()), int((before & ~now).sum())
        assert len(copies) <= entered + left
        compactions += len(copies) > entered
        check_table(table, slots, ids)
        before = now
    assert compactions > 0  # the shrink path that moves live rows into holes ran


def test_packed_buffer_cpu_tracks_sets_and_logits():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(VOCAB, 24, generator=gen)
    buffer = PackedBuffer(weight, capacity=8)
    h = torch.randn(3, 24, generator=gen)
    copied = 0
    for ids in random_sets(60, seed=3):
        buffer.schedule(ids)
        logits, cols = buffer.logits(h)
        assert sorted(cols.tolist()) == sorted(ids.tolist())
        torch.testing.assert_close(logits, h @ weight[cols].T)
        assert buffer.rows_copied >= copied
        copied = buffer.rows_copied


def test_packed_buffer_follows_window_changes():
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(VOCAB, 16, generator=gen)
    window = WindowState(VOCAB, window=64)
    buffer = PackedBuffer(weight, capacity=16)
    h = torch.randn(1, 16, generator=gen)
    for _ in range(40):
        window.push(torch.randint(0, 120, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen))
        buffer.schedule_changes(*window.changed_since_last())
        logits, cols = buffer.logits(h)
        assert sorted(cols.tolist()) == window.active_ids().tolist()
        torch.testing.assert_close(logits, h @ weight[cols].T)


@needs_triton
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("k,d", [(0, 96), (1, 96), (13, 96), (100, 40)])
def test_gather_rows_matches_reference(device, dtype, k, d):
    gen = torch.Generator().manual_seed(k)
    src = torch.randn(VOCAB, d, generator=gen).to(device, dtype)
    dst = torch.randn(128, d, generator=gen).to(device, dtype)
    src_idx = torch.randint(0, VOCAB, (k,), generator=gen).to(device)
    dst_idx = torch.randperm(128, generator=gen)[:k].to(device)
    expected = dst.clone()
    gather_rows_reference(src, src_idx, expected, dst_idx)
    gather_rows(src, src_idx, dst, dst_idx.int())
    assert torch.equal(dst, expected)


@needs_cuda
def test_packed_buffer_side_stream_on_cuda():
    weight = torch.randn(VOCAB, 64, device="cuda", dtype=torch.bfloat16)
    buffer = PackedBuffer(weight, capacity=8)
    h = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    for ids in random_sets(50, seed=5):
        buffer.schedule(ids.cuda())
        body = h @ torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)  # work the gather overlaps with
        logits, cols = buffer.logits(h)
        assert sorted(cols.tolist()) == sorted(ids.tolist())
        torch.testing.assert_close(logits, (h @ weight[cols].T).float(), rtol=2e-2, atol=5e-2)
        assert body.shape == (2, 64)
