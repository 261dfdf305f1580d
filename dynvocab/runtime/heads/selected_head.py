"""The selected head: a batch's sets scored over the rows of a host's head weight, the one way both batched hosts
(the vLLM plugin at one and two ranks, the batched-head microbenchmark) score them.

Every selector's output is read as one :class:`BatchSets`, two parts each scored one way:

- **the part every row shares** (``fr``'s ids; a context selector's core, EOS ids or ranking prefix): its rows are
  gathered once and packed for the host's own product (:func:`SelectedHead._packed`), one product a call;
- **each row's own part** (a hidden-state selector's top ids, a context selector's windows, clusters, candidates):
  gathered once a step and scored by :meth:`SelectedHead._own`: on a CPU over the batch's distinct ids
  (:func:`_over_union`); elsewhere row by row (:func:`_per_row`, which a CUDA graph can capture) while the batch's
  sets hold at most :data:`PER_ROW_LIMIT` times the head's rows, over the union past that; by the host's whole
  packed head where the union passes :data:`WHOLE_SHARE` of its rows.

A vocab-parallel head (vLLM's ``ParallelLMHead`` at tensor_parallel_size > 1) holds rows ``start … end - 1`` of the
vocabulary on each rank: every rank computes the same sets from the same hidden state and scores only the ids of its
own rows, both parts alike; the others are ``-inf`` in its logits, so a reduction over ranks (a max, vLLM's
local-argmax exchange, or a gather of shards) sees each id scored once.

**The one cache rule:** packs belong to one weight, known by identity (a host that loads or swaps its weights hands a
new tensor, and everything is packed again); within it a shared part's pack is found by its ids tensor's
``(data_ptr(), numel())``. Those tensors are the selector's own (``fr``'s ids, a core, the EOS ids, prefixes of a
ranking) and live as long as it does, so a key never comes back for other ids. Each row's own part is gathered each
step and kept nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Off a CPU, a batch's own sets are scored row by row while they hold at most this many times the head's rows (the
# gather then moves at most twice the whole head's bytes), over their union past it: the rule that picked the faster
# of the two in every case measured on an H200 (1–64 rows, 2,048–46,886 ids a row;
# docs/measurements/2026-11-27-gpu-batch-heads-h200.md).
PER_ROW_LIMIT = 2
WHOLE_SHARE = 0.25  # a batch's own sets over more than this share of the head's rows: a host's whole head


@dataclass(frozen=True)
class BatchSets:
    """A batch's sets as a head scores them: ``shared`` [n] ids every row has (None: none), whose rows the head keeps
    packed, and ``rows`` [B, k] each row's own ids (None: none), gathered once a step. ``repeats``: a row's own ids
    may repeat (a window of tokens, padding), so even one row is scored over its distinct ids. ``union``: the rows'
    distinct ids [U] and where each slot reads them [B, k], where the selector found them cheaper than
    ``torch.unique`` (a centroid selector, as blocks); None: the head finds them when it needs them."""

    shared: torch.Tensor | None
    rows: torch.Tensor | None
    repeats: bool = True
    union: tuple[torch.Tensor, torch.Tensor] | None = None

    def ids(self, batch: int) -> torch.Tensor:
        """Every row's whole set [B, n + k]."""
        if self.rows is None:
            return self.shared.expand(batch, -1)
        if self.shared is None:
            return self.rows
        return torch.cat([self.shared.expand(batch, -1), self.rows], dim=1)


class SelectedHead:
    """A draft head over the rows a selector picks: ``select_and_score(hidden, weight)`` gives each row's logits over
    its own set and the set's ids (the module's docstring says how each part is scored and what is kept)."""

    def __init__(self, selector, pack=None, union: bool | None = None, whole=None):
        """``selector``: a strategy's selector (``select(hidden, ctx) -> BatchSets``; the strategies' are in
        :mod:`dynvocab.runtime.selection`). ``pack(rows [n, d]) -> (x -> x @ rows.T)``: how a shared part's rows are
        multiplied once packed (a host's own GEMM, e.g. vLLM's oneDNN handle on a CPU; None: ``F.linear``).
        ``union``: score a batch's own sets over their distinct ids (True) or row by row (False); None: by the rule
        in the module's docstring. ``whole``: the host's own full head (``x -> x @ weight.T`` over all its rows,
        packed), which scores a batch's own sets whose distinct ids pass :data:`WHOLE_SHARE` of the head: gathering
        that many rows and multiplying them unpacked costs several times the packed head (None: always the gathered
        rows)."""
        self.selector = selector
        self.pack = pack or (lambda rows: lambda x: F.linear(x, rows))
        self.union = union
        self.whole = whole
        self.scored = [0, 0]  # rows multiplied by unsharded calls, and those calls (shapes only, no read)
        self._packs: tuple[torch.Tensor, dict] | None = None  # (the weight packed from, {(ids' data_ptr, count): pack})

    def select_and_score(self, hidden: torch.Tensor, weight: torch.Tensor, start: int = 0,
                         end: int | None = None, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [B, k], ids [B, k])`` of ``hidden`` [B, d] over the selected rows of ``weight``, in the
        weight's dtype. ``weight`` [n, d] holds the vocabulary's rows ``start … end - 1`` (None: all of it); ids
        outside them are ``-inf`` and not multiplied. ``ctx``: the draft step's
        :class:`~dynvocab.runtime.selection.batch_select.StepContext`, for a selector that reads it."""
        x = hidden.to(weight.dtype)
        sets = self._sets(hidden, ctx, weight.shape[0] if end is None else None)
        logits, scored = [], 0
        if sets.shared is not None:
            logits.append(self._packed(weight, sets.shared, start, end)(x))
            scored += sets.shared.numel()
        if sets.rows is not None:
            own, count = self._own(x, weight, sets, start, end)
            logits.append(own)
            scored += count
        if end is None:
            self.scored[0] += scored
            self.scored[1] += 1
        return (logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)), sets.ids(hidden.shape[0])

    def _sets(self, hidden: torch.Tensor, ctx, vocab: int | None) -> BatchSets:
        """The selector's sets for ``hidden`` (its ``select``), a hidden-state selector's union found as blocks
        where the selector can and a head of ``vocab`` rows (None: a shard) scores the batch over it."""
        if (vocab is not None and hidden.shape[0] > 1 and hasattr(self.selector, "select_union")
                and self._union(hidden, hidden.shape[0] * self.selector.k, vocab)):
            ids, union, where = self.selector.select_union(hidden)
            return BatchSets(None, ids, repeats=False, union=(union, where))
        return self.selector.select(hidden, ctx)

    def _union(self, x: torch.Tensor, rows: int, vocab: int) -> bool:
        """Whether ``rows`` ids of a batch's own sets, over a head of ``vocab`` rows, are scored over their union
        (the rule in the module's docstring)."""
        if self.union is not None:
            return self.union
        return x.device.type == "cpu" or rows > PER_ROW_LIMIT * vocab

    def _packed(self, weight: torch.Tensor, ids: torch.Tensor, start: int, end: int | None):
        """``x -> logits [B, n]`` over a shared part's ``ids`` [n]: their rows of ``weight`` packed at the first call
        (on a shard, only the shard's rows, ``-inf`` at the others), kept by the one cache rule."""
        if self._packs is None or self._packs[0] is not weight:
            self._packs = (weight, {})
        key = (ids.data_ptr(), ids.numel())
        packs = self._packs[1]
        if key not in packs:
            if end is None:
                packs[key] = self.pack(weight.index_select(0, ids))
            else:
                packs[key] = _shard_pack(self.pack, weight, ids, start, end)
        return packs[key]

    def _own(self, x: torch.Tensor, weight: torch.Tensor, sets: BatchSets, start: int,
             end: int | None) -> tuple[torch.Tensor, int]:
        """Logits [B, k] of the rows over their own ids ``sets.rows`` [B, k], and the rows multiplied."""
        ids = sets.rows
        if end is not None:
            return _inside(x, weight, ids, start, end), 0
        if ids.shape[0] == 1 and not sets.repeats:  # one row of distinct ids: one gather, one GEMV
            return F.linear(x, weight.index_select(0, ids[0])), ids.shape[1]
        if not self._union(x, ids.numel(), weight.shape[0]):
            return _per_row(x, weight, ids), ids.numel()
        union, where = sets.union or torch.unique(ids, return_inverse=True)
        if self.whole is not None and union.numel() > WHOLE_SHARE * weight.shape[0]:
            return self.whole(x).gather(1, ids), weight.shape[0]
        return _over_union(x, weight, union, where), union.numel()


def _shard_pack(pack, weight: torch.Tensor, ids: torch.Tensor, start: int, end: int):
    """``x -> logits [B, n]`` over ``ids`` [n] on a shard holding rows ``start … end - 1``: the shard's own ids'
    rows packed, ``-inf`` at the others."""
    cols = torch.nonzero((ids >= start) & (ids < end)).flatten()
    linear = pack(weight.index_select(0, ids[cols] - start))

    def logits(x: torch.Tensor) -> torch.Tensor:
        out = torch.full((x.shape[0], ids.numel()), float("-inf"), dtype=x.dtype, device=x.device)
        out[:, cols] = linear(x)
        return out

    return logits


def _inside(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Logits [B, k] of each row's own ``ids`` [B, k] in rows ``start … end - 1`` (this shard's), ``-inf`` at the
    others: only this shard's rows are gathered and multiplied."""
    out = torch.full(ids.shape, float("-inf"), dtype=x.dtype, device=x.device)
    inside = (ids >= start) & (ids < end)
    if ids.shape[0] == 1:  # one row: one gather of the shard's rows, one GEMV
        c = torch.nonzero(inside[0]).flatten()
        out[0, c] = F.linear(x, weight.index_select(0, ids[0, c] - start))[0]
        return out
    r, c = torch.nonzero(inside, as_tuple=True)  # this shard's (row, slot) pairs
    out[r, c] = (weight[ids[r, c] - start] * x[r]).sum(dim=-1)
    return out


def _over_union(x: torch.Tensor, weight: torch.Tensor, union: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Logits [B, k] of B > 1 rows ``x`` over their own sets ``union[where]``: the batch's distinct ids ``union``
    [U] gathered once, one GEMM over them, each row then reading its own columns ``where`` [B, k]. Rows whose sets
    overlap (shared blocks, frequent ids) share their rows' gather, so the cost per row falls as rows are added
    (gathering each row's set apart for a batched ``bmm`` took ~15 ms a row for 16,386 bfloat16 rows of 640 at four
    rows, against 4.8 ms for one row alone)."""
    return F.linear(x, weight.index_select(0, union)).gather(1, where)


def _per_row(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, k] of rows ``x`` [B, d] over their own sets ``ids`` [B, k]: each row's rows gathered [B, k, d] and
    one batched product. Fixed shapes and no host read (``torch.unique``'s output size needs one), so a CUDA graph
    captures it; it gathers B·k rows where the union gathers each distinct id once. On an H200 it is the faster of
    the two, eagerly, while B·k is at most :data:`PER_ROW_LIMIT` times the head's rows
    (docs/measurements/2026-11-27-gpu-batch-heads-h200.md)."""
    return torch.bmm(weight[ids], x[:, :, None])[..., 0]


def scatter_logits(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """A full row [B, vocab] holding ``logits`` [B, k] at ``ids`` [B, k] and ``-inf`` elsewhere: a sampler's
    softmax then gives probability exactly 0 outside the set (q = 0 there, so rejection sampling stays exact)."""
    out = torch.full((logits.shape[0], vocab), float("-inf"), dtype=logits.dtype, device=logits.device)
    return out.scatter_(1, ids, logits)
