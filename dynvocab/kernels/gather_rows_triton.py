"""Triton kernel that copies selected rows of W into selected slots of a packed buffer (imported lazily)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_rows_kernel(
    src_ptr,  # [V, d] source rows (the LM-head weight), unit stride along d
    dst_ptr,  # [cap, d] packed buffer, unit stride along d
    src_idx_ptr,  # [k] source row of each copy
    dst_idx_ptr,  # [k] destination slot of each copy
    k,
    d,
    stride_src,
    stride_dst,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_r = offs_r < k
    mask = mask_r[:, None] & (offs_d < d)[None, :]
    src_rows = tl.load(src_idx_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)  # [BLOCK_R]
    dst_rows = tl.load(dst_idx_ptr + offs_r, mask=mask_r, other=0).to(tl.int64)  # [BLOCK_R]
    rows = tl.load(src_ptr + src_rows[:, None] * stride_src + offs_d[None, :], mask=mask)  # [BLOCK_R, BLOCK_D]
    tl.store(dst_ptr + dst_rows[:, None] * stride_dst + offs_d[None, :], rows, mask=mask)
