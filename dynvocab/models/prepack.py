"""Linears with prepared weight copies: oneDNN packs and one-row dtype copies (:class:`PrepackedLinear`) for the row
counts MKL's sgemm handles badly, and int8 copies for a draft (:class:`Int8Linear`).

MKL's sgemm, which ``F.linear`` calls on CPU, runs 2–16 rows at a fraction of its speed for one row or for many
(prefill), so a target pass over γ + 1 = 5 tokens cost ~3× a 1-token pass and ate the gain of speculation.
oneDNN's GEMM over a weight reordered once into its blocked layout does those passes 1.5–3× faster (the demo
target's 8960 × 1536 projection, 2 threads: 5 rows 12.6 → 3.7 ms), and one-row passes too (3.8 → 1.7 ms; a whole
one-token pass of the demo target 455 → 322 ms), so plain decoding (``ar``) reads the packed copy as well and the
bench compares speculation against the fastest decoding this module gives. Passes of more than
``MAX_PACKED_ROWS`` rows (prefill) keep ``F.linear``, where MKL is as fast.

One-row passes are memory-bound. For the draft, whose dtype never changes the output, a bfloat16 copy of the weight
halves what each step reads (the demo draft, 2 threads: body 106 → 79 ms a step), while its prompt pass keeps the
float32 weight: on a CPU without native bf16 a bf16 GEMM runs at one-row speed per row, which made a bf16 draft's
prompt pass cost more than the target's.

A draft's int8 weights read a quarter of float32's bytes: :class:`Int8Linear` multiplies an int8 copy through
fbgemm at every row count (:mod:`dynvocab.models.int8` has the kernels and the measurements that chose them).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dynvocab.models.rows import Int8Rows

MAX_PACKED_ROWS = 128  # above this MKL's sgemm is as fast as oneDNN's packed GEMM (prefill)
PACKING_HINT = 4  # the row count oneDNN tunes the packed layout for (a typical verification pass)


def prepack_supported(device: str, dtype: str) -> bool:
    """True where prepacking helps and works: float32 on a CPU with oneDNN in this torch build."""
    return (
        device == "cpu"
        and dtype == "float32"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PrepackedLinear(nn.Linear):
    """An ``nn.Linear`` (the same ``weight``/``bias`` parameters) with optional prepared copies of its weight.

    ``packed``: a oneDNN-packed copy for inputs of 1..``MAX_PACKED_ROWS`` rows. ``row_dtype``: a copy in that dtype
    for one-row inputs, used before the packed one (the result is cast back). Inputs that need gradients (EvoSpec's
    LoRA training, which peft wraps around this layer as around any ``nn.Linear``) always take ``F.linear``. The
    copies are made once: the weight must not change afterwards.
    """

    def __init__(self, linear: nn.Linear, packed: bool = True, row_dtype: torch.dtype | None = None):
        _adopt(self, linear)
        bias = None if linear.bias is None else linear.bias.detach()
        with torch.no_grad():
            weight = linear.weight.detach()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_HINT) if packed else None
            self._packed_bias = bias
            self.row_weight = None if row_dtype is None else weight.to(row_dtype)
            self.row_bias = None if row_dtype is None or bias is None else bias.to(row_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, by the fastest prepared copy for the number of rows in ``x``."""
        if not x.requires_grad:
            rows = x.numel() // self.in_features
            if rows == 1 and self.row_weight is not None:
                return F.linear(x.to(self.row_weight.dtype), self.row_weight, self.row_bias).to(x.dtype)
            if self.packed is not None and 1 <= rows <= MAX_PACKED_ROWS:
                flat = x.reshape(rows, self.in_features)
                out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self._packed_bias, "none", [], "")
                return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def prepack_linears(model: nn.Module, packed: bool = True, row_dtype: torch.dtype | None = None) -> int:
    """Replace every plain ``nn.Linear`` in ``model`` (body and output head) by a :class:`PrepackedLinear`.

    Returns how many were replaced. Only for weights that stay fixed afterwards (LoRA adapters on top are fine).
    """
    return _replace_linears(model, lambda linear: PrepackedLinear(linear, packed, row_dtype))


class Int8Linear(nn.Linear):
    """An ``nn.Linear`` (the same float ``weight``/``bias`` parameters) whose passes read an int8 copy
    (:class:`Int8Rows`): a draft's linears, one-row steps and prompt pass alike (fbgemm was faster than float32 at
    every row count measured, 1–256). Inputs that need gradients (EvoSpec's LoRA training) take ``F.linear``
    over the float weight. The output is cast back to the input's dtype."""

    def __init__(self, linear: nn.Linear, keep_rows: bool = False):
        _adopt(self, linear)
        with torch.no_grad():
            self.int8 = Int8Rows(linear.weight, linear.bias, keep_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` with the int8 weight (float weight when ``x`` needs gradients)."""
        if x.requires_grad or x.numel() == 0:
            return F.linear(x, self.weight, self.bias)
        return self.int8.linear(x).to(x.dtype)


def quantize_linears(model: nn.Module, head: nn.Module | None = None) -> int:
    """Replace every plain ``nn.Linear`` in ``model`` (body and output head) by an :class:`Int8Linear`; returns how
    many. ``head``: the output head, which keeps its int8 rows for gathering. The weights must stay fixed
    afterwards (LoRA adapters on top are fine)."""
    return _replace_linears(model, lambda linear: Int8Linear(linear, keep_rows=linear is head))


def _adopt(module: nn.Linear, linear: nn.Linear) -> None:
    """Make ``module`` (a new linear, its ``nn.Linear.__init__`` skipped) hold ``linear``'s own ``weight``/``bias``
    parameters: prepared copies sit beside them, and training or saving sees the same tensors."""
    nn.Module.__init__(module)
    module.in_features, module.out_features = linear.in_features, linear.out_features
    module.weight, module.bias = linear.weight, linear.bias


def _replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every plain ``nn.Linear`` in ``model`` by ``make(linear)``; returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
                replaced += 1
    return replaced


def step_weight_bytes(model: nn.Module) -> int:
    """Bytes of the prepared copies in ``model``'s linears (int8 rows and packs, one-row dtype copies, oneDNN
    packs): what preparing the draft added beside its float weights."""
    total = 0
    for m in model.modules():
        if isinstance(m, Int8Linear):
            total += m.int8.nbytes
        elif isinstance(m, PrepackedLinear):
            for t in (m.packed, m.row_weight, m.row_bias):
                if t is not None:
                    total += t.numel() * t.element_size()
    return total
