"""What a draft's steps read: its linears' prepared copies (int8, a one-row dtype copy, oneDNN packs) and its head
rows in the same form, decided once at load, in one place, for every draft kind.

The draft only proposes, so none of this changes the output (:mod:`dynvocab.models.prepack` measures each form).
"""

from __future__ import annotations

import torch

from dynvocab.errors import DynvocabError
from dynvocab.models import parse_dtype
from dynvocab.models.int8 import INT8, default_draft_weights, int8_supported
from dynvocab.models.prepack import Int8Linear, PrepackedLinear, prepack_linears, quantize_linears, step_weight_bytes
from dynvocab.models.rows import Int8Rows


def prepare_draft_weights(
    model: torch.nn.Module, head: torch.nn.Module | None, wanted: str | None, device: str, dtype: str, prepacked: bool
) -> str:
    """Give the draft's linears (body and ``head``, so ``hf-assisted`` steps the same way) their prepared copies:
    int8 (``head`` keeps its int8 rows for gathering), or a one-row copy in a dtype (and oneDNN packs where the
    session ``prepacked`` the target); returns the draft-weights value in force (``wanted``, or the machine's
    default by measurement when None)."""
    weights = wanted or default_draft_weights(device, dtype)
    if weights == INT8:
        if not int8_supported(device):
            raise DynvocabError("--draft-weights int8 needs a CPU whose torch has fbgemm; pass --draft-weights bfloat16")
        quantize_linears(model, head)
        return weights
    row_dtype = None if weights == dtype else parse_dtype(weights)
    if prepacked or row_dtype is not None:
        prepack_linears(model, packed=prepacked, row_dtype=row_dtype)
    return weights


def module_rows(head: torch.nn.Module, rows: int | None = None) -> tuple[torch.Tensor | Int8Rows, torch.Tensor | None]:
    """The rows (and bias) a draft step multiplies for the linear ``head``'s first ``rows`` rows (all: None): its
    int8 rows (bias inside) when it was quantized, its one-row copy when it was prepared with one, else its weight.
    The one place a head module's weight format is read."""
    n = rows or head.weight.shape[0]
    if isinstance(head, Int8Linear):
        return head.int8.first(n), None
    if isinstance(head, PrepackedLinear) and head.row_weight is not None:
        return head.row_weight[:n], None if head.row_bias is None else head.row_bias[:n]
    bias = getattr(head, "bias", None)
    return head.weight[:n].detach(), None if bias is None else bias[:n].detach()


def tensor_rows(
    weight: torch.Tensor, bias: torch.Tensor | None, weights: str | None = None
) -> tuple[torch.Tensor | Int8Rows, torch.Tensor | None]:
    """Step rows for a head that is a tensor, not a module of the draft (EAGLE-1 reads the target's head): int8
    rows of it with per-row scales when the draft's weights are int8 (a copy the draft owns), a copy in the step
    dtype when that differs, else (and for ``weights`` None) the tensor itself."""
    if weights is None:
        return weight, bias
    if weights == INT8:
        return Int8Rows(weight, bias, keep_rows=True), None
    dtype = parse_dtype(weights)
    if dtype == weight.dtype:
        return weight, bias
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def draft_bytes(model: torch.nn.Module, extra: int = 0) -> dict:
    """What the draft holds in memory: ``weights`` (its own parameters; an EAGLE-1 head's shared embeddings
    included), ``prepared`` (the copies its steps read: int8 rows and packs, one-row dtype copies, oneDNN packs,
    plus ``extra``), and ``total``."""
    seen, weights = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    prepared = step_weight_bytes(model) + extra
    return {"weights": weights, "prepared": prepared, "total": weights + prepared}
