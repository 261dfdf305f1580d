"""Where a draft head's rows come from: the :class:`RowSource` protocol, chosen once at load by :func:`row_source`.

Two sources satisfy it: :class:`FloatRows` (the head's float weight, or a one-row copy in a step dtype) and
:class:`~dynvocab.models.prepack.Int8Rows` (int8 rows with per-row scales). The heads of
:mod:`dynvocab.runtime.head` read only the members below and never ask which source they read: ``linear`` (the full
head), ``gather`` (rows of given ids as the packed buffers hold them: float rows, or int8 rows with their scales),
``matmul`` (hidden states times gathered rows), ``ordered`` (the rows of a policy's fixed orders, kept across
sequences) and, where ``packs_prefixes``, ``prefix_linear`` (a kept fast path for a ranking's prefix). So an int8
draft's dynamic sets are multiplied as int8 rows where the CPU has a fast kernel for them
(:data:`~dynvocab.models.prepack.INT8_GATHERED`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from dynvocab.models.prepack import OrderedRows


@runtime_checkable
class RowSource(Protocol):
    """The rows [V, d] of a draft head, as every head reads them.

    Gathered rows come as ``(rows [n, d] in row_dtype, scales [n] or None, bias [n] or None)``: what the packed
    buffers keep and what :meth:`matmul` multiplies. Logits over gathered rows equal the full head's at those rows
    (up to the source's own rounding: int8 activations in fbgemm).
    """

    shape: torch.Size  # [V, d]
    device: torch.device  # where rows, ids and logits live
    dtype: torch.dtype  # what ``linear`` returns; hidden states are cast to it before any product
    row_dtype: torch.dtype  # the dtype of gathered rows (float, or int8 with scales)
    bias: torch.Tensor | None  # [V] or None
    packs_prefixes: bool  # whether ``prefix_linear`` may answer (else callers skip it: it would return None)
    ordered: OrderedRows  # rows of fixed id orders, gathered once and kept across sequences

    def linear(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the full head: hidden states [..., d] -> [..., V] in ``dtype``."""

    def gather(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Rows of token ids ``ids`` [n]: ``(rows [n, d], scales [n] or None, bias [n] or None)``."""

    def matmul(
        self, hidden: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits [m, n] of hidden states [m, d] over gathered ``rows`` (as :meth:`gather` returns them)."""

    def prefix_linear(self, hidden: torch.Tensor, order: torch.Tensor, n: int) -> torch.Tensor | None:
        """Logits [m, n] over the first ``n`` ids of the fixed ``order`` from a kept pack of them, or None (the caller
        multiplies its gathered rows): a ranking's prefix that lasts runs at the source's full-head speed."""

    def prefix_pack(self, order: torch.Tensor, n: int) -> None:
        """Prepare :meth:`prefix_linear`'s pack of the first ``n`` ids of ``order`` now (a policy's static ranking,
        at its build); nothing where the source keeps no packs."""


class FloatRows:
    """The head's rows as a float tensor ``weight`` [V, d] (and ``bias`` [V]): a :class:`RowSource`."""

    packs_prefixes = False  # no faster path than a slice of the packed buffer

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.shape, self.device, self.dtype = weight.shape, weight.device, weight.dtype
        self.row_dtype = weight.dtype
        self.ordered = OrderedRows(self)  # rows of fixed orders, kept across sequences

    def linear(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [m, V] in the rows' dtype."""
        return F.linear(hidden.to(self.dtype), self.weight, self.bias)

    def gather(self, ids: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        """Rows ``ids`` [n] -> ([n, d], no scales, bias [n] or None)."""
        return self.weight.index_select(0, ids), None, None if self.bias is None else self.bias.index_select(0, ids)

    def matmul(self, hidden: torch.Tensor, rows: torch.Tensor, scales: None, bias: torch.Tensor | None) -> torch.Tensor:
        """Logits [m, n] of hidden states [m, d] over gathered ``rows`` [n, d]."""
        return F.linear(hidden.to(rows.dtype), rows, bias)

    def prefix_linear(self, hidden: torch.Tensor, order: torch.Tensor, n: int) -> None:
        """None: a slice of the packed rows is the fast path for float rows."""
        return None

    def prefix_pack(self, order: torch.Tensor, n: int) -> None:
        """Nothing to pack for float rows."""


def row_source(weight: torch.Tensor | RowSource, bias: torch.Tensor | None = None) -> RowSource:
    """The row source of a draft head, chosen once at load: a tensor ``weight`` [V, d] (with ``bias``) becomes
    :class:`FloatRows`; a row source (int8 rows) is returned as it is."""
    return FloatRows(weight, bias) if isinstance(weight, torch.Tensor) else weight


def ordered_rows(source: RowSource, order: torch.Tensor) -> tuple[tuple, bool]:
    """``source``'s rows of the fixed ``order``, gathered on first use and kept on the source (:class:`OrderedRows`);
    returns ``(rows, scales, bias)`` and whether they were gathered now."""
    return source.ordered.get(order)


def prepare_order(source: RowSource, order: torch.Tensor, prefixes: tuple[int, ...] = ()) -> None:
    """Gather ``source``'s rows of ``order`` now and, where the source keeps packed prefixes (int8 rows multiplied
    through fbgemm, :attr:`~dynvocab.models.prepack.Int8Rows.packs_prefixes`), pack each prefix length in
    ``prefixes``: a policy's static ranking, so that its first draft step costs what every later one does."""
    ordered_rows(source, order)
    if source.packs_prefixes:
        for n in prefixes:
            source.prefix_pack(order, n)
