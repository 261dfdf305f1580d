"""RequestWindows: each request's distinct ids in fixed memory, and the columns a batch's windows fill."""

import torch

from dynvocab.runtime.policies.request_window import MIN_WIDTH, RequestWindows


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
