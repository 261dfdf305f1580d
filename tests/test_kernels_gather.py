"""The row-gather kernel against its torch reference."""

import pytest
import torch

from dynvocab.kernels import gather_rows, gather_rows_reference
from triton_modes import KERNEL_DEVICES, needs_triton

VOCAB = 500


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
