"""The fused gathered-head kernel against its torch reference (CPU under TRITON_INTERPRET=1, or CUDA)."""

import pytest
import torch

from dynvocab.kernels import (
    gathered_logits,
    gathered_logits_auto,
    gathered_logits_reference,
)
from triton_modes import KERNEL_DEVICES, needs_cuda, needs_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Against the float64 truth the kernels only add float32 summation error; the references round to the dtype.
TRUTH_TOL = dict(rtol=1e-4, atol=1e-4)
REF_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=5e-2),
           torch.float16: dict(rtol=2e-3, atol=1e-2)}
VOCAB = 300


def operands(m, n, d, dtype, device, seed=0, row_stride=None):
    """h [m, d], weight [VOCAB, d] (rows ``row_stride`` apart when given), idx [n] with repeats."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(m, d, generator=gen).to(device, dtype)
    stride = row_stride or d
    weight = torch.randn(VOCAB, stride, generator=gen).to(device, dtype)[:, :d]
    idx = torch.randint(0, VOCAB, (n,), generator=gen).to(device)
    return h, weight, idx


def truth(h, weight, idx):
    return (h.double() @ weight.double()[idx.long()].T).float()


@needs_triton
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,d", [(1, 64), (37, 96), (200, 96), (130, 40)])
def test_gathered_logits_matches_reference(device, dtype, m, n, d):
    h, weight, idx = operands(m, n, d, dtype, device)
    out = gathered_logits(h, weight, idx)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, truth(h, weight, idx), **TRUTH_TOL)
    torch.testing.assert_close(out, gathered_logits_reference(h, weight, idx), **REF_TOL[dtype])


@needs_triton
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("m", [20, 64])
def test_gathered_logits_many_hidden_states(device, m):
    """Tree/batch drafting: several BLOCK_M tiles of hidden states, strided weight rows, int32 ids."""
    h, weight, idx = operands(m, 77, 96, torch.bfloat16, device, row_stride=128)
    out = gathered_logits(h, weight, idx.int())
    torch.testing.assert_close(out, truth(h, weight, idx), **TRUTH_TOL)


@needs_triton
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_gathered_logits_empty(device):
    h, weight, idx = operands(2, 0, 64, torch.float32, device)
    assert gathered_logits(h, weight, idx).shape == (2, 0)


@needs_triton
def test_gathered_logits_rejects_bad_operands():
    h, weight, idx = operands(2, 5, 64, torch.float32, "cpu")
    with pytest.raises(TypeError):
        gathered_logits(h.half(), weight, idx)
    with pytest.raises(TypeError):
        gathered_logits(h, weight, idx.float())
    with pytest.raises(ValueError):
        gathered_logits(h[:, :32], weight, idx)
    with pytest.raises(ValueError):
        gathered_logits(h.t().contiguous().t(), weight, idx)
    with pytest.raises(ValueError):
        gathered_logits(h, weight, idx.view(1, -1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_auto_matches_truth_on_every_device(device):
    h, weight, idx = operands(3, 50, 96, torch.float32, device)
    torch.testing.assert_close(gathered_logits_auto(h, weight, idx).cpu(), truth(h, weight, idx).cpu(), **TRUTH_TOL)


@needs_triton
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_range_head_fused_matches_one_matmul_per_range(device):
    from dynvocab.runtime.heads.active_set import RowRanges, merge_ranges
    from dynvocab.runtime.heads.head import RangeHead

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(VOCAB, 32, generator=g).to(device)  # [V, d]
    order = torch.randperm(VOCAB, generator=g).to(device)  # [V] e.g. grouped by cluster
    h = torch.randn(2, 32, generator=g).to(device)  # [M, d]
    fused, loop = RangeHead(weight, fused=True), RangeHead(weight, fused=False)
    for starts, ends in [([0, 40, 90], [10, 60, 91]), ([5], [VOCAB]), ([], [])]:
        ranges = RowRanges(order, *merge_ranges(starts, ends))
        (a, ids_a), (b, ids_b) = fused.logits(h, ranges), loop.logits(h, ranges)
        assert torch.equal(ids_a, ids_b) and a.shape == (2, ranges.size)
        torch.testing.assert_close(a, b, **REF_TOL[torch.float32])
