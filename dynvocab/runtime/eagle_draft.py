"""An EAGLE head as a draft (the :class:`~dynvocab.runtime.draft.Draft` interface) and the head over its own
draft vocabulary (EAGLE-3).

The head's cache position ``t - 1`` pairs token ``x_t`` with the feature of position ``t - 1`` (cnets1.py /
cnets.py: the input ids are shifted one left of the features): the target's feature when the target has run that
position — after a verification pass, the loop hands the committed rows over through :meth:`EagleDraft.observe`
— else the head's own output at ``t - 1``, the step before. Token ``x_0`` has no feature before it and takes no
cache slot. Entries computed from the head's own features are dropped at rollback, so after a verification the
accepted tokens are fed again with the target's features (as EAGLE does), in one batched step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dynvocab.models.eagle import EAGLE1, EagleModel, LayerTap
from dynvocab.models.prepack import INT8, Int8Linear, Int8Rows
from dynvocab.runtime.active_set import ActiveSet
from dynvocab.runtime.draft import OwnsHead
from dynvocab.runtime.head import DraftHead
from dynvocab.runtime.mapped_head import MappedHead
from dynvocab.runtime.lm import CausalLM
from dynvocab.runtime.slots import grown


class EagleDraft(OwnsHead):
    """An EAGLE-1/2 or EAGLE-3 head drafting for ``target``.

    ``weight`` [rows, d] / ``bias``: the head's LM head — EAGLE-1: the target's own (its rows are target ids);
    EAGLE-3: the head's ``lm_head`` over its draft vocabulary (see :class:`MappedHead`). ``tap`` keeps the
    target's hidden states entering EAGLE-3's three layers (None for EAGLE-1, which reads the final hidden state).
    ``step_dtype``: the dtype of the head rows its steps multiply (a copy when it differs from the weights';
    an ``lm_head`` prepared with a one-row copy, :mod:`dynvocab.models.prepack`, brings its own), or ``"int8"``:
    int8 rows with per-row scales (EAGLE-1: quantized from the target's head, a copy of the head's own; EAGLE-3:
    its ``lm_head``'s, when its linears were quantized).
    """

    index_rows = None  # no bundle stage indexes an EAGLE head's rows (EAGLE-1's are the target's: ``hnsw``)
    adaptable = None  # online LoRA alignment adapts a draft model, not an EAGLE head
    hf_model = None  # transformers' assisted generation cannot drive an EAGLE head

    def __init__(
        self, model: EagleModel, target: CausalLM, tap: LayerTap | None = None,
        step_dtype: torch.dtype | str | None = None,
    ):
        self.model = model
        self.target = target
        self.tap = tap
        self.kind = model.kind
        self.device = target.device
        self.dtype = model.fc.weight.dtype
        if self.kind == EAGLE1:
            self.weight, self.bias, self.softcap = target.weight, target.bias, target.softcap
        else:
            self.weight, self.bias, self.softcap = model.lm_head.weight.detach(), None, None
        self.features = target.weight.new_empty(0, model.config.feature_size)  # [cap, f] by target position
        self.n_features = 0  # positions [0, n_features) hold the target's features
        self.own: torch.Tensor | None = None  # [1, d] the head's last output feature
        self.own_at = -1  # the token position whose pair produced ``own``
        self.cache = None
        self.length = 0  # tokens consumed
        self.trusted = 0  # tokens consumed whose cache entries came from the target's features
        self.step_rows = self._step_rows(step_dtype)  # ([rows, d], [rows] or None): what the head's steps multiply

    def _step_rows(self, dtype: torch.dtype | str | None) -> tuple[torch.Tensor | Int8Rows, torch.Tensor | None]:
        if dtype == INT8:
            lm_head = getattr(self.model, "lm_head", None)
            if self.kind != EAGLE1 and isinstance(lm_head, Int8Linear):
                return lm_head.int8, None
            return Int8Rows(self.weight, self.bias, keep_rows=True), None
        row_weight = getattr(getattr(self.model, "lm_head", None), "row_weight", None)
        if dtype is None or dtype == self.weight.dtype:
            return self.weight, self.bias
        weight = row_weight if self.kind != EAGLE1 and row_weight is not None else self.weight.to(dtype)
        return weight, None if self.bias is None else self.bias.to(dtype)

    def _new_head(self) -> "DraftHead | MappedHead":
        if self.kind == EAGLE1:  # the target's own head: its rows are target ids
            return DraftHead(self.head_rows, None, self.softcap)
        return MappedHead(self.step_rows[0], self.model.draft_to_target(), self.target.vocab_size)

    def _row_source(self):
        """EAGLE-1's rows are target ids (the target's head); EAGLE-3's are its draft vocabulary's: None."""
        return super()._row_source() if self.kind == EAGLE1 else None

    @property
    def hidden_size(self) -> int:
        """Width of the head's input."""
        return self.weight.shape[1]

    @property
    def embedding(self) -> torch.Tensor:
        """The head's token embeddings (the target's) [V, d]."""
        return self.model.embed_tokens.weight.detach()

    @property
    def shares_target_head(self) -> bool:
        """EAGLE-1 predicts through the target's own LM head; EAGLE-3 has an ``lm_head`` of its own."""
        return self.kind == EAGLE1

    @property
    def label(self) -> str:
        """For people: which EAGLE head."""
        return "EAGLE-1 head" if self.kind == EAGLE1 else "EAGLE-3 head"

    @property
    def vocab_size(self) -> int:
        """Target ids a policy may name (the target's head rows)."""
        return self.target.vocab_size

    def reset(self) -> None:
        """Forget the sequence and the target's features."""
        self.cache = self.model.new_cache()
        self.length = self.trusted = self.n_features = 0
        self.own, self.own_at = None, -1
        self._forget_head()

    @torch.inference_mode()
    def observe(self, start: int, hidden: torch.Tensor | None, rows: Sequence[int] | None) -> None:
        """Keep the target's features of positions ``start, start + 1, …`` from the rows ``rows`` of its last
        pass (EAGLE-1: the final hidden states ``hidden`` [pass, d]; EAGLE-3: the tapped layer inputs)."""
        if hidden is None:
            return
        feats = self.tap.features() if self.tap is not None else hidden  # [pass, f]
        if rows is not None:
            feats = feats[torch.as_tensor(list(rows), dtype=torch.long, device=feats.device)]
        end = start + feats.shape[0]
        if end > self.features.shape[0]:
            self.features = grown(self.features, max(end, 2 * self.features.shape[0]))
        self.features[start:end] = feats
        self.n_features = end

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Consume tokens ``ids`` [n] at positions ``length, …``; returns the head inputs [n', d] (n' = n, or
        n - 1 when ``x_0`` is among them and others follow)."""
        if self.cache is None:
            self.reset()
        t = self.length
        if t == 0:
            if ids.numel() == 1:  # only x_0: nothing precedes it; draft from a zero feature, cache nothing
                return self._orphan(ids)
            ids, t = ids[1:], 1
            self.length = self.trusted = 1
        outs = []
        while ids.numel():
            from_target = t - 1 < self.n_features
            n = min(ids.numel(), self.n_features - (t - 1)) if from_target else 1
            outs.append(self._run(ids[:n], t, from_target))
            ids, t = ids[n:], t + n
        return torch.cat(outs)

    def _feature(self, t: int, n: int, from_target: bool) -> torch.Tensor:
        """The features [n, f] paired with tokens at positions ``t, …, t + n - 1``."""
        if from_target:
            return self.features[t - 1 : t - 1 + n]
        if self.own is not None and self.own_at == t - 1:
            return self.own
        return self.features.new_zeros(1, self.model.config.feature_size)  # no feature known (a one-token prompt)

    def _run(self, ids: torch.Tensor, t: int, from_target: bool) -> torch.Tensor:
        n = ids.numel()
        positions = torch.arange(t - 1, t - 1 + n, device=ids.device)[None]  # [1, n]
        feats = self._feature(t, n, from_target)[None]  # [1, n, f]
        out, head_in = self.model(ids.view(1, -1), feats, positions, self.cache)  # [1, n, d] each
        self.own, self.own_at = out[0, -1:], t + n - 1
        self.length = t + n
        if from_target and self.trusted == t:
            self.trusted = t + n
        return head_in[0]

    def _orphan(self, ids: torch.Tensor) -> torch.Tensor:
        feats = self.features.new_zeros(1, 1, self.model.config.feature_size)
        out, head_in = self.model(ids.view(1, 1), feats, torch.zeros(1, 1, dtype=torch.long, device=ids.device))
        self.own, self.own_at = out[0], 0
        self.length = self.trusted = 1
        return head_in[0]

    @torch.inference_mode()
    def rollback(self, length: int) -> None:
        """Keep the first ``length`` tokens, but none whose entry came from the head's own features: those are
        fed again with the target's (``length`` then says how many were kept)."""
        keep = min(length, self.trusted)
        remove = max(self.length - 1, 0) - max(keep - 1, 0)  # cache entries: one per token after x_0
        if remove > 0:
            self.cache.crop(-remove)
        self.length = self.trusted = keep


__all__ = ["EagleDraft"]
