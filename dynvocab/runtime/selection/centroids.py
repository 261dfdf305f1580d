"""``centroids`` (Gemma-4's MTP drafter): a learned score per block of a balanced reordering of the vocabulary from
the hidden state the draft's head reads; each row keeps its top-c blocks and the EOS ids. The selector is trained on
the draft's own predictions (:mod:`dynvocab.artifacts.selectors`). One selector for every host: a batched host
gathers the blocks' ids (:meth:`CentroidSelector.select_union`: each distinct block once); dynvocab's loop takes them
as row ranges of one reordered copy of the head (a chain's step, :meth:`CentroidSelector.row_set`) or a tree depth's
union of them (:meth:`CentroidSelector.node_sets`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynvocab.artifacts.bundle import Bundle
from dynvocab.artifacts.selectors import CENTROIDS, SelectorTable
from dynvocab.errors import DynvocabError
from dynvocab.runtime.heads.active_set import ActiveSet, NodeSets
from dynvocab.runtime.selection.batch_select import (
    RowSelector,
    StepContext,
    bundle_eos,
    selector_table,
    session_selector,
)
from dynvocab.runtime.selection.groups import Groups


@dataclass(frozen=True)
class CentroidConfig:
    """``centroids``' knob: blocks per step (None: the stage's default budget)."""

    blocks: int | None = None


class CentroidSelector(RowSelector):
    """``centroids``: the top ``c`` blocks of one id order by ``s = C h + b``, their ids, and the EOS ids."""

    name = CENTROIDS

    def __init__(self, order: torch.Tensor, block_size: int, centroids: torch.Tensor, bias: torch.Tensor, c: int,
                 eos: torch.Tensor, vocab_size: int | None = None):
        """``order`` [V] ids in block order (block ``j`` is ``order[j·size:(j+1)·size]``, the last may be short);
        ``centroids`` [nb, d], ``bias`` [nb]; ``eos`` [E] ids every set holds; ``vocab_size``: the draft's ids (the
        loop's row ranges leave out ids at or past it; None: all of ``order``)."""
        if c < 1:
            raise DynvocabError(f"centroids needs at least 1 block (got {c})")
        nb = int(centroids.shape[0])
        order = order.long()
        block = torch.empty_like(order)
        block[order] = torch.arange(order.numel(), device=order.device) // block_size  # [V] block of each id
        n = order.numel() if vocab_size is None else min(order.numel(), vocab_size)
        self.groups = Groups(block[:n], nb, eos, order.device)  # the blocks as row ranges of one order
        pad = nb * block_size - order.numel()
        if pad:  # a short last block repeats its first id: equal logits, the same argmax and scatter
            order = torch.cat([order, order[(nb - 1) * block_size].expand(pad)])
        self.blocks = order.view(nb, block_size)  # [nb, size]
        self.centroids, self.bias = centroids.float(), bias.float()  # [nb, d], [nb]
        self.c = min(c, nb)
        self.eos = self.groups.eos  # [E] those the draft has
        self.k = self.c * block_size + int(self.eos.numel())

    def with_c(self, c: int) -> "CentroidSelector":
        """The same blocks and scorer keeping ``c`` blocks a row."""
        if c < 1:
            raise DynvocabError(f"centroids needs at least 1 block (got {c})")
        out = copy.copy(self)
        out.c = min(c, self.blocks.shape[0])
        out.k = out.c * self.blocks.shape[1] + int(self.eos.numel())
        return out

    def _picked(self, hidden: torch.Tensor) -> torch.Tensor:
        """The top ``c`` blocks [B, c] of each row."""
        scores = F.linear(hidden.to(self.centroids.device, torch.float32), self.centroids, self.bias)
        return scores.topk(self.c, dim=-1, sorted=False).indices

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

    @torch.inference_mode()
    def row_set(self, hidden: torch.Tensor | None, ctx: StepContext) -> ActiveSet:
        """The top-c blocks of ``hidden`` [1, d] as row ranges of the block order, and the EOS ids outside them."""
        if hidden is None:
            raise ValueError("centroids scores the draft hidden state; the loop must pass it")
        return ActiveSet.of(*self.groups.select(self._picked(hidden)[0]))

    @torch.inference_mode()
    def node_sets(self, hidden: torch.Tensor, ctx: StepContext) -> NodeSets:
        """Each of the rows ``hidden`` [B, d] its own top-c blocks, scored over the union of the rows' blocks."""
        return self.groups.node_sets(self._picked(hidden))

    @property
    def order(self) -> torch.Tensor:
        """[V] ids grouped by block: the order the loop's head packs once."""
        return self.groups.order


def centroid_selector(table: SelectorTable, vocab_size: int, eos: torch.Tensor, device: torch.device | str,
                      c: int) -> CentroidSelector:
    """The ``centroids`` stage ``table`` as a selector of ``c`` blocks for a draft of ``vocab_size`` ids, with those
    of the ``eos`` ids it has."""
    t = {name: x.to(device) for name, x in table.tensors.items()}
    return CentroidSelector(t["order"], int(table.config["block_size"]), t["centroids"], t["bias"], c, eos,
                            vocab_size)


def centroids_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                          device: torch.device) -> CentroidSelector:
    """``centroids``: the bundle's centroids stage picking ``budget`` blocks, with the EOS ids the head has."""
    table = selector_table(bundle, CENTROIDS, hidden_size)
    return centroid_selector(table, vocab_size, bundle_eos(bundle, vocab_size, device), device, budget)


def centroids_for_loop(cfg: CentroidConfig, ctx) -> CentroidSelector:
    """``centroids`` in dynvocab's loop (a :class:`~dynvocab.runtime.registry.PolicyContext`): the blocks and scorer
    built once per bundle, vocabulary and device, ``cfg.blocks`` a row (None: the stage's budget); the draft packs
    the block order's rows now."""
    scorer = session_selector(ctx, CENTROIDS, lambda table: centroid_selector(
        table, ctx.vocab_size, ctx.eos, ctx.device, int(table.config["budget"])))
    ctx.draft.prepare_rows(scorer.order)
    return scorer.with_c(cfg.blocks or scorer.c)
