"""Int8 draft weights: symmetric per-row quantization and the CPU kernels that multiply int8 rows.

The draft only proposes, so its weights may be anything that proposes well: the target verifies every token over
its own full vocabulary. Int8 weights with one scale per output row read a quarter of float32's bytes. Kernel,
chosen by measurement (scripts/int8_kernels.py; AMD EPYC, AVX2 only, 1 thread, ratios to float32 ``F.linear``
in one interleaved run): fbgemm's ``quantized::linear_dynamic`` over a prepacked weight (what
``quantize_dynamic`` runs, activations quantized per call inside the op) — 896→4864 0.46×, 4864→896 0.51×,
the 151,936-row head 0.30× at one row; 0.09–0.11× at 7 rows; 0.36–0.63× at 64–256 rows (the prompt pass).
oneDNN's ``qlinear_pointwise`` was 1.2–1.9× float32 at one row, ``aten._weight_int8pack_mm`` 3–7×,
``torch._int_mm`` 4–15×. The ops themselves do not warn in torch 2.13; only creating the quantized weight
tensor they take does (quantized tensor creation is deprecated), so that one warning is silenced here.

The row source over int8 rows is :class:`~dynvocab.models.rows.Int8Rows`; the linear that steps through them is
:class:`~dynvocab.models.prepack.Int8Linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8 = "int8"  # the draft-weights value for int8 (the others are dtype names)
INT8_SCALE_FLOOR = 1e-12  # a row of zeros keeps a finite scale


def int8_supported(device: str) -> bool:
    """True where int8 draft weights run: a CPU whose torch build has fbgemm's dynamic quantized linear."""
    return (
        device == "cpu"
        and "fbgemm" in torch.backends.quantized.supported_engines
        and hasattr(torch.ops.quantized, "linear_dynamic")
    )


def default_draft_weights(device: str, dtype: str) -> str:
    """The draft-weights value when none is given: int8 wherever fbgemm runs it (measured faster on AVX2 and on
    AVX-512 BF16, docs/bench.md), else the model dtype."""
    return INT8 if int8_supported(device) else dtype


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``(q [out, in] int8, scale [out] float32)`` with ``weight ≈ q * scale[:, None]``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=INT8_SCALE_FLOOR) / 127.0  # [out]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # [out, in]
    return q, scale


def fbgemm_pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's packed form of int8 rows ``q`` [out, in] with per-row ``scale`` [out] (and float32 ``bias``)."""
    import warnings

    zeros = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
    return torch.ops.quantized.linear_prepack(qw, bias)


def _int8_gathered_matmul() -> bool:
    """True where gathered int8 rows are multiplied as int8: a CPU with AVX-512 BF16, where
    ``aten._weight_int8pack_mm`` (int8 rows, per-row bfloat16 scales, bfloat16 activations) ran a one-row product
    over 2,048–4,096 gathered rows 5–25× faster than the float32 copy of the same rows (AMD EPYC, 2 threads:
    151,936 × 896 head, 4,096 rows: 0.11 ms with the int8 gather against 0.60 ms; docs/bench.md). Elsewhere (AVX2)
    that kernel ran 3–7× slower than float32 ``F.linear`` at one row, so gathered rows stay float32 there."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe()) and hasattr(torch, "_weight_int8pack_mm")


INT8_GATHERED = _int8_gathered_matmul()
INT8PACK_WIDTH = 16  # ``aten._weight_int8pack_mm`` needs rows of a multiple of 16 values: at widths 8, 24 and 40 it
# returned wrong products and at 12 it crashed (torch 2.13, AMD EPYC with AVX-512 BF16); 16 to 272 matched float32


def batched_int8_rows(weight: torch.Tensor, bias: torch.Tensor | None):
    """``x [m, in] -> x @ W.T + bias`` [m, out] float32 over ``weight`` quantized to int8 rows (per-row scales),
    every row of ``x`` in one ``aten._weight_int8pack_mm`` call (bfloat16 activations, not quantized), so a row's
    product is the same bits alone or beside others, and its cost per row falls as rows are added (151,936 × 256
    rows, 2 threads: 1.2 ms at one row, 4.9 ms at eight; fbgemm, which quantizes its input with one scale per call
    and so must run one row per call, 1.9 and 16.6 ms). None where that kernel does not run here (no AVX-512 BF16,
    or a width it cannot take)."""
    if not INT8_GATHERED or weight.shape[1] % INT8PACK_WIDTH or weight.device.type != "cpu":
        return None
    q, scale = quantize_rows(weight)
    scales = scale.to(torch.bfloat16)
    bias = None if bias is None else bias.detach().float()

    def linear(x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scales).float()
        return out if bias is None else out + bias

    return linear


def _vnni() -> bool:
    """True on a CPU with AVX-512 VNNI, where fbgemm sums u8·s8 products straight into int32."""
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    return bool(probe and probe())


# 7-bit activations (``reduce_range``) where fbgemm's u8·s8 pairs sum in int16 and could saturate (AVX2, AVX-512
# without VNNI: what ``quantize_dynamic`` assumes on x86); 8-bit where VNNI accumulates in int32. Measured on the
# demo draft (AVX-512 BF16 + VNNI, teacher-forced over the target's greedy continuations of the 16 bench prompts):
# the draft's argmax equalled the target's next token at 88.1% with 7-bit activations, 89.3% with 8-bit, 89.4% in
# bfloat16 (docs/bench.md).
REDUCE_RANGE = not _vnni()


def linear_dynamic(x: torch.Tensor, packed, shape: tuple[int, int]) -> torch.Tensor:
    """``x [..., in]`` times fbgemm's ``packed`` int8 weight of ``shape`` (out, in) -> [..., out] float32, the
    activations quantized inside the op (to 7 or 8 bits: :data:`REDUCE_RANGE`)."""
    out_f, in_f = shape
    flat = x.reshape(-1, in_f).float()  # [m, in]
    out = torch.ops.quantized.linear_dynamic(flat, packed, REDUCE_RANGE)  # [m, out]
    return out.view(*x.shape[:-1], out_f)


def gathered_matmul(
    x: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x [m, in] @ (rows * scales[:, None]).T + bias`` -> [m, n] float32: int8 ``rows`` with bfloat16 ``scales``
    through ``aten._weight_int8pack_mm`` (bfloat16 activations, one call per row of ``x``: the kernel ran 4-row
    inputs slower than four 1-row calls here), float ``rows`` (``scales`` None) through ``F.linear``."""
    if scales is None:
        return F.linear(x.to(rows.dtype), rows, bias).float()
    xb = x.to(torch.bfloat16)
    if xb.shape[0] == 1:
        out = torch._weight_int8pack_mm(xb, rows, scales).float()
    else:
        out = torch.cat([torch._weight_int8pack_mm(r[None], rows, scales) for r in xb]).float()
    return out if bias is None else out + bias
