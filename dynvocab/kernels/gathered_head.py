"""Logits over an index list of LM-head rows: ``logits[m, j] = h[m] · W[idx[j]]``, without a gathered copy of W.

Three entry points, following the project's kernel convention:

- ``gathered_logits``: the thin wrapper that checks shapes, dtypes and strides, allocates the float32 output and
  launches the Triton kernel (``gathered_head_triton``) with an explicit grid.
- ``gathered_logits_reference``: the torch version (``index_select`` + matmul), used by the tests and as the CPU
  path.
- ``gathered_logits_auto``: the kernel for CUDA tensors, the reference otherwise.

Row ids are not bounds-checked by the kernel (that would need a device sync); the reference raises on ids
outside ``[0, V)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynvocab.kernels._triton import check_launchable, interpreting, triton_available

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_operands(h: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> None:
    if h.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"h must be [M, d] and weight [V, d]; got {tuple(h.shape)} and {tuple(weight.shape)}")
    if h.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: h has d={h.shape[1]}, weight has d={weight.shape[1]}")
    if idx.dim() != 1:
        raise ValueError(f"idx must be [n]; got shape {tuple(idx.shape)}")
    if h.dtype not in FLOAT_DTYPES or weight.dtype != h.dtype:
        raise TypeError(f"h and weight must share a float dtype in {FLOAT_DTYPES}; got {h.dtype}, {weight.dtype}")
    if idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"idx must be int32 or int64; got {idx.dtype}")
    if h.stride(1) != 1 or weight.stride(1) != 1 or not idx.is_contiguous():
        raise ValueError("h and weight need unit stride along d, and idx must be contiguous")
    if not (h.device == weight.device == idx.device):
        raise ValueError(f"tensors on different devices: {h.device}, {weight.device}, {idx.device}")


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` must run on float32 operands: float32 inputs (exact, not TF32), and bfloat16 under the
    interpreter, whose ``tl.dot`` multiplies bfloat16 bit patterns (triton-lang/triton#11584, unsupported there)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def gathered_logits_reference(h: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``h`` [M, d] @ ``weight[idx]`` [n, d]ᵀ → float32 [M, n] (matmul in the input dtype)."""
    return F.linear(h, weight.index_select(0, idx)).float()  # [M, n]


def gathered_logits(h: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Fused Triton kernel: float32 logits [M, n] of hidden states ``h`` [M, d] over rows ``idx`` [n] of ``weight``.

    Reads ``weight[idx]`` directly (no gathered copy), accumulates in float32. Needs CUDA tensors, or CPU tensors
    with ``TRITON_INTERPRET=1``.
    """
    _check_operands(h, weight, idx)
    check_launchable(h, weight, idx)
    import triton

    from dynvocab.kernels.gathered_head_triton import gathered_logits_kernel

    m, d = h.shape
    n = idx.numel()
    out = torch.empty(m, n, dtype=torch.float32, device=h.device)  # [M, n]
    if m == 0 or n == 0:
        return out

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))

    gathered_logits_kernel[grid](
        h, weight, idx, out,
        m, n, d,
        h.stride(0), weight.stride(0), out.stride(0),
        triton.next_power_of_2(m), triton.next_power_of_2(n),
        DOT_FP32=_dot_in_fp32(h.dtype),
    )
    return out


def gathered_logits_auto(h: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Float32 logits [M, n] over rows ``idx`` [n]: the fused kernel on CUDA, the torch reference elsewhere."""
    if h.is_cuda and triton_available():
        return gathered_logits(h, weight, idx)
    return gathered_logits_reference(h, weight, idx)

