"""``centroids`` (Gemma-4's MTP drafter): a learned score per block of a balanced reordering of the vocabulary from
the hidden state the draft's head reads; the top-c blocks are :class:`~dynvocab.runtime.heads.active_set.RowRanges` of
that order (contiguous rows of one reordered copy of the head) plus the EOS ids outside them: c blocks at every
step. The selector is trained on the draft's own predictions (:mod:`dynvocab.artifacts.selectors`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynvocab.artifacts.selectors import CENTROIDS, SelectorTable
from dynvocab.errors import DynvocabError
from dynvocab.runtime.heads.active_set import ActiveSet
from dynvocab.runtime.selection.base import VocabPolicy
from dynvocab.runtime.selection.groups import Groups
from dynvocab.runtime.selection.selector_stage import prepared


@dataclass(frozen=True)
class CentroidConfig:
    """``centroids``' knob: blocks per step (None: the stage's default budget)."""

    blocks: int | None = None



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
        scorer = prepared(ctx, CENTROIDS, lambda table: cls.prepare(table, ctx.vocab_size, ctx.eos, ctx.device))
        ctx.draft.prepare_rows(scorer[0].order)
        return cls(scorer, cfg.blocks or scorer[3])

    @torch.inference_mode()
    def active_ids(self, step: int, hidden: torch.Tensor | None = None, token: int | None = None) -> ActiveSet:
        """The top-c blocks of ``hidden`` [1, d] as row ranges, and the EOS ids outside them."""
        if hidden is None:
            raise ValueError("centroids scores the draft hidden state; the loop must pass it")
        scores = F.linear(hidden.to(self.device, torch.float32), self.centroids, self.bias)[0]  # [B]
        return ActiveSet.of(*self.groups.select(scores.topk(self.c, sorted=False).indices))
