"""CPU float32 linears with prepared weight copies for the row counts MKL's sgemm handles badly.

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
    for one-row inputs, used before the packed one (the result is cast back). Inputs that need gradients (EvoSpec's LoRA training, which peft
    wraps around this layer as around any ``nn.Linear``) always take ``F.linear``. The copies are made once: the
    weight must not change afterwards.
    """

    def __init__(self, linear: nn.Linear, packed: bool = True, row_dtype: torch.dtype | None = None):
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
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
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PrepackedLinear(child, packed, row_dtype))
                replaced += 1
    return replaced
