"""CPU float32 linears with a oneDNN-prepacked weight copy for the few-row passes of speculative verification.

MKL's sgemm, which ``F.linear`` calls on CPU, is tuned for one row (decoding) and for many (prefill); with 2–16
rows it runs at a fraction of either, so a target pass over γ + 1 = 5 tokens costs ~3× a 1-token pass and eats the
gain of speculation. oneDNN's GEMM over a weight reordered once into its blocked layout does those passes 1.5–3×
faster (the demo target's 8960 × 1536 projection, 2 threads: 5 rows 12.6 → 3.7 ms). One-row passes keep
``F.linear`` (its GEMV is as fast or faster), so autoregressive decoding is unchanged, and so do passes of more than
``MAX_PACKED_ROWS`` rows, where MKL is as fast. The packed copy costs one more copy of every wrapped weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_PACKED_ROWS = 128  # above this MKL's sgemm is as fast as oneDNN's packed GEMM (prefill)
PACKING_HINT = 4  # the row count oneDNN tunes the packed layout for (γ + 1 with the default γ)


def prepack_supported(device: str, dtype: str) -> bool:
    """True where prepacking helps and works: float32 on a CPU with oneDNN in this torch build."""
    return (
        device == "cpu"
        and dtype == "float32"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PrepackedLinear(nn.Module):
    """An ``nn.Linear`` (same ``weight``/``bias``) that runs 2..``MAX_PACKED_ROWS``-row inputs on a packed copy."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKING_HINT)
        self._packed_bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, by the faster kernel for the number of rows in ``x``."""
        rows = x.numel() // self.in_features
        if rows < 2 or rows > MAX_PACKED_ROWS or x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(
            x.reshape(rows, self.in_features), self.packed, self._packed_bias, "none", [], ""
        )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        """Shown by ``print(model)``."""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` in ``model`` (body and output head) by a :class:`PrepackedLinear`.

    Returns how many were replaced. Only for models that are not trained afterwards (the target): the packed copy
    is not updated when the weight changes.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PrepackedLinear(child))
                replaced += 1
    return replaced
