"""FR-Spec: the draft head restricted to the most frequent corpus tokens, fixed (``fr``) or shrinking with the draft
position (``fr-pa``, DynaSpec appendix A.1). Every row has the same set, so each is one prefix of one ranking: a
batched head packs its rows once, the loop's head slices one packed order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvocab.artifacts.bundle import Bundle
from dynvocab.artifacts.tables import FreqTable
from dynvocab.budget import FR_SIZE, pa_budget
from dynvocab.errors import DynvocabError
from dynvocab.runtime.heads.active_set import ActiveSet, RowRanges
from dynvocab.runtime.heads.selected_head import BatchSets
from dynvocab.runtime.selection.batch_select import ContextSelector, RowSelector, StepContext, bundle_core

CHAIN_STEPS = 16  # the draft positions whose fr-pa prefixes the loop's draft packs ahead


class StaticSelector(RowSelector):
    """``fr``: the same ``ids`` [k] for every row (FR-Spec's top-K)."""

    name = "fr"

    def __init__(self, ids: torch.Tensor):
        self.ids = self.ranking = ids.long()  # [k]
        self.k = int(ids.numel())
        self.prefixes = (self.k,)  # the prefixes of ``ranking`` it names (a draft packs them when it is built)
        self.active = ActiveSet.of(RowRanges(self.ranking, (0,), (self.k,)))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ids.expand(hidden.shape[0], self.k)

    def select(self, hidden: torch.Tensor, ctx: StepContext | None = None) -> BatchSets:
        """The ids, shared by every row."""
        return BatchSets(self.ids, None)

    def node_sets(self, hidden: torch.Tensor, ctx: StepContext) -> None:
        """Every node has the one set."""
        return None

    def row_set(self, hidden: torch.Tensor | None, ctx: StepContext) -> ActiveSet:
        """The same top-K set at every step: one range of one packed order."""
        return self.active


@dataclass(frozen=True)
class PositionAwareConfig:
    """fr-pa's knob; the ranking itself comes from the token map, the bundle or the embedded demo ranking."""

    k_max: int | None = None  # ids at draft steps 0 and 1 (None: the whole ranking)


class PositionSelector(ContextSelector):
    """``fr-pa``: the first ``pa_budget(k_max, t)`` ids of ``ranking`` at draft position t, for every row."""

    name = "fr-pa"

    def __init__(self, ranking: torch.Tensor, k_max: int):
        if not 1 <= k_max <= ranking.numel():
            raise DynvocabError(f"fr-pa needs between 1 and {ranking.numel()} ids (got {k_max})")
        self.ranking, self.k_max, self.k = ranking.long(), k_max, k_max
        self.prefixes = tuple(sorted({self.size(t) for t in range(CHAIN_STEPS)}))  # those a chain names
        self._views: dict[int, ActiveSet] = {}

    def size(self, step: int) -> int:
        """Ids at draft position ``step``."""
        return pa_budget(self.k_max, step)

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        return BatchSets(self.ranking[: self.size(ctx.step)], None)

    def row_set(self, hidden: torch.Tensor | None, ctx: StepContext) -> ActiveSet:
        """A prefix of the ranking: a range of one packed order, so the head slices its rows, copying none."""
        k = self.size(ctx.step)
        if k not in self._views:
            self._views[k] = ActiveSet.of(RowRanges(self.ranking, (0,), (k,)))
        return self._views[k]


def frequency_budget(bundle: Bundle, vocab_size: int) -> int:
    """``fr``'s default set size: FR-Spec's K, at most the head's rows."""
    return min(FR_SIZE, vocab_size)


def frequency_selector(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                       device: torch.device) -> StaticSelector:
    """``fr``: the first ``budget`` ids of the bundle's frequency ranking that a head of ``vocab_size`` rows has."""
    freq = FreqTable.from_bundle(bundle)
    ranking = freq.ranking[freq.ranking < vocab_size]
    if not 1 <= budget <= ranking.numel():
        raise DynvocabError(f"fr needs between 1 and {ranking.numel()} ids (got {budget})")
    return StaticSelector(ranking[:budget].to(device))


def position_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                         device: torch.device) -> PositionSelector:
    """``fr-pa``: the bundle's frequency ranking (EOS first), ``budget`` ids at draft positions 0 and 1."""
    return PositionSelector(bundle_core(bundle, vocab_size, device), budget)
