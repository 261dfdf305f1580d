"""MicroSpec's device-side sliding window against a plain-Python deque model (torch path and Triton kernel).

The policies read the window through what ``push`` returns (the evicted entries) and ``counts`` (an id is in the
set where its count is positive), so the tests check exactly those."""

from collections import Counter, deque

import pytest
import torch

from dynvocab.kernels import (
    WindowState,
    window_push,
    window_push_reference,
)
from triton_modes import KERNEL_DEVICE, kernel_runs_here

VOCAB = 50


def random_pushes(steps: int, window: int, seed: int):
    """Push lengths from 0 to past the window; tokens from a small range, so duplicates are common."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        length = int(torch.randint(0, window + 1, (1,), generator=gen))
        if step % 9 == 4:
            length = window + int(torch.randint(1, 2 * window, (1,), generator=gen))
        high = 8 if step % 2 else VOCAB
        yield torch.randint(0, high, (length,), generator=gen)


def run_against_deque(state: WindowState, steps: int, seed: int) -> None:
    window = deque(maxlen=state.window)
    for tokens in random_pushes(steps, state.window, seed):
        n = min(tokens.numel(), state.window)
        empty = min(n, state.window - len(window))  # slots never written yet evict -1, then the oldest entries go
        expected_evicted = [-1] * empty + list(window)[: n - empty]
        evicted = state.push(tokens.to(state.ring.device))
        assert evicted.tolist() == expected_evicted
        window.extend(tokens.tolist())
        counts = Counter(window)
        expected = torch.tensor([counts[t] for t in range(VOCAB)], dtype=torch.int32)
        assert torch.equal(state.counts.cpu(), expected)
        assert state.filled == len(window)
        changed = torch.cat([evicted.long().clamp(min=0), tokens[-state.window:].to(evicted.device)])  # rechecked
        member = torch.tensor([counts[t] > 0 for t in changed.tolist()])
        assert torch.equal((state.counts[changed.to(state.counts.device)] > 0).cpu(), member)


@pytest.mark.parametrize("window", [1, 7, 32])
def test_torch_window_matches_deque(window):
    run_against_deque(WindowState(VOCAB, window=window, device="cpu", use_kernel=False), steps=60, seed=window)


@kernel_runs_here
@pytest.mark.parametrize("window", [7, 300])
def test_kernel_window_matches_deque(window):
    state = WindowState(VOCAB, window=window, device=KERNEL_DEVICE, use_kernel=True)
    run_against_deque(state, steps=30, seed=window + 1)


@kernel_runs_here
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_push_kernel_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    ring = torch.full((600,), -1, dtype=torch.int32)
    counts = torch.zeros(VOCAB, dtype=torch.int32)
    ring_k, counts_k = ring.to(KERNEL_DEVICE), counts.to(KERNEL_DEVICE)
    start = 0
    for length in (0, 1, 255, 256, 257, 600, 599, 33):
        tokens = torch.randint(0, 20, (length,), generator=gen, dtype=dtype)
        window_push_reference(ring, counts, tokens, start)
        window_push(ring_k, counts_k, tokens.to(KERNEL_DEVICE), start)
        start = (start + length) % ring.numel()
        assert torch.equal(ring_k.cpu(), ring) and torch.equal(counts_k.cpu(), counts)


def test_window_default_size_and_reset():
    state = WindowState(151936)
    assert state.window == 3072
    evicted = state.push(torch.arange(5000))
    assert evicted.tolist() == [-1] * 3072  # a push longer than the window keeps its last 3072 entries
    expected = torch.zeros(151936, dtype=torch.int32)
    expected[5000 - 3072 : 5000] = 1
    assert state.filled == 3072 and torch.equal(state.counts, expected)
    assert state.push(torch.tensor([7])).tolist() == [5000 - 3072]  # the oldest entry goes first
    state.reset()
    assert state.filled == 0 and int(state.counts.abs().sum()) == 0 and (state.ring == -1).all()
    assert state.push(torch.tensor([7])).tolist() == [-1]


def test_push_and_membership_never_read_the_device(monkeypatch):
    """No .item()/.tolist()/nonzero/bool() of a tensor in push or in the policies' membership test."""
    state = WindowState(VOCAB, window=16, use_kernel=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a device tensor")

    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    monkeypatch.setattr(torch, "nonzero", forbidden)
    for length in (3, 16, 40, 0, 9):
        tokens = torch.randint(0, VOCAB, (length,))
        evicted = state.push(tokens)
        member = state.counts[torch.cat([evicted.long().clamp(min=0), tokens])] > 0
    monkeypatch.undo()
    assert state.filled == 16 and member.shape == (9 + 9,)
