"""``lowrank`` (SpecVocab, EAGLE-4): a learned rank-r score of every id from the hidden state the draft's head reads;
the head runs exactly over the top-k ids (EOS always among them, by a huge bias), one size at every step, as graph
capture on a GPU wants. The selector is trained on the draft's own predictions (:mod:`dynvocab.artifacts.selectors`).
One selector for every host: a chain's step is one row, a tree depth its nodes, a vLLM step its requests."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynvocab.artifacts.bundle import Bundle
from dynvocab.artifacts.selectors import LOWRANK, SelectorTable
from dynvocab.errors import DynvocabError
from dynvocab.runtime.heads.active_set import ActiveSet, Gathered
from dynvocab.runtime.selection.batch_select import (
    RowSelector,
    StepContext,
    bundle_eos,
    selector_table,
    session_selector,
    top_ids,
    top_ids_batched,
)

# The rank from which lowrank's int8 rows score through the batched kernel: there it was faster at one row too
# (151,936 rows, 2 threads, AMD EPYC with AVX-512 BF16: rank 256, 1.26 ms against fbgemm's 1.67), below it slower
# at one row (rank 64: 0.44 against 0.22 ms; rank 128: 0.70 against 0.52), which dynvocab's own loop would pay.
BATCHED_RANK = 256


@dataclass(frozen=True)
class LowRankConfig:
    """``lowrank``'s knob: candidate ids per step (None: the stage's default budget)."""

    candidates: int | None = None


class LowRankSelector(RowSelector):
    """``lowrank``: every id scored at rank r from ``hidden``, the top ``k`` kept (EOS pinned by a huge bias)."""

    name = LOWRANK

    def __init__(self, proj: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor, k: int, int8: bool | None = None):
        """``proj`` [r, d], ``rows`` [V, r], ``bias`` [V] (float32); ``int8``: score with int8 rows (None: wherever
        the device runs them): a whole batch in one call where the CPU has AVX-512 BF16 and the rank is at least
        :data:`BATCHED_RANK` (:func:`~dynvocab.models.int8.batched_int8_rows`), else fbgemm one row per call (0.16 ms
        for 151,936 × 64 at one row, 2 threads, against 2 ms in float32)."""
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
        scores = self.scores(hidden.to(self.proj.device))  # [B, V]
        if scores.shape[0] == 1:  # one row (a chain's step): a view, no copy
            return top_ids(scores[0], self.k)[None]
        # Each row's set as alone, one threshold top-k over the batch: from 4 rows 9-29 % faster than top_ids row by
        # row (151,936 and 262,144 ids, k = 1,024-4,096, 2 threads; 0.4-1.1 ms saved at 8 rows), at 2-3 rows
        # within 0.1 ms of it.
        return top_ids_batched(scores, self.k)

    @torch.inference_mode()
    def row_set(self, hidden: torch.Tensor | None, ctx: StepContext) -> ActiveSet:
        """The top-k ids of the low-rank scores of ``hidden`` [1, d], gathered anew."""
        if hidden is None:
            raise ValueError("lowrank scores the draft hidden state; the loop must pass it")
        return ActiveSet.of(Gathered(self(hidden)[0]))


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


def lowrank_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                        device: torch.device) -> LowRankSelector:
    """``lowrank``: the bundle's lowrank stage keeping ``budget`` candidates of a head of ``vocab_size`` rows."""
    table = selector_table(bundle, LOWRANK, hidden_size)
    return lowrank_selector(table, vocab_size, bundle_eos(bundle, vocab_size, device), device, budget)


def lowrank_for_loop(cfg: LowRankConfig, ctx) -> LowRankSelector:
    """``lowrank`` in dynvocab's loop (a :class:`~dynvocab.runtime.registry.PolicyContext`): the scorer built once
    per bundle, vocabulary and device (its int8 rows packed once), keeping ``cfg.candidates`` (None: the stage's
    budget)."""
    scorer = session_selector(ctx, LOWRANK, lambda table: lowrank_selector(
        table, ctx.vocab_size, ctx.eos, ctx.device, int(table.config["budget"])))
    return scorer.with_k(cfg.candidates or scorer.k)
