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

import copy

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


# --- int8 draft weights -------------------------------------------------------------------------------------------
#
# The draft only proposes, so its weights may be anything that proposes well: the target verifies every token over
# its own full vocabulary. Int8 weights with one scale per output row read a quarter of float32's bytes. Kernel,
# chosen by measurement (scripts/int8_kernels.py; AMD EPYC, AVX2 only, 1 thread, ratios to float32 ``F.linear``
# in one interleaved run): fbgemm's ``quantized::linear_dynamic`` over a prepacked weight (what
# ``quantize_dynamic`` runs, activations quantized per call inside the op) — 896→4864 0.46×, 4864→896 0.51×,
# the 151,936-row head 0.30× at one row; 0.09–0.11× at 7 rows; 0.36–0.63× at 64–256 rows (the prompt pass).
# oneDNN's ``qlinear_pointwise`` was 1.2–1.9× float32 at one row, ``aten._weight_int8pack_mm`` 3–7×,
# ``torch._int_mm`` 4–15×. The ops themselves do not warn in torch 2.13; only creating the quantized weight
# tensor they take does (quantized tensor creation is deprecated), so that one warning is silenced here.

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


def _fbgemm_pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's packed form of int8 rows ``q`` [out, in] with per-row ``scale`` [out] (and float32 ``bias``)."""
    import warnings

    zeros = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
    return torch.ops.quantized.linear_prepack(qw, bias)


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


def _int8_gathered_matmul() -> bool:
    """True where gathered int8 rows are multiplied as int8: a CPU with AVX-512 BF16, where
    ``aten._weight_int8pack_mm`` (int8 rows, per-row bfloat16 scales, bfloat16 activations) ran a one-row product
    over 2,048–4,096 gathered rows 5–25× faster than the float32 copy of the same rows (AMD EPYC, 2 threads:
    151,936 × 896 head, 4,096 rows: 0.11 ms with the int8 gather against 0.60 ms; docs/bench.md). Elsewhere (AVX2)
    that kernel ran 3–7× slower than float32 ``F.linear`` at one row, so gathered rows stay float32 there."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe()) and hasattr(torch, "_weight_int8pack_mm")


INT8_GATHERED = _int8_gathered_matmul()


class Int8Rows:
    """A weight [out, in] as int8 rows with per-row float32 scales: a whole-matrix product through fbgemm, and any
    subset of rows gathered for a head over an active set.

    ``linear(x)``: ``x @ W_q.T + bias`` for any number of rows (fbgemm, float32 out). ``gather(ids)``: the rows
    ``q[ids] * scale[ids]`` dequantized to float32 [n, in] and their bias — the same values ``linear`` multiplies,
    so a head over a subset computes what the full head computes at those rows (up to fbgemm's activation
    rounding). Gathered rows are kept as int8 with bfloat16 scales and multiplied by ``aten._weight_int8pack_mm``
    where the CPU has AVX-512 BF16 (``gathers_int8``, :data:`INT8_GATHERED`), else dequantized to float32.
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
        self.packed = _fbgemm_pack(q, self.scale, self.bias)
        self._q: torch.Tensor | None = q if keep_rows else None  # the int8 rows, kept or unpacked from fbgemm's copy when a gather needs them
        self._prefix_packs: dict = {}  # (id(order), n) -> (order, packed); insertion order = use order
        self._prefix_uses: dict = {}  # (id(order), n) -> (order, calls) for prefixes not packed yet
        self.ordered = OrderedRows(self)  # rows of fixed orders, kept across sequences (shared by ``first`` views)
        self.limit = self.shape[0]  # rows ``linear`` returns (a draft trims padded head rows)

    gathers_int8 = INT8_GATHERED  # gathered rows stay int8 (see :func:`_int8_gathered_matmul`)
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
        out = _linear_dynamic(x, self.packed, self.shape)
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
        packed = _fbgemm_pack(self.q.index_select(0, ids), self.scale.index_select(0, ids), bias)
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
        return _linear_dynamic(x, hit[1], (n, self.shape[1]))


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


def _take_same(table: dict, order: torch.Tensor, n: int) -> tuple | None:
    """Remove and return the entry of ``table`` (``(id(order), n) -> (order, …)``) kept for the same ``n`` ids under
    another tensor: a policy built anew for the next prompt holds the same ranking in a new tensor, and its prefix
    keeps its use count and its pack. None if there is none."""
    for key, entry in list(table.items()):
        if key[1] == n and torch.equal(entry[0][:n], order[:n]):
            del table[key]
            return entry
    return None


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


def _linear_dynamic(x: torch.Tensor, packed, shape: tuple[int, int]) -> torch.Tensor:
    out_f, in_f = shape
    flat = x.reshape(-1, in_f).float()  # [m, in]
    out = torch.ops.quantized.linear_dynamic(flat, packed, REDUCE_RANGE)  # [m, out]
    return out.view(*x.shape[:-1], out_f)


class Int8Linear(nn.Linear):
    """An ``nn.Linear`` (the same float ``weight``/``bias`` parameters) whose passes read an int8 copy
    (:class:`Int8Rows`): a draft's linears, one-row steps and prompt pass alike (fbgemm was faster than float32 at
    every row count measured, 1–256). Inputs that need gradients (EvoSpec's LoRA training) take ``F.linear``
    over the float weight. The output is cast back to the input's dtype."""

    def __init__(self, linear: nn.Linear, keep_rows: bool = False):
        nn.Module.__init__(self)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
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
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child, keep_rows=child is head))
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
