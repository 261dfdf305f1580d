"""RequestWindows: each request's distinct ids in fixed memory, and the columns a batch's windows fill."""

import numpy as np
import pytest
import torch

from dynvocab.errors import DynvocabError
from dynvocab.runtime.selection.context.window import MIN_WIDTH, RequestWindows


def test_a_window_holds_the_distinct_ids_of_the_last_tokens_first():
    windows = RequestWindows(slots=2, size=8, vocab_size=100)
    slot = windows.update("a", torch.tensor([5, 9, 5, 3, 7, 7, 2, 9, 9, 1]))  # the last 8: 5 3 7 7 2 9 9 1
    row = windows.ids[slot].tolist()
    assert row[:6] == [1, 2, 3, 5, 7, 9] and row[6:] == [1, 1]  # padded by the last token


def test_width_covers_every_distinct_id_of_the_batch_in_few_shapes():
    size = 4 * MIN_WIDTH
    windows = RequestWindows(slots=3, size=size, vocab_size=10_000)
    small = windows.update("small", torch.arange(10))
    large = windows.update("large", torch.arange(MIN_WIDTH + 1))
    assert windows.width([small]) == MIN_WIDTH
    assert windows.width([small, large]) == 2 * MIN_WIDTH  # 65 distinct ids: the next power of two
    whole = windows.update("whole", torch.arange(3 * size))
    assert windows.width([whole]) == size  # never past the window
    for slot in (small, large, whole):
        width = windows.width([small, large, whole])
        assert set(windows.ids[slot, :width].tolist()) == set(windows.ids[slot].tolist())


def test_a_freed_slot_counts_no_ids():
    windows = RequestWindows(slots=1, size=4 * MIN_WIDTH, vocab_size=10_000)
    slot = windows.update("a", torch.arange(3 * MIN_WIDTH))
    windows.keep(set())
    assert len(windows) == 0 and windows.width([slot]) == MIN_WIDTH
    assert windows.update("b", torch.tensor([7])) == slot and windows.width([slot]) == MIN_WIDTH


def expected_window(record: list[int], size: int, vocab: int, fill: int) -> list[int]:
    """A window as written out: the distinct valid ids of the last ``size`` tokens ascending, then the last valid
    one repeated (``fill`` throughout where there is none)."""
    tail = [t for t in record[max(0, len(record) - size):] if 0 <= t < vocab]
    distinct = sorted(set(tail))
    return distinct + [tail[-1] if tail else fill] * (size - len(distinct))


def test_update_many_is_update_for_each_key_in_order():
    """Records grow, stay, shrink (a new record in the row) or empty, with ids -1 … past the vocabulary, in a
    token array with more rows than the batch; batched windows, slots and widths are per-key update's."""
    rng = np.random.default_rng(0)
    size, vocab, slots, fill = 16, 40, 6, 3
    batched, single = RequestWindows(slots, size, vocab, fill), RequestWindows(slots, size, vocab, fill)
    tokens = rng.integers(-2, vocab + 3, size=(8, 64)).astype(np.int32)
    counts = np.zeros(8, dtype=np.int64)
    keys = [f"r{i}" for i in range(8)]
    for _ in range(80):
        live = [int(i) for i in rng.permutation(8)[: rng.integers(1, slots + 1)]]
        for i in live:
            move = rng.random()
            if move < 0.6:
                counts[i] = min(64, counts[i] + rng.integers(1, 5))
            elif move < 0.8:
                counts[i] = rng.integers(0, counts[i] + 1)
                tokens[i, counts[i]:] = rng.integers(-2, vocab + 3, size=64 - counts[i])
            elif move < 0.9:
                counts[i] = 0
        alive = {keys[i] for i in live}
        batched.keep(alive)
        single.keep(alive)
        rows = np.concatenate([tokens[live], rng.integers(0, vocab, size=(2, 64)).astype(np.int32)])
        got = batched.update_many([keys[i] for i in live], rows, np.concatenate([counts[live], [64, 64]]))
        want = [single.update(keys[i], tokens[i, : counts[i]]) for i in live]
        assert got == want
        assert torch.equal(batched.ids, single.ids)
        assert batched.width(got) == single.width(want)
        for i, slot in zip(live, got):
            assert batched.ids[slot].tolist() == expected_window(tokens[i, : counts[i]].tolist(), size, vocab, fill)


def test_update_many_refused_for_a_full_table_keeps_the_keys_before():
    windows = RequestWindows(slots=2, size=4, vocab_size=10)
    tokens = np.array([[1, 2, 2], [5, 5, 5], [7, 8, 9]], dtype=np.int32)
    with pytest.raises(DynvocabError, match="full"):
        windows.update_many(["a", "b", "c"], tokens, [3, 2, 3])
    assert windows.keys() == {"a", "b"}
    assert [windows.ids[s].tolist() for s in windows.update_many(["a", "b"], tokens, [3, 2])] == [
        [1, 2, 2, 2], [5, 5, 5, 5]]


def test_a_pushed_stream_and_a_hosts_record_give_one_window():
    """dynvocab's loop pushes its stream in pieces (the windows keep it), a batched host hands its whole record: one
    window, the distinct valid ids of the last W entries, ascending."""
    pushed, handed = RequestWindows(slots=1, size=16, vocab_size=100), RequestWindows(slots=1, size=16, vocab_size=100)
    g = torch.Generator().manual_seed(0)
    record = []
    for _ in range(12):
        piece = torch.randint(0, 110, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        record += piece.tolist()
        ids = pushed.push("r", piece.numpy())
        slot = handed.update("r", torch.tensor(record))
        assert ids.tolist() == handed.ids[slot, : ids.numel()].tolist() == sorted({t for t in record[-16:] if t < 100})
    pushed.keep(set())
    assert len(pushed) == 0 and pushed.push("r", np.array([3])).tolist() == [3]  # a freed stream starts anew
