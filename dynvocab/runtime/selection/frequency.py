"""FR-Spec: the draft head restricted to the most frequent corpus tokens, fixed or position-aware."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvocab.budget import pa_budget
from dynvocab.runtime.heads.active_set import ActiveSet, RowRanges
from dynvocab.runtime.selection.base import VocabPolicy


class FrequencyPolicy(VocabPolicy):
    """Static FR-Spec: the first ``size`` ids of a frequency ranking at every draft step."""

    name = "fr"

    def __init__(self, ranking: torch.Tensor, size: int | None = None, device: torch.device | str = "cpu"):
        self.ranking = ranking.to(device)  # [K] token ids, most frequent first, on the draft head's device
        self.size = min(size or ranking.numel(), ranking.numel())
        self.ids = self.ranking[: self.size]
        self.active = ActiveSet.of(RowRanges(self.ranking, (0,), (self.size,)))  # a prefix of one packed order

    @property
    def prefixes(self) -> tuple[int, ...]:
        """The prefix lengths of ``ranking`` the policy returns (the draft packs them when the policy is built)."""
        return (self.size,)

    def active_ids(self, step: int, hidden=None, token=None) -> ActiveSet:
        """The same top-K set at every step."""
        return self.active


@dataclass(frozen=True)
class PositionAwareConfig:
    """fr-pa's knob; the ranking itself comes from the token map, the bundle or the embedded demo ranking."""

    k_max: int | None = None  # ids at draft steps 0 and 1 (None: the whole ranking)


class PositionAwareFrequencyPolicy(VocabPolicy):
    """PA-FR (DynaSpec appendix A.1): the top-K_fr(t) most frequent tokens, shrinking with draft position."""

    name = "fr-pa"

    def __init__(
        self,
        ranking: torch.Tensor,
        k_max: int | None = None,
        always: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ):
        k_max = min(k_max or ranking.numel(), ranking.numel())
        if always is not None and always.numel():
            # Tokens that must stay drafted (EOS) go first so every prefix holds them.
            rest = ranking[~torch.isin(ranking, always)]
            ranking = torch.cat([always, rest])
        self.ranking = ranking.to(device)  # [K'] on the draft head's device
        self.k_max = k_max
        self._views: dict[int, ActiveSet] = {}

    @property
    def prefixes(self) -> tuple[int, ...]:
        """The prefix lengths of ``ranking`` the policy returns over a chain of up to 16 draft steps."""
        return tuple(sorted({pa_budget(self.k_max, t) for t in range(16)}))

    def active_ids(self, step: int, hidden=None, token=None) -> ActiveSet:
        """A prefix of the ranking: a range of one packed order, so the head slices its rows, copying none."""
        k = pa_budget(self.k_max, step)
        if k not in self._views:
            self._views[k] = ActiveSet.of(RowRanges(self.ranking, (0,), (k,)))
        return self._views[k]
