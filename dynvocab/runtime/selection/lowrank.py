"""``lowrank`` (SpecVocab, EAGLE-4): a learned rank-r score of every id from the hidden state the draft's head reads;
the head runs exactly over the top-k ids (EOS always among them), one size at every step, as graph capture on a GPU
wants. The selector is trained on the draft's own predictions (:mod:`dynvocab.artifacts.selectors`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvocab.artifacts.selectors import LOWRANK, SelectorTable
from dynvocab.runtime.heads.active_set import ActiveSet, Gathered
from dynvocab.runtime.selection.base import VocabPolicy
from dynvocab.runtime.selection.selector_stage import prepared
from dynvocab.runtime.selection.batch_select import lowrank_selector


@dataclass(frozen=True)
class LowRankConfig:
    """``lowrank``'s knob: candidate ids per step (None: the stage's default budget)."""

    candidates: int | None = None



class LowRankPolicy(VocabPolicy):
    """Per draft step: score every id at rank r from the head's input, keep the top-k (EOS pinned): the batched
    :class:`~dynvocab.runtime.selection.batch_select.LowRankSelector` at one row, the one the vLLM plugin runs."""

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
        scorer = prepared(ctx, LOWRANK, lambda table: cls.prepare(table, ctx.vocab_size, ctx.eos, ctx.device))
        return cls(scorer, cfg.candidates or scorer[1])

    @torch.inference_mode()
    def active_ids(self, step: int, hidden: torch.Tensor | None = None, token: int | None = None) -> ActiveSet:
        """The top-k ids of the low-rank scores of ``hidden`` [1, d]."""
        if hidden is None:
            raise ValueError("lowrank scores the draft hidden state; the loop must pass it")
        return ActiveSet.of(Gathered(self.selector(hidden.to(self.device))[0]))
