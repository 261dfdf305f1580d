"""Learned fixed-size candidate selectors as vocabulary policies: ``lowrank`` and ``centroids``.

Per draft step a selector trained on the draft's own predictions (:mod:`dynvocab.artifacts.selectors`) scores the
vocabulary from the hidden state the head reads, and the head runs exactly over a fixed number of candidates:

- :class:`LowRankPolicy` (SpecVocab, EAGLE-4): a rank-r score of every id, the top-k ids (EOS always among them).
- :class:`CentroidPolicy` (Gemma-4's MTP drafter): a score per block of a balanced reordering of the
  vocabulary, the top-c blocks as :class:`~dynvocab.runtime.active_set.RowRanges` of that order (contiguous rows
  of one reordered copy of the head), and the EOS ids outside them.

Their sets have one size at every step (k ids; c blocks), as graph capture on a GPU wants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynvocab.artifacts.selectors import CENTROIDS, LOWRANK, SelectorTable
from dynvocab.errors import DynvocabError
from dynvocab.runtime.active_set import ActiveSet, Gathered
from dynvocab.runtime.policies.batch_select import lowrank_selector
from dynvocab.runtime.policies.base import VocabPolicy
from dynvocab.runtime.policies.groups import Groups

@dataclass(frozen=True)
class LowRankConfig:
    """``lowrank``'s knob: candidate ids per step (None: the stage's default budget)."""

    candidates: int | None = None


@dataclass(frozen=True)
class CentroidConfig:
    """``centroids``' knob: blocks per step (None: the stage's default budget)."""

    blocks: int | None = None


_PREPARED: dict = {}  # (id(bundle), kind, vocab_size, device) -> (bundle, prepared): built once per session


def _prepared(ctx, kind: str, build):
    """``build(table)`` for the bundle's selector ``kind``, made once per bundle, vocabulary and device and kept:
    each prompt's policy then starts from the same scorer and order (quantized and packed once; the head keeps the
    rows of the same order)."""
    key = (id(ctx.bundle), kind, ctx.vocab_size, str(ctx.device))
    hit = _PREPARED.get(key)
    if hit is None or hit[0] is not ctx.bundle:
        hit = _PREPARED[key] = (ctx.bundle, build(_table(ctx, kind)))
    return hit[1]


def _table(ctx, kind: str) -> SelectorTable:
    """The bundle's selector stage ``kind``, checked against the draft (hidden size) in one line."""
    if ctx.draft is None:
        raise DynvocabError(f"strategy '{kind}' needs a draft model; pass --draft")
    table = SelectorTable.from_bundle(ctx.bundle, kind)
    hidden = ctx.draft.hidden_size
    if int(table.config["hidden_dim"]) != hidden:
        raise DynvocabError(
            f"the {kind} selector in {ctx.bundle.path} reads hidden size {table.config['hidden_dim']}, the draft has "
            f"{hidden}; retrain it with `dynvocab train-router --selector {kind} --bundle {ctx.bundle.path} --draft …`"
        )
    return table


class LowRankPolicy(VocabPolicy):
    """Per draft step: score every id at rank r from the head's input, keep the top-k (EOS pinned): the batched
    :class:`~dynvocab.runtime.policies.batch_select.LowRankSelector` at one row, the one the vLLM plugin runs."""

    name = LOWRANK

    def __init__(self, scorer: tuple, k: int):
        """``scorer``: :meth:`prepare`'s. ``k``: candidate ids per step."""
        selector, self.budget = scorer
        self.selector = selector.with_k(k)
        self.device = selector.proj.device
        self.k = self.selector.k

    @staticmethod
    def prepare(table: SelectorTable, vocab_size: int, eos: torch.Tensor, device: torch.device | str) -> tuple:
        """The scorer of ``table`` for a draft of ``vocab_size`` ids: ``(LowRankSelector, default budget)``, EOS
        pinned among the candidates (int8 rows where the CPU runs them: 0.16 ms for 151,936 × 64 at one row, 2
        threads, against 2 ms in float32)."""
        budget = int(table.config["budget"])
        return lowrank_selector(table, vocab_size, eos, torch.device(device), budget), budget

    @classmethod
    def from_context(cls, cfg: LowRankConfig, ctx) -> "LowRankPolicy":
        """Build from the session's :class:`~dynvocab.runtime.registry.PolicyContext` (bundle stage ``lowrank``)."""
        scorer = _prepared(ctx, LOWRANK, lambda table: cls.prepare(table, ctx.vocab_size, ctx.eos, ctx.device))
        return cls(scorer, cfg.candidates or scorer[1])

    @torch.inference_mode()
    def active_ids(self, step: int, hidden: torch.Tensor | None = None, token: int | None = None) -> ActiveSet:
        """The top-k ids of the low-rank scores of ``hidden`` [1, d]."""
        if hidden is None:
            raise ValueError("lowrank scores the draft hidden state; the loop must pass it")
        return ActiveSet.of(Gathered(self.selector(hidden.to(self.device))[0]))


class CentroidPolicy(VocabPolicy):
    """Per draft step: score the vocabulary's blocks from the head's input, keep the top-c as row ranges of the
    block order (and the EOS ids outside them)."""

    name = CENTROIDS

    def __init__(self, scorer: tuple, c: int):
        """``scorer``: :meth:`prepare`'s. ``c``: blocks per step."""
        if c < 1:
            raise DynvocabError(f"centroids needs at least 1 block (got {c})")
        self.groups, self.centroids, self.bias, self.budget = scorer
        self.device = self.groups.device
        self.c = min(c, self.centroids.shape[0])

    @staticmethod
    def prepare(table: SelectorTable, vocab_size: int, eos: torch.Tensor, device: torch.device | str) -> tuple:
        """The blocks and scorer of ``table`` for a draft of ``vocab_size`` ids: ``(Groups, centroids [B, d],
        bias [B], default budget)``."""
        device = torch.device(device)
        t = table.tensors
        order, size = t["order"].long(), int(table.config["block_size"])
        block = torch.empty_like(order)
        block[order] = torch.arange(order.numel()) // size  # [V_sel] block of each id
        n = min(order.numel(), vocab_size)
        groups = Groups(block[:n], int(table.config["num_blocks"]), eos, device)
        return groups, t["centroids"].to(device), t["bias"].to(device), int(table.config["budget"])

    @classmethod
    def from_context(cls, cfg: CentroidConfig, ctx) -> "CentroidPolicy":
        """Build from the session's :class:`~dynvocab.runtime.registry.PolicyContext` (bundle stage ``centroids``);
        the draft packs the block order's rows now."""
        scorer = _prepared(ctx, CENTROIDS, lambda table: cls.prepare(table, ctx.vocab_size, ctx.eos, ctx.device))
        ctx.draft.prepare_rows(scorer[0].order)
        return cls(scorer, cfg.blocks or scorer[3])

    @torch.inference_mode()
    def active_ids(self, step: int, hidden: torch.Tensor | None = None, token: int | None = None) -> ActiveSet:
        """The top-c blocks of ``hidden`` [1, d] as row ranges, and the EOS ids outside them."""
        if hidden is None:
            raise ValueError("centroids scores the draft hidden state; the loop must pass it")
        scores = F.linear(hidden.to(self.device, torch.float32), self.centroids, self.bias)[0]  # [B]
        return ActiveSet.of(*self.groups.select(scores.topk(self.c, sorted=False).indices))
