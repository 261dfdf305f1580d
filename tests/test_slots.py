"""The packed head's slot bookkeeping against a brute-force model on Python lists."""

import torch

from dynvocab.runtime.heads.slots import SlotTable

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


def test_slot_table_matches_brute_force():
    table = SlotTable(VOCAB, capacity=4)
    slots: list[int] = []
    before = torch.zeros(VOCAB, dtype=torch.bool)
    compactions = 0
    for ids in random_sets(300, seed=1):
        now = torch.zeros(VOCAB, dtype=torch.bool)
        now[ids] = True
        dst, src = table.update(ids)
        slots, copies = model_update(slots, ids.tolist())  # entering tokens take slots in the order given
        assert list(zip(dst.tolist(), src.tolist())) == copies
        entered, left = int((now & ~before).sum()), int((before & ~now).sum())
        assert len(copies) <= entered + left
        compactions += len(copies) > entered
        check_table(table, slots, ids)
        before = now
    assert compactions > 0  # the shrink path that moves live rows into holes ran
