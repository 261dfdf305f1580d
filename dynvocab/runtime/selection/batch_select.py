"""One selector, two hosts: the vocabulary policies whose set depends only on the draft's own hidden state, as
batched, device-side functions ``hidden [B, d] -> ids [B, k]`` of a fixed ``k``.

dynvocab's own loop calls them with ``B = 1`` (:class:`~dynvocab.runtime.selection.lowrank.LowRankPolicy` is a
:class:`LowRankSelector`; the centroid policy keeps its row ranges for the loop's packed head and is checked
against :class:`CentroidSelector` in tests/test_batch_select.py); the vLLM plugin (:mod:`dynvocab.serving.vllm`)
calls them with the engine's batch, each row its own set. The shape follows Gemma-4's MTP masked embedder in vLLM (``gemma4_mtp.py``,
``Gemma4MTPMaskedEmbedder._select_and_score``): select, gather the rows, score them (:class:`SelectedHead`);
:func:`scatter_logits` is its ``forward`` (a full row, ``-inf`` outside the set, so sampling sees q = 0 there).

- :class:`StaticSelector` (``fr``): the first K ids of the frequency ranking, the same for every row.
- :class:`LowRankSelector` (``lowrank``): ``s = R (P h) + b`` over every id, the top-k (EOS pinned by its bias),
  each row's from a threshold its own strided sample sets (:func:`top_ids`; for a batch :func:`top_ids_batched`,
  the candidates of every row packed into one ``topk``).
- :class:`CentroidSelector` (``centroids``): ``s = C h + b`` over blocks of one id order, the top-c blocks'
  ids (c · block_size of them, a short last block padded by repeating its first id) and the EOS ids.

Each is built from a bundle by one function (:func:`frequency_selector`, :func:`lowrank_from_bundle`,
:func:`centroids_from_bundle`) that its strategy's registry entry names (``Strategy.batched``); which strategies
run batched, and how a host builds one by name, is :mod:`dynvocab.runtime.batched`.

A set may hold an id twice (padding); its two logits are equal, so the argmax and the scattered row are the same as
with one copy.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dynvocab.artifacts.bundle import Bundle
from dynvocab.artifacts.selectors import CENTROIDS, LOWRANK, SelectorTable
from dynvocab.artifacts.tables import FreqTable
from dynvocab.budget import FR_SIZE
from dynvocab.errors import DynvocabError
from dynvocab.runtime.host import to_host

SAMPLE_STRIDE = 16  # top_ids: every 16th score estimates the threshold


def _sampled(samples: int, k: int) -> int:
    """How many of ``samples`` strided scores the threshold keeps: the threshold is the least of them."""
    return min(samples, k // SAMPLE_STRIDE * 3 // 2 + 1)


def top_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the ``k`` largest of ``scores`` [n] (unordered), exactly as ``topk`` gives them.

    On a CPU ``topk`` over a vocabulary costs 0.5–1.8 ms (151,936–262,144 scores, k = 1,024–4,096, 2 threads),
    more than the head it saves; a threshold from a strided sample keeps every score at or above it (~1.5 k
    of them), and ``topk`` over those picks the same k (0.1–0.2 ms). Where fewer than k pass, or on another
    device, plain ``topk``.
    """
    n = scores.numel()
    if k >= n:
        return torch.arange(n, device=scores.device)
    if scores.device.type != "cpu" or n < 4 * k or k < SAMPLE_STRIDE:
        return scores.topk(k, sorted=False).indices
    sample = scores[::SAMPLE_STRIDE]
    tau = sample.topk(_sampled(sample.numel(), k), sorted=False).values.min()
    cand = torch.nonzero(scores >= tau).flatten()
    if cand.numel() < k:
        return scores.topk(k, sorted=False).indices
    return cand[scores[cand].topk(k, sorted=False).indices]


def top_ids_batched(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ids [B, k] of the ``k`` largest of each row of ``scores`` [B, n] (unordered): each row's set is the one
    :func:`top_ids` gives that row alone (ties at the k-th score aside, as with ``topk``), with no loop over rows.

    Each row's threshold comes from its own strided sample (as :func:`top_ids`); the scores at or above it, found
    in one pass over the batch, are packed into a [B, C] tensor (C the most any row has, the rest ``-inf``), and
    one ``topk`` over it picks each row's k. It never picks the padding: a row whose threshold is ``-inf`` has all n
    scores as candidates (no padding), any other k candidates above ``-inf``. Where a row has fewer than k
    candidates, on another device, or where :func:`top_ids` would not sample, plain ``topk``.
    """
    rows, n = scores.shape
    if k >= n:
        return torch.arange(n, device=scores.device).expand(rows, n)
    if scores.device.type != "cpu" or n < 4 * k or k < SAMPLE_STRIDE or rows == 0:
        return scores.topk(k, dim=1, sorted=False).indices
    scores = scores.contiguous()
    sample = scores[:, ::SAMPLE_STRIDE]
    tau = sample.topk(_sampled(sample.shape[1], k), dim=1, sorted=False).values.amin(dim=1)  # [B]
    flat = torch.nonzero((scores >= tau[:, None]).view(-1)).flatten()  # candidates as row · n + id, row-major
    starts = torch.arange(rows + 1) * n
    bounds = torch.searchsorted(flat, starts)  # where each row's candidates begin in flat
    counts = bounds.diff()
    held = to_host(counts)  # on a CPU only (another device takes plain topk above): a copy, no device wait
    if min(held) < k:
        return scores.topk(k, dim=1, sorted=False).indices
    packed = scores.new_full((rows, max(held)), float("-inf"))
    packed.masked_scatter_(torch.arange(packed.shape[1]) < counts[:, None], scores.view(-1).index_select(0, flat))
    top = packed.topk(k, dim=1, sorted=False).indices  # never the padding (see above)
    return flat[top + bounds[:-1, None]] - starts[:-1, None]


class BatchSelector(Protocol):
    """``hidden [B, d] -> ids [B, k]``: each row's active ids, ``k`` the same at every call."""

    k: int

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor: ...


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


class StaticSelector:
    """The same ``ids`` [k] for every row (FR-Spec's top-K): the head packs their rows once."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids.long()  # [k]
        self.k = int(ids.numel())

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ids.expand(hidden.shape[0], self.k)


# The rank from which lowrank's int8 rows score through the batched kernel: there it was faster at one row too
# (151,936 rows, 2 threads, AMD EPYC with AVX-512 BF16: rank 256, 1.26 ms against fbgemm's 1.67), below it slower
# at one row (rank 64: 0.44 against 0.22 ms; rank 128: 0.70 against 0.52), which dynvocab's own loop would pay.
BATCHED_RANK = 256


class LowRankSelector:
    """``lowrank``: every id scored at rank r from ``hidden``, the top ``k`` kept (EOS pinned by a huge bias)."""

    def __init__(self, proj: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor, k: int, int8: bool | None = None):
        """``proj`` [r, d], ``rows`` [V, r], ``bias`` [V] (float32); ``int8``: score with int8 rows (None: wherever
        the device runs them): a whole batch in one call where the CPU has AVX-512 BF16 and the rank is at least
        :data:`BATCHED_RANK` (:func:`~dynvocab.models.int8.batched_int8_rows`), else fbgemm one row per call."""
        from dynvocab.models.int8 import batched_int8_rows, int8_supported
        from dynvocab.models.rows import Int8Rows

        if k < 1:
            raise DynvocabError(f"lowrank needs at least 1 candidate (got {k})")
        self.proj = proj.float()  # [r, d]
        self.vocab = int(rows.shape[0])
        self.k = min(k, self.vocab)
        int8 = int8_supported(proj.device.type) if int8 is None else int8
        self.int8 = int8
        batched = batched_int8_rows(rows.float(), bias.float()) if int8 and rows.shape[1] >= BATCHED_RANK else None
        self.per_row = int8 and batched is None  # fbgemm: one row per call (see scores)
        if batched is not None:
            self._rows = batched  # z [B, r] -> [B, V]
        elif int8:
            self._rows = Int8Rows(rows.float(), bias.float()).linear  # z [1, r] -> [1, V]
        else:
            rows, bias = rows.float(), bias.float()
            self._rows = lambda z: F.linear(z, rows, bias)

    def with_k(self, k: int) -> "LowRankSelector":
        """The same scorer (rows shared, nothing copied) keeping ``k`` candidates."""
        if k < 1:
            raise DynvocabError(f"lowrank needs at least 1 candidate (got {k})")
        out = copy.copy(self)
        out.k = min(k, self.vocab)
        return out

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores [B, V] of every id for ``hidden`` [B, d]; a row's set never depends on the rows batched beside it:
        fbgemm quantizes its input with one scale per call, so its int8 rows score one row per call."""
        z = hidden.float() @ self.proj.T  # [B, r]
        if self.per_row and z.shape[0] > 1:
            return torch.cat([self._rows(z[i : i + 1]) for i in range(z.shape[0])])
        return self._rows(z)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = self.scores(hidden)  # [B, V]
        if scores.shape[0] == 1:  # dynvocab's own loop: a view, no copy
            return top_ids(scores[0], self.k)[None]
        # Each row's set as alone, one threshold top-k over the batch: from 4 rows 9-29 % faster than top_ids row by
        # row (151,936 and 262,144 ids, k = 1,024-4,096, 2 threads; 0.4-1.1 ms saved at 8 rows), at 2-3 rows
        # within 0.1 ms of it.
        return top_ids_batched(scores, self.k)


class CentroidSelector:
    """``centroids``: the top ``c`` blocks of one id order by ``s = C h + b``, their ids, and the EOS ids."""

    def __init__(self, order: torch.Tensor, block_size: int, centroids: torch.Tensor, bias: torch.Tensor, c: int,
                 eos: torch.Tensor):
        """``order`` [V] ids in block order (block ``j`` is ``order[j·size:(j+1)·size]``, the last may be short);
        ``centroids`` [nb, d], ``bias`` [nb]; ``eos`` [E] ids every set holds."""
        if c < 1:
            raise DynvocabError(f"centroids needs at least 1 block (got {c})")
        nb = int(centroids.shape[0])
        pad = nb * block_size - order.numel()
        if pad:  # a short last block repeats its first id: equal logits, the same argmax and scatter
            order = torch.cat([order, order[(nb - 1) * block_size].expand(pad)])
        self.blocks = order.long().view(nb, block_size)  # [nb, size]
        self.centroids, self.bias = centroids.float(), bias.float()  # [nb, d], [nb]
        self.c = min(c, nb)
        self.eos = eos.long().to(order.device)  # [E]
        self.k = self.c * block_size + int(self.eos.numel())

    def _picked(self, hidden: torch.Tensor) -> torch.Tensor:
        """The top ``c`` blocks [B, c] of each row."""
        return F.linear(hidden.float(), self.centroids, self.bias).topk(self.c, dim=-1, sorted=False).indices

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = self.blocks[self._picked(hidden)].flatten(1)  # [B, c·size]
        return torch.cat([ids, self.eos.expand(ids.shape[0], -1)], dim=1)

    def select_union(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids [B, k], union [U], where [B, k])`` with ``ids = union[where]``: the batch's sets as the ids of the
        distinct blocks any row picked (plus EOS), so a batched head gathers each shared block's rows once."""
        picked = self._picked(hidden)  # [B, c]
        blocks, inverse = torch.unique(picked, return_inverse=True)  # [Ub], [B, c]
        size = self.blocks.shape[1]
        offsets = torch.arange(size, device=picked.device)
        where = (inverse[..., None] * size + offsets).flatten(1)  # [B, c·size]
        tail = blocks.numel() * size + torch.arange(self.eos.numel(), device=picked.device)
        where = torch.cat([where, tail.expand(where.shape[0], -1)], dim=1)
        union = torch.cat([self.blocks[blocks].flatten(), self.eos])
        return union[where], union, where


def bundle_eos(bundle: Bundle) -> torch.Tensor:
    """The EOS ids [E] the bundle's ``freq`` stage records (none without one)."""
    return FreqTable.from_bundle(bundle).eos_ids if bundle.has("freq") else torch.empty(0, dtype=torch.long)


def frequency_budget(bundle: Bundle, vocab_size: int) -> int:
    """``fr``'s default set size: FR-Spec's K, at most the head's rows."""
    return min(FR_SIZE, vocab_size)


def stage_budget(stage: str):
    """The default budget of a selector stage's strategy: the one the stage was trained with, ``(bundle,
    vocab_size) -> int``."""
    return lambda bundle, vocab_size: int(bundle.config(stage)["budget"])


def frequency_selector(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                       device: torch.device) -> StaticSelector:
    """``fr``: the first ``budget`` ids of the bundle's frequency ranking that a head of ``vocab_size`` rows has."""
    freq = FreqTable.from_bundle(bundle)
    ranking = freq.ranking[freq.ranking < vocab_size]
    if not 1 <= budget <= ranking.numel():
        raise DynvocabError(f"fr needs between 1 and {ranking.numel()} ids (got {budget})")
    return StaticSelector(ranking[:budget].to(device))


def selector_table(bundle: Bundle, stage: str, hidden_size: int) -> SelectorTable:
    """The selector stage ``stage`` of ``bundle``, refused in one line unless it reads hidden states of
    ``hidden_size``."""
    table = SelectorTable.from_bundle(bundle, stage)
    if int(table.config["hidden_dim"]) != hidden_size:
        raise DynvocabError(
            f"the {stage} selector in {bundle.path} reads hidden size {table.config['hidden_dim']}, the "
            f"draft has {hidden_size}; retrain it with `dynvocab train-router --selector {stage}`"
        )
    return table


def lowrank_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                        device: torch.device) -> LowRankSelector:
    """``lowrank``: the bundle's lowrank stage keeping ``budget`` candidates of a head of ``vocab_size`` rows."""
    return lowrank_selector(selector_table(bundle, LOWRANK, hidden_size), vocab_size, bundle_eos(bundle), device, budget)


def centroids_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                          device: torch.device) -> CentroidSelector:
    """``centroids``: the bundle's centroids stage picking ``budget`` blocks, with the EOS ids the head has."""
    table = selector_table(bundle, CENTROIDS, hidden_size)
    t = {name: x.to(device) for name, x in table.tensors.items()}
    eos = bundle_eos(bundle)
    return CentroidSelector(t["order"].long(), int(table.config["block_size"]), t["centroids"], t["bias"], budget,
                            eos[eos < vocab_size].to(device))


def lowrank_selector(table: SelectorTable, vocab_size: int, eos: torch.Tensor, device: torch.device | str,
                     k: int) -> LowRankSelector:
    """The ``lowrank`` stage ``table`` as a selector of ``k`` ids for a draft of ``vocab_size`` ids, EOS pinned
    among the candidates by a huge bias."""
    t = {name: x.to(device) for name, x in table.tensors.items()}
    n = min(int(table.config["vocab_rows"]), vocab_size)
    bias = t["bias"][:n].clone()
    eos = eos.to(bias.device)
    bias[eos[eos < n]] = torch.finfo(torch.float32).max / 4
    return LowRankSelector(t["proj"], t["rows"][:n], bias, k)


def scatter_logits(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """A full row [B, vocab] holding ``logits`` [B, k] at ``ids`` [B, k] and ``-inf`` elsewhere: a sampler's
    softmax then gives probability exactly 0 outside the set (q = 0 there, so rejection sampling stays exact)."""
    out = torch.full((logits.shape[0], vocab), float("-inf"), dtype=logits.dtype, device=logits.device)
    return out.scatter_(1, ids, logits)
