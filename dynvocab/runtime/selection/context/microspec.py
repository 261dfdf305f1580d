"""MicroSpec: a training-free in-context vocabulary from a FIFO window over a candidate token stream.

The stream starts with the prompt tokens and the target's top-K_pre at every prompt position; after each
cycle it grows by the draft's tokens (with chain drafting also the draft's top alternatives per step) and the
target's top-K_ver at the verified positions. The active set is the unique tokens of the last W_max entries.
Defaults from the paper: K_pre = K_ver = 3, W_max = 3072.

The set is kept incrementally: a push changes the window counts of the pushed and the evicted entries only, so
after a cycle only those few dozen ids are checked and the sorted id list is merged, never rebuilt from a
[V] mask; when nothing entered or left, ``active_ids`` keeps returning the same segment (the same key) and the head
copies nothing; when ids entered or left, ``ids`` is a new tensor, so a new key, and the head copies only their rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvocab.kernels.window_state import WindowState
from dynvocab.runtime.heads.active_set import ActiveSet, Prefix
from dynvocab.runtime.selection.base import CycleReport, VocabPolicy


@dataclass(frozen=True)
class MicroSpecConfig:
    """MicroSpec's knobs (paper §4.1 defaults)."""

    k_pre: int = 3
    k_ver: int = 3
    window: int = 3072
    draft_alternatives: int = 3  # chain drafting: the draft's top-k at each step join the stream
    prefill_positions: int | None = None  # the last prompt positions whose top-K_pre join (None: window / K_pre)

    def prefill_rows(self) -> int:
        """The prompt positions (the last) whose target top-K_pre join the stream: ``prefill_positions``, else as
        many as the window holds (``window / k_pre``); 0 seeds the window with the prompt's own tokens only."""
        if self.prefill_positions is not None:
            return self.prefill_positions
        return max(1, self.window // max(1, self.k_pre))


class MicroSpecPolicy(VocabPolicy):
    """The unique tokens of the last ``window`` stream entries, plus the EOS ids (so drafts can end)."""

    name = "microspec"

    def __init__(self, cfg: MicroSpecConfig, vocab_size: int, device, pinned: torch.Tensor | None = None):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.draft_topk = cfg.draft_alternatives
        # The window keeps the newest ``window`` entries, which the top-K_pre of the last window / K_pre prompt
        # positions fill: earlier positions' logits (a [L, V] product on a long replayed history) are not computed.
        self.prefill_logit_rows = cfg.prefill_rows()
        self.prefill_logits = self.prefill_logit_rows > 0
        self.state = WindowState(vocab_size, cfg.window, device=device)
        self.pinned = torch.empty(0, dtype=torch.long, device=device) if pinned is None else pinned.to(device)
        self.is_pinned = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V]
        self.is_pinned[self.pinned] = True
        self.ids = self.pinned  # [n] the active set, ascending after the first refresh
        self.member = self.is_pinned.clone()  # [V] whether each id is in self.ids
        self._touched: list[torch.Tensor] = []  # ids whose window count changed since the last refresh
        self._rebuilt = False
        self._window: Prefix | None = None  # ``ids`` as a kept set (see :meth:`window_segment`)
        self._active: ActiveSet | None = None

    def prefill(self, prompt_ids, target_logits, target_hidden) -> None:
        """S_init = prompt ⊕ ∪_i top-K_pre(z_i) (the last prompt position arrives with the first cycle)."""
        self._push(prompt_ids[prompt_ids < self.vocab_size])
        if target_logits is not None and target_logits.numel():
            top = target_logits[:, : self.vocab_size].topk(self.cfg.k_pre, dim=-1).indices  # [L-1, K_pre]
            self._push(_unique_in_order(top.flatten()))
        self._refresh()

    def active_ids(self, step: int, hidden=None, token=None) -> ActiveSet:
        """The same window set at every draft step of a cycle (the same object while ``ids`` is unchanged)."""
        window = self.window_segment()
        if self._active is None or self._active.segments[0] is not window:
            self._active = ActiveSet.of(window)
        return self._active

    def window_segment(self) -> Prefix:
        """``ids`` as a set kept until it changes (:meth:`~dynvocab.runtime.heads.active_set.Prefix.whole`): the same
        segment, so the same key, while ``ids`` is the same tensor; a refresh that changes the set makes a new one."""
        if self._window is None or self._window.ranking is not self.ids:
            self._window = Prefix.whole(self.ids)
        return self._window

    def observe(self, cycle: CycleReport) -> None:
        """S ← S ⊕ C_draft ⊕ C_ver, then take the unique tokens of the last W_max entries."""
        device = self.ids.device
        drafted = [torch.tensor(cycle.draft_tokens, dtype=torch.long, device=device), *cycle.draft_top]
        c_draft = _unique_in_order(torch.cat(drafted)) if cycle.draft_tokens else drafted[0]
        verified = cycle.target_logits[: cycle.accepted + 1, : self.vocab_size]  # [k+1, V] on the accepted path
        c_ver = _unique_in_order(verified.topk(self.cfg.k_ver, dim=-1).indices.flatten())
        self._push(torch.cat([c_draft, c_ver]))
        self._refresh()

    def _push(self, tokens: torch.Tensor) -> None:
        """Push stream entries and remember which ids' counts changed (the pushed and the evicted ones)."""
        evicted = self.state.push(tokens).long().clamp(min=0)  # an empty slot (-1) reads as id 0: a harmless recheck
        self._touched += [evicted, tokens.reshape(-1).to(evicted.device)]

    def _wanted(self, ids) -> torch.Tensor:
        """Whether each of ``ids`` (a LongTensor, or ``slice(None)`` for all V) belongs to the active set now."""
        return (self.state.counts[ids] > 0) | self.is_pinned[ids]

    def _refresh(self) -> None:
        """Bring ``ids`` and ``member`` up to date from the ids touched since the last refresh: O(touched + n)."""
        touched, self._touched = self._touched, []
        if not self._rebuilt:  # the first refresh: one pass over V, then only changes
            self._rebuilt = True
            self.member = self._wanted(slice(None)).clone()
            self.ids = torch.nonzero(self.member).flatten()
            return
        if not touched:
            return
        touched = torch.unique(torch.cat(touched))  # [t] ascending, a few dozen ids
        changed = touched[self._wanted(touched) != self.member[touched]]  # [c]
        if changed.numel() == 0:
            return  # the same set: the same tensor, so the packed head copies nothing
        self.member[changed] = ~self.member[changed]
        entered = changed[self.member[changed]]
        self.ids = torch.sort(torch.cat([self.ids[self.member[self.ids]], entered])).values


def _unique_in_order(ids: torch.Tensor) -> torch.Tensor:
    """Distinct ids of a 1-D tensor, in order of first appearance."""
    uniq, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((uniq.numel(),), ids.numel(), dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(ids.numel(), device=ids.device), reduce="amin")
    return uniq[first.argsort()]
