"""Triton kernel for logits over an index list of LM-head rows (imported lazily by ``gathered_head``).

The kernel reads the needed rows of ``W`` straight from the full weight (no gathered copy), accumulate in
float32 and write float32 logits. A program owns ``BLOCK_N`` entries of the index list and ``BLOCK_M`` hidden
states and walks the hidden dimension in ``BLOCK_K`` steps. Small ``BLOCK_M`` (chain drafting, M = 1) uses a
broadcast-multiply-reduce (a GEMV: the step is bound by reading W rows); ``BLOCK_M >= 16`` uses ``tl.dot`` so
tree/batch drafting reads each W tile once for many hidden states.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dynvocab.kernels._triton import interpreting


def _config(block_m: int, block_n: int, block_k: int, warps: int = 4, stages: int = 2) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages
    )


# Ordered so that the first config of each BLOCK_M is the smallest: under the interpreter only that one runs,
# and its blocks are small enough that tests hit the masked tails on every axis. None spills registers
# on sm_80 or sm_90 in any dtype (checked with cuobjdump -res-usage; tests/test_kernels_compile.py keeps a few).
GATHERED_CONFIGS = [
    _config(1, 16, 64), _config(1, 32, 128), _config(1, 64, 128), _config(1, 128, 64),
    _config(1, 128, 128, warps=8), _config(1, 256, 64, warps=8),
    _config(4, 16, 64), _config(4, 32, 64), _config(4, 32, 128), _config(4, 64, 64, warps=8),
    _config(16, 32, 64), _config(16, 64, 64), _config(16, 64, 128), _config(16, 128, 64, warps=8),
    _config(32, 32, 64, stages=3), _config(32, 64, 32, stages=3),
    _config(64, 32, 32, stages=3), _config(64, 64, 32, warps=8, stages=3),
]


def _block_m_choices(m: int) -> tuple[int, ...]:
    """BLOCK_M values worth trying for M hidden states (tiles much taller than M only waste work)."""
    if m == 1:
        return (1,)
    if m <= 4:
        return (4, 16)
    if m <= 16:
        return (16,)
    return (16, 32, 64)


def prune_gathered_configs(configs, named_args, **kwargs):
    """Keep the configs whose BLOCK_M suits M; under the interpreter keep only the first (no benchmarking)."""
    keep = [c for c in configs if c.kwargs["BLOCK_M"] in _block_m_choices(named_args["M"])]
    return keep[:1] if interpreting() else keep


@triton.autotune(
    configs=GATHERED_CONFIGS,
    key=["M_BUCKET", "N_BUCKET", "d"],
    prune_configs_by={"early_config_prune": prune_gathered_configs},
)
@triton.jit
def gathered_logits_kernel(
    h_ptr,  # [M, d] hidden states, unit stride along d
    w_ptr,  # [V, d] LM-head weight, unit stride along d
    idx_ptr,  # [n] row ids into W
    out_ptr,  # [M, n] float32 logits
    M,
    n,
    d,
    stride_h,
    stride_w,
    stride_out,
    M_BUCKET,  # next power of two of M: an autotune key only
    N_BUCKET,  # next power of two of n: an autotune key only
    DOT_FP32: tl.constexpr,  # tl.dot in exact fp32 (no TF32): float32 inputs, or bf16 under the interpreter
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    mask_n = offs_n < n
    mask_m = offs_m < M
    rows = tl.load(idx_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)  # [BLOCK_N]
    w_row_ptr = w_ptr + rows[:, None] * stride_w  # [BLOCK_N, 1]
    h_row_ptr = h_ptr + offs_m[:, None].to(tl.int64) * stride_h  # [BLOCK_M, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        mask_k = offs_k < d
        w = tl.load(w_row_ptr + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BN, BK]
        h = tl.load(h_row_ptr + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        if BLOCK_M >= 16:
            if DOT_FP32:
                acc += tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(h, tl.trans(w))
        else:
            prod = h.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BM, BN, BK]
            acc += tl.sum(prod, axis=2)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])

