"""Row copies ``dst[dst_idx] = src[src_idx]`` with a Triton kernel beside its torch reference.

Only ``dynvocab bench --kernels`` calls it today (its ``repack`` row: refilling a packed buffer of head rows);
the runtime's packed head copies its rows with ``index_select`` (:class:`~dynvocab.runtime.head.PackedHead`).
"""

from __future__ import annotations

import torch

from dynvocab.kernels._triton import check_launchable, triton_available


def gather_rows_reference(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """Torch reference: ``dst[dst_idx] = src[src_idx]`` in place (``src`` [V, d], ``dst`` [cap, d], indices [k])."""
    dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))


def gather_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """Triton kernel: copy rows ``src[src_idx]`` [k, d] into ``dst[dst_idx]`` in place, without a temporary.

    ``dst_idx`` must not repeat a slot. Needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``.
    """
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1]:
        raise ValueError(f"src [V, d] and dst [cap, d] must share d; got {tuple(src.shape)}, {tuple(dst.shape)}")
    if src.dtype != dst.dtype:
        raise TypeError(f"src and dst dtypes differ: {src.dtype}, {dst.dtype}")
    if src_idx.dim() != 1 or src_idx.shape != dst_idx.shape:
        raise ValueError(f"src_idx and dst_idx must be [k]; got {tuple(src_idx.shape)}, {tuple(dst_idx.shape)}")
    if src_idx.dtype not in (torch.int32, torch.int64) or dst_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError("indices must be int32 or int64")
    if src.stride(1) != 1 or dst.stride(1) != 1 or not src_idx.is_contiguous() or not dst_idx.is_contiguous():
        raise ValueError("src and dst need unit stride along d, and the indices must be contiguous")
    check_launchable(src, dst, src_idx, dst_idx)
    import triton

    from dynvocab.kernels.gather_rows_triton import gather_rows_kernel

    k, d = src_idx.numel(), src.shape[1]
    if k == 0:
        return
    block_r, block_d = 4, min(triton.next_power_of_2(d), 1024)
    grid = (triton.cdiv(k, block_r), triton.cdiv(d, block_d))
    gather_rows_kernel[grid](
        src, dst, src_idx, dst_idx, k, d, src.stride(0), dst.stride(0), BLOCK_R=block_r, BLOCK_D=block_d
    )


def gather_rows_auto(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """``dst[dst_idx] = src[src_idx]`` in place: the Triton kernel on CUDA, the torch reference elsewhere."""
    if src.is_cuda and triton_available():
        gather_rows(src, src_idx, dst, dst_idx)
    else:
        gather_rows_reference(src, src_idx, dst, dst_idx)
