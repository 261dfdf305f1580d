"""What a bench row reads from each cycle: :class:`PolicyRecorder` reads the active sets the cycle's report carries.

The recorder is a pass-through proxy around the strategy's policy (so the loop stays untouched): it gives the largest
active set and, with ``coverage``, the target probability mass inside the active set and Recall@k of the target's
top-k at every verified position.
"""

from __future__ import annotations

import statistics
import time

import torch

from dynvocab.bench.loop.summary import EXTRA_KEYS, RECALL_KS
from dynvocab.runtime.selection.base import CycleReport, VocabPolicy


class PolicyRecorder:
    """A pass-through proxy around a policy that reads each cycle's report before the policy does.

    Every call reaches the wrapped policy unchanged (``active_ids`` is the wrapped policy's own, so the packed
    head's reuse still works; so are attributes such as ``prefill_logits``). From each cycle's active sets it
    records their sizes; with ``coverage`` it scores each verified position on the accepted path that had a draft
    step — the target's probability mass inside that step's active set and the share of the target's top-k
    inside it.
    """

    def __init__(
        self, inner: VocabPolicy, coverage: bool = False, ks: tuple[int, ...] = RECALL_KS, temperature: float = 0.0,
    ):
        self.inner = inner
        self.coverage = coverage
        self.ks = ks
        self.temperature = temperature
        self.sizes: list[int] = []  # active-set size per draft step
        self.mass: list[float] = []  # target mass inside the active set, per scored position
        self.hits: dict[int, list[float]] = {k: [] for k in ks}  # share of target top-k inside, per position
        self.analysis_s = 0.0  # time spent scoring (inside the loop's wall clock; the bench subtracts it)

    def __getattr__(self, name):  # only called for names the proxy itself lacks
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def prefill(self, prompt_ids, target_logits, target_hidden) -> None:
        self.inner.prefill(prompt_ids, target_logits, target_hidden)

    def active_ids(self, step: int, hidden=None, token=None):
        return self.inner.active_ids(step, hidden, token)

    def observe(self, cycle: CycleReport) -> None:
        self.sizes.extend(active.size for active in cycle.active_sets)
        if self.coverage and cycle.active_sets:
            start = time.perf_counter()
            self.score(cycle)
            self.analysis_s += time.perf_counter() - start
        self.inner.observe(cycle)

    def close(self) -> None:
        self.inner.close()

    @torch.inference_mode()
    def score(self, cycle: CycleReport) -> None:
        """Score the on-path positions of ``cycle`` against the active sets of its draft steps."""
        n = min(cycle.accepted + 1, len(cycle.draft_tokens), len(cycle.emitted), len(cycle.active_sets))
        if n <= 0:
            return
        logits = cycle.target_logits[:n].float()  # [n, V_target]
        if self.temperature > 0:
            logits = logits / self.temperature
        p = torch.softmax(logits, dim=-1)  # [n, V_target]
        for j in range(n):
            inside = cycle.active_sets[j].mask(p.shape[-1], p.device)  # [V_target] bool
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
