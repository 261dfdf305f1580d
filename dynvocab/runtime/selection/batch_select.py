"""What every strategy's selector shares: one selector per strategy serves three hosts, dynvocab's loop (a chain's
draft step is a batch of one row, a tree depth a batch of the depth's nodes) and a batched host (the vLLM plugin, a
batch of requests), each row its own set.

A selector is called as ``select(hidden [B, d], ctx) -> BatchSets``: the part every row shares (kept packed by the
head) and each row's own ids (:class:`~dynvocab.runtime.heads.selected_head.BatchSets`). One that reads each row's
hidden state alone is a :class:`RowSelector` (``hidden [B, d] -> ids [B, k]``, a fixed ``k``); one that reads the
step's context (the draft position, the fed token, the request's window or key) is a :class:`ContextSelector` over a
:class:`StepContext`. The loop's chain asks a selector's ``row_set`` instead: the same set as an
:class:`~dynvocab.runtime.heads.active_set.ActiveSet` whose segments its packed head reuses (row ranges of one packed
order where the selector has one); see :class:`~dynvocab.runtime.selection.base.SelectorPolicy`.

The strategies' selectors: :mod:`.frequency` (``fr``, ``fr-pa``), :mod:`.lowrank`, :mod:`.centroids`,
:mod:`.dynaspec`, :mod:`.context` (``microspec``, ``hybrid``),
:mod:`.evospec.evospec`. Each is built from a bundle by one function that its strategy's registry entry names
(``Strategy.batched``); which strategies run batched, and how a host builds one by name, is
:mod:`dynvocab.runtime.batched`. The shape follows Gemma-4's MTP masked embedder in vLLM (``gemma4_mtp.py``,
``Gemma4MTPMaskedEmbedder._select_and_score``): select, gather the rows, score them
(:class:`~dynvocab.runtime.heads.selected_head.SelectedHead`); its ``scatter_logits`` is the ``forward`` (a full
row, ``-inf`` outside the set, so sampling sees q = 0 there).

A set may hold an id twice (padding); its two logits are equal, so the argmax and the scattered row are the same as
with one copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from dynvocab.artifacts.bundle import Bundle
from dynvocab.artifacts.selectors import SelectorTable
from dynvocab.artifacts.tables import FreqTable
from dynvocab.errors import DynvocabError
from dynvocab.runtime.heads.active_set import NodeSets
from dynvocab.runtime.heads.selected_head import BatchSets
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
    """Any strategy's selector: ``select(hidden [B, d], ctx) -> BatchSets``, ``k`` ids a row at draft position 0;
    ``node_sets`` for a tree depth's nodes (None: every node has one set)."""

    k: int

    def select(self, hidden: torch.Tensor, ctx: "StepContext | None" = None) -> BatchSets: ...

    def node_sets(self, hidden: torch.Tensor, ctx: "StepContext") -> NodeSets | None: ...


@dataclass(frozen=True)
class StepContext:
    """What a selector may read at one draft step of a batch of B rows."""

    step: int  # the draft position t (0-based), the same for every row
    fed: torch.Tensor | None = None  # [B] the token each row's draft was fed at this step (None: not known)
    windows: torch.Tensor | None = None  # [B, W] each row's request window (None: the host keeps none)
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None  # ids [n] -> the draft's input embeddings [n, d_e]
    head: torch.Tensor | None = None  # [V, d] every row of the draft's head (None: the host holds a shard or none)
    requests: tuple | None = None  # [B] each row's request key (None: the host keeps none)
    target: torch.Tensor | None = None  # [B, d] the target's hidden state that produced each row's fed token, at
    # draft position 0 (None: not known, or not the target's last layer: an EAGLE-3 head gets its mid layers)


class RowSelector:
    """A selector of each row's hidden state alone, ``hidden [B, d] -> ids [B, k]`` (``k`` the same at every call),
    each row's ids its own and distinct."""

    reads_context = False
    k: int = 0

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def select(self, hidden: torch.Tensor, ctx: StepContext | None = None) -> BatchSets:
        """Each row's ids as its own part."""
        return BatchSets(None, self(hidden), repeats=False)

    def node_sets(self, hidden: torch.Tensor, ctx: StepContext) -> NodeSets | None:
        """The rows' own sets for one head call over their distinct ids."""
        return NodeSets.of(self(hidden))


class ContextSelector:
    """``select(hidden [B, d], ctx) -> BatchSets``; ``reads`` names what of the context it needs ("fed",
    "window", "head") so a host captures only that; ``window`` is the request window's size in tokens (0: none)."""

    reads_context = True  # SelectedHead passes it the step's context
    reads: frozenset[str] = frozenset()
    window: int = 0
    k: int = 0  # ids per row at draft position 0 (the bench reports it)

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        raise NotImplementedError

    def node_sets(self, hidden: torch.Tensor, ctx: StepContext) -> NodeSets | None:
        """The rows' sets for one head call over their distinct ids; None where every row has the same set."""
        sets = self.select(hidden, ctx)
        return None if sets.rows is None else NodeSets.of(sets.ids(hidden.shape[0]))

    def prepare(self, head: torch.Tensor) -> None:
        """Build ahead what the selector lays over the draft head's rows ``head`` [V, d] (a host calls it once its
        weights are loaded, so no request's first step pays for it); nothing for most selectors."""


def bundle_eos(bundle: Bundle, vocab_size: int, device) -> torch.Tensor:
    """The EOS ids [E] the bundle's ``freq`` stage records (none without one) that a head of ``vocab_size`` rows has."""
    eos = FreqTable.from_bundle(bundle).eos_ids.long() if bundle.has("freq") else torch.empty(0, dtype=torch.long)
    return eos[eos < vocab_size].to(device)


def eos_first(ranking: torch.Tensor, eos: torch.Tensor, size: int | None = None) -> torch.Tensor:
    """``ranking`` with the ``eos`` ids first (every prefix has them) and nowhere else; its first ``max(size, E)``
    where ``size`` is given: the core of a strategy that keeps the most frequent ids, the same in every host."""
    eos = eos.to(ranking.device)
    out = torch.cat([eos, ranking[~torch.isin(ranking, eos)]])
    return out if size is None else out[: max(size, eos.numel())]


def bundle_core(bundle: Bundle, vocab_size: int, device, size: int | None = None) -> torch.Tensor:
    """The bundle's frequency ranking over a head of ``vocab_size`` rows, its EOS ids first (:func:`eos_first`)."""
    ranking = FreqTable.from_bundle(bundle).ranking.long()
    return eos_first(ranking[ranking < vocab_size].to(device), bundle_eos(bundle, vocab_size, device), size)


def fixed_budget(size: int):
    """A default budget that does not depend on the bundle: ``(bundle, vocab_size) -> min(size, vocab_size)``."""
    return lambda bundle, vocab_size: min(size, vocab_size)


def stage_budget(stage: str):
    """The default budget of a selector stage's strategy: the one the stage was trained with, ``(bundle,
    vocab_size) -> int``."""
    return lambda bundle, vocab_size: int(bundle.config(stage)["budget"])


def selector_table(bundle: Bundle, stage: str, hidden_size: int, retrain: str = "") -> SelectorTable:
    """The selector stage ``stage`` of ``bundle``, refused in one line unless it reads hidden states of
    ``hidden_size`` (``retrain``: the retraining command's further options, as the refusal gives them)."""
    table = SelectorTable.from_bundle(bundle, stage)
    if int(table.config["hidden_dim"]) != hidden_size:
        raise DynvocabError(
            f"the {stage} selector in {bundle.path} reads hidden size {table.config['hidden_dim']}, the "
            f"draft has {hidden_size}; retrain it with `dynvocab train-router --selector {stage}{retrain}`"
        )
    return table


_SESSION: dict = {}  # (id(bundle), kind, vocab_size, device) -> (bundle, selector): built once per session


def session_selector(ctx, kind: str, build):
    """``build(table)`` for the bundle's selector stage ``kind`` (checked against the draft's hidden size in one
    line), made once per bundle, vocabulary and device and kept: each prompt of dynvocab's loop (``ctx``, a
    :class:`~dynvocab.runtime.registry.PolicyContext`) then starts from the same scorer and order (quantized and
    packed once; the draft's head keeps the rows of the same order)."""
    if ctx.draft is None:
        raise DynvocabError(f"strategy '{kind}' needs a draft model; pass --draft")
    key = (id(ctx.bundle), kind, ctx.vocab_size, str(ctx.device))
    hit = _SESSION.get(key)
    if hit is None or hit[0] is not ctx.bundle:
        table = selector_table(ctx.bundle, kind, ctx.draft.hidden_size, f" --bundle {ctx.bundle.path} --draft …")
        hit = _SESSION[key] = (ctx.bundle, build(table))
    return hit[1]
