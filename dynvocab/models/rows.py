"""Where a draft head's rows come from: the :class:`RowSource` protocol, chosen once at load by :func:`row_source`.

Two sources satisfy it: :class:`FloatRows` (the head's float weight, or a one-row copy in a step dtype) and
:class:`Int8Rows` (int8 rows with per-row scales; also what :class:`~dynvocab.models.prepack.Int8Linear` multiplies,
which is why the sources live here, below the runtime's heads and beside the linears). The heads of
:mod:`dynvocab.runtime.heads.head` read only the members below and never ask which source they read: ``linear`` (the
full head), ``gather`` (rows of given ids as the packed buffers hold them: float rows, or int8 rows with their
scales), ``matmul`` (hidden states times gathered rows), ``ordered`` (:class:`OrderedRows`: the rows of a policy's
fixed orders, kept across sequences) and, where ``packs_prefixes``, ``prefix_linear`` (a kept fast path for a
ranking's prefix). So an int8 draft's dynamic sets are multiplied as int8 rows where the CPU has a fast kernel for
them (:data:`~dynvocab.models.int8.INT8_GATHERED`; the kernels are in :mod:`dynvocab.models.int8`).
"""
from __future__ import annotations

import copy
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from dynvocab.models.int8 import INT8_GATHERED, fbgemm_pack, gathered_matmul, linear_dynamic, quantize_rows


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


class OrderedRows:
    """A row source's rows of fixed orders, gathered once and kept across sequences (a few, least recently used
    dropped): a ranking (FR-Spec), DynaSpec's cluster order, the centroid blocks. An order is recognised by its
    tensor, or by its ids when a policy built anew for the next prompt holds the same order in a new tensor."""

    KEEP = 4

    def __init__(self, source):
        self.source = source
        self._kept: list[tuple[torch.Tensor, tuple]] = []  # (order, (rows, scales, bias)), most recent last

    def get(self, order: torch.Tensor) -> tuple[tuple, bool]:
        """``((rows [N, d], scales [N] or None, bias [N] or None), copied)`` for ``order`` [N]."""
        for i, (kept, rows) in enumerate(self._kept):
            if kept is order or (kept.shape == order.shape and torch.equal(kept, order)):
                self._kept.append(self._kept.pop(i))
                return rows, False
        rows = self.source.gather(order)
        self._kept.append((order, rows))
        if len(self._kept) > self.KEEP:
            self._kept.pop(0)
        return rows, True


class Int8Rows:
    """A weight [out, in] as int8 rows with per-row float32 scales: a whole-matrix product through fbgemm, and any
    subset of rows gathered for a head over an active set.

    ``linear(x)``: ``x @ W_q.T + bias`` for any number of rows (fbgemm, float32 out). ``gather(ids)``: the rows
    ``q[ids] * scale[ids]`` dequantized to float32 [n, in] and their bias — the same values ``linear`` multiplies,
    so a head over a subset computes what the full head computes at those rows (up to fbgemm's activation
    rounding). Gathered rows are kept as int8 with bfloat16 scales and multiplied by ``aten._weight_int8pack_mm``
    where the CPU has AVX-512 BF16 (``gathers_int8``, :data:`~dynvocab.models.int8.INT8_GATHERED`), else
    dequantized to float32.
    ``prefix_linear(x, order, n)`` (float32 gathers only): the first ``n`` rows of a fixed order (a ranking's
    prefix, FR-Spec), packed for fbgemm once per ``(order, n)`` and kept (a few, least recently used dropped), so a
    static set runs at int8 speed; a set that changes every cycle is multiplied as gathered float32 rows instead,
    because packing costs far more than a step (3,072 rows: ~14 ms to pack against ~0.9 ms for a float32 product,
    AVX2). With int8 gathers a prefix is a slice of the packed int8 rows and needs no such copy.
    """

    PREFIX_PACKS = 8

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_rows: bool = False):
        """``keep_rows``: keep the int8 rows beside fbgemm's packed copy (a head that gathers rows); else they are
        unpacked from it on the first gather (seconds for a vocabulary of rows)."""
        q, self.scale = quantize_rows(weight)  # [out, in] int8, [out] float32
        self.shape = q.shape  # [out, in]
        self.device = q.device
        self.bias = None if bias is None else bias.detach().float()  # [out]
        self.packed = fbgemm_pack(q, self.scale, self.bias)
        self._q: torch.Tensor | None = q if keep_rows else None  # int8 rows: kept, or unpacked when a gather needs them
        self._prefix_packs: dict = {}  # (id(order), n) -> (order, packed); insertion order = use order
        self._prefix_uses: dict = {}  # (id(order), n) -> (order, calls) for prefixes not packed yet
        self.ordered = OrderedRows(self)  # rows of fixed orders, kept across sequences (shared by ``first`` views)
        self.limit = self.shape[0]  # rows ``linear`` returns (a draft trims padded head rows)

    gathers_int8 = INT8_GATHERED  # gathered rows stay int8 (see :data:`~dynvocab.models.int8.INT8_GATHERED`)
    PACK_AFTER = 32  # calls over one prefix before it is packed: packing costs ~30 float32 steps over its rows

    @property
    def packs_prefixes(self) -> bool:
        """Whether ``prefix_linear`` may answer: only where gathered rows are float32 (an int8 slice is as fast)."""
        return not self.gathers_int8

    @property
    def row_dtype(self) -> torch.dtype:
        """The dtype of gathered rows: int8, or float32 where they are dequantized."""
        return torch.int8 if self.gathers_int8 else torch.float32

    def first(self, rows: int) -> "Int8Rows":
        """The same rows (shared, nothing copied), with ``linear`` returning only the first ``rows`` columns."""
        view = copy.copy(self)
        view.limit = rows
        return view

    @property
    def q(self) -> torch.Tensor:
        """The int8 rows [out, in] (kept only for a head that gathers rows: a body linear never asks)."""
        if self._q is None:
            self._q = self.packed.unpack()[0].int_repr()
        return self._q

    dtype = torch.float32  # what ``linear`` returns and ``gather`` dequantizes to

    @property
    def nbytes(self) -> int:
        """Bytes held: fbgemm's packed int8 copy, the scales and bias, and the unpacked int8 rows once a gather
        needed them (a head's)."""
        out, inp = self.shape
        extra = 0 if self.bias is None else self.bias.numel() * 4
        rows = 0 if self._q is None else self._q.numel()
        return out * inp + rows + self.scale.numel() * 4 + extra

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] @ W.T + bias`` -> [..., out] float32 (the first ``limit`` columns)."""
        out = linear_dynamic(x, self.packed, self.shape)
        return out if self.limit == self.shape[0] else out[..., : self.limit]

    def gather(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Rows ``ids`` [n] as the heads keep them: ``(rows [n, in], scales [n] or None, bias [n] or None)`` —
        int8 rows with bfloat16 scales where ``gathers_int8``, else dequantized float32 rows and no scales."""
        bias = None if self.bias is None else self.bias.index_select(0, ids)
        if self.gathers_int8:
            return self.q.index_select(0, ids), self.scale.index_select(0, ids).to(torch.bfloat16), bias
        rows = self.q.index_select(0, ids).float().mul_(self.scale.index_select(0, ids)[:, None])
        return rows, None, bias

    def matmul(
        self, x: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [m, in]`` times gathered ``rows`` (as :meth:`gather` returns them) -> [m, n] float32."""
        return gathered_matmul(x, rows, scales, bias)

    def prefix_pack(self, order: torch.Tensor, n: int) -> None:
        """Pack the first ``n`` rows of ``order`` for fbgemm now (a policy's static ranking, at its build), so
        :meth:`prefix_linear` answers from the first call."""
        key = (id(order), n)  # the entry holds ``order``: its id is not reused while the key is kept
        if key in self._prefix_packs or _take_same(self._prefix_packs, order, n) is not None:
            return
        self._prefix_uses.pop(key, None)
        self._store_pack(key, order, n)

    def _store_pack(self, key: tuple, order: torch.Tensor, n: int):
        ids = order[:n]
        bias = None if self.bias is None else self.bias.index_select(0, ids)
        packed = fbgemm_pack(self.q.index_select(0, ids), self.scale.index_select(0, ids), bias)
        if len(self._prefix_packs) >= self.PREFIX_PACKS:
            self._prefix_packs.pop(next(iter(self._prefix_packs)))
        self._prefix_packs[key] = (order, packed)
        return packed

    def prefix_linear(self, x: torch.Tensor, order: torch.Tensor, n: int) -> torch.Tensor | None:
        """``x @ W[order[:n]].T (+ bias)`` -> [m, n] float32 from a packed copy kept for ``(order, n)``; None (the
        caller multiplies its gathered rows) until that prefix has been asked for ``PACK_AFTER`` times — a set
        that changes every cycle never is, a ranking's prefix (FR-Spec) soon is, and stays packed across
        sequences, also when the next sequence's policy holds the same ids in a new tensor (whose calls count on)."""
        key = (id(order), n)  # the entry holds ``order``: its id is not reused while the key is kept
        hit = self._prefix_packs.pop(key, None)
        counted = self._prefix_uses.pop(key, None)
        if hit is None and counted is None:  # a tensor not seen before: the same ids may be known under another
            hit = _take_same(self._prefix_packs, order, n)
            counted = None if hit is not None else _take_same(self._prefix_uses, order, n)
        if hit is None:
            _, uses = counted or (order, 0)
            if uses + 1 < self.PACK_AFTER:
                self._prefix_uses[key] = (order, uses + 1)
                if len(self._prefix_uses) > 64:
                    self._prefix_uses.pop(next(iter(self._prefix_uses)))
                return None
            hit = (order, self._store_pack(key, order, n))
        self._prefix_packs[key] = (order, hit[1])
        return linear_dynamic(x, hit[1], (n, self.shape[1]))


def _take_same(table: dict, order: torch.Tensor, n: int) -> tuple | None:
    """Remove and return the entry of ``table`` (``(id(order), n) -> (order, …)``) kept for the same ``n`` ids under
    another tensor: a policy built anew for the next prompt holds the same ranking in a new tensor, and its prefix
    keeps its use count and its pack. None if there is none."""
    for key, entry in list(table.items()):
        if key[1] == n and torch.equal(entry[0][:n], order[:n]):
            del table[key]
            return entry
    return None


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
    through fbgemm, :attr:`Int8Rows.packs_prefixes`), pack each prefix length in ``prefixes``: a policy's static
    ranking, so that its first draft step costs what every later one does."""
    ordered_rows(source, order)
    if source.packs_prefixes:
        for n in prefixes:
            source.prefix_pack(order, n)
