"""What a bench row's policy hands the loop: :class:`PolicyRecorder` records each draft step's active set.

The recorder is a pass-through proxy around the strategy's policy (so the loop stays untouched): it gives the largest
active set and, with ``coverage``, the target probability mass inside the active set and Recall@k of the target's
top-k at every verified position.
"""

from __future__ import annotations

import statistics
import time

import torch

from dynvocab.bench.summary import EXTRA_KEYS, RECALL_KS
from dynvocab.runtime.head import active_segments, active_size
from dynvocab.runtime.policies.base import CycleReport, VocabPolicy


class PolicyRecorder:
    """A pass-through proxy around a policy that records what the loop is handed.

    Every call reaches the wrapped policy unchanged (``active_ids`` returns the very same object, so the packed
    head's reuse still works; attributes and methods it does not define, such as ``prefill_logits``, are the wrapped
    policy's). Per draft step it records the active-set size; with ``coverage`` it scores each verified position on
    the accepted path that had a draft step — the target's probability mass inside that step's active set and the
    share of the target's top-k inside it — before the wrapped policy observes the cycle (a policy may update its
    active set in place there).
    """

    def __init__(
        self, inner: VocabPolicy, vocab_size: int, coverage: bool = False, ks: tuple[int, ...] = RECALL_KS,
        temperature: float = 0.0,
    ):
        self.inner = inner
        self.vocab_size = vocab_size  # rows of the draft head; None active set = these rows
        self.coverage = coverage
        self.ks = ks
        self.temperature = temperature
        self.sizes: list[int] = []  # active-set size per draft step
        self.mass: list[float] = []  # target mass inside the active set, per scored position
        self.hits: dict[int, list[float]] = {k: [] for k in ks}  # share of target top-k inside, per position
        self.analysis_s = 0.0  # time spent scoring (inside the loop's wall clock; the bench subtracts it)
        self._steps: list = []  # this cycle's active sets, by draft step

    def __getattr__(self, name):  # only called for names the proxy itself lacks
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def prefill(self, prompt_ids, target_logits, target_hidden) -> None:
        self.inner.prefill(prompt_ids, target_logits, target_hidden)

    def active_ids(self, step: int, hidden=None, token=None):
        ids = self.inner.active_ids(step, hidden, token)
        if step == 0:
            self._steps = []
        self._steps.append(ids)
        self.sizes.append(active_size(ids, self.vocab_size))
        return ids

    def observe(self, cycle: CycleReport) -> None:
        if self.coverage and self._steps:
            start = time.perf_counter()
            self.score(cycle)
            self.analysis_s += time.perf_counter() - start
        self._steps = []
        self.inner.observe(cycle)

    def close(self) -> None:
        self.inner.close()

    @torch.inference_mode()
    def score(self, cycle: CycleReport) -> None:
        """Score the on-path positions of ``cycle`` against the active sets recorded for its draft steps."""
        n = min(cycle.accepted + 1, len(cycle.draft_tokens), len(cycle.emitted), len(self._steps))
        if n <= 0:
            return
        logits = cycle.target_logits[:n].float()  # [n, V_target]
        if self.temperature > 0:
            logits = logits / self.temperature
        p = torch.softmax(logits, dim=-1)  # [n, V_target]
        for j in range(n):
            inside = active_mask(self._steps[j], self.vocab_size, p.shape[-1], p.device)  # [V_target] bool
            self.mass.append(float(p[j][inside].sum()))
            for k in self.ks:
                top = logits[j].topk(min(k, logits.shape[-1])).indices  # [k]
                self.hits[k].append(float(inside[top].float().mean()))

    def metrics(self) -> dict:
        """The extra per-generation figures: largest active set, target mass, Recall@k (None when not recorded)."""
        out = {key: None for key in EXTRA_KEYS}
        out["max_active_vocab"] = max(self.sizes) if self.sizes else None
        if self.coverage and self.mass:
            out["target_mass"] = round(statistics.fmean(self.mass), 5)
            for k in self.ks:
                out[f"recall_at_{k}"] = round(statistics.fmean(self.hits[k]), 5)
            out["scored_positions"] = len(self.mass)
        out["analysis_s"] = round(self.analysis_s, 5) if self.coverage else None
        return out


def active_mask(active, vocab: int, width: int, device) -> torch.Tensor:
    """A bool mask [width] of an active set (None = the draft's ``vocab`` rows; a tuple = disjoint segments)."""
    mask = torch.zeros(width, dtype=torch.bool, device=device)
    if active is None:
        mask[:vocab] = True
    else:
        for ids in active_segments(active):
            mask[ids.to(device)] = True
    return mask
