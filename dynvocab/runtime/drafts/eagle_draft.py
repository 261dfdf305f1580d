"""EAGLE heads as proposers: EAGLE-1/2 (predicting through the target's own LM head) and EAGLE-3 (a head over
its own draft vocabulary, reading three of the target's layers), one class each over shared feature bookkeeping,
and their registry entries.

The head's cache position ``t - 1`` pairs token ``x_t`` with the feature of position ``t - 1`` (cnets1.py /
cnets.py: the input ids are shifted one left of the features): the target's feature when the target has run that
position — after a verification pass, the loop hands the committed rows over through :meth:`EagleDraft.observe`
— else the head's own output at ``t - 1``, the step before. Token ``x_0`` has no feature before it and takes no
cache slot. Entries computed from the head's own features are dropped at rollback, so after a verification the
accepted tokens are fed again with the target's features (as EAGLE does), in one batched step.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from dynvocab.models.eagle import EAGLE1, EAGLE3, Eagle1Model, Eagle3Model, EagleModel, LayerTap, checkpoint_of_kind
from dynvocab.runtime.drafts.draft import DraftInfo, OwnsHead
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.drafts.registry import DraftKind, LoadedDraft, LoadRequest
from dynvocab.runtime.drafts.weights import draft_bytes, module_rows, prepare_draft_weights, tensor_rows
from dynvocab.runtime.heads.head import DraftHead
from dynvocab.runtime.heads.mapped_head import MappedHead
from dynvocab.runtime.heads.slots import grown


class EagleDraft(OwnsHead):
    """What EAGLE-1 and EAGLE-3 heads share: the target's features by position, the head's own last feature, a
    one-layer KV cache that drops entries made from the head's own features at rollback.

    Subclasses say where features come from (:meth:`_features`), which rows the head multiplies (``step_rows``)
    and which head runs over them (:meth:`_new_head`), and build :attr:`info`.
    """

    def __init__(self, model: EagleModel, target: CausalLM):
        self.model = model
        self.target = target
        self.device = target.device
        self.features = target.weight.new_empty(0, model.config.feature_size)  # [cap, f] by target position
        self.n_features = 0  # positions [0, n_features) hold the target's features
        self.own: torch.Tensor | None = None  # [1, d] the head's last output feature
        self.own_at = -1  # the token position whose pair produced ``own``
        self.cache = None
        self.length = 0  # tokens consumed
        self.trusted = 0  # tokens consumed whose cache entries came from the target's features

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's features [pass, f] of its last pass, whose final hidden states are ``hidden``."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the sequence and the target's features."""
        self.cache = self.model.new_cache()
        self.length = self.trusted = self.n_features = 0
        self.own, self.own_at = None, -1
        self._forget_head()

    @torch.inference_mode()
    def observe(self, start: int, hidden: torch.Tensor | None, rows: Sequence[int] | None) -> None:
        """Keep the target's features of positions ``start, start + 1, …`` from the rows ``rows`` of its last
        pass (with final hidden states ``hidden`` [pass, d]; :meth:`_features` says which the head reads)."""
        if hidden is None:
            return
        feats = self._features(hidden)  # [pass, f]
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

    def tree_root(self) -> torch.Tensor:
        """The feature [1, d] the root's children are paired with: the head's own output at the last token it
        consumed (call after :meth:`step`)."""
        return self.own

    @torch.inference_mode()
    def branch(self, ids: torch.Tensor, feats: torch.Tensor, depth: int, ancestors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One depth of a draft tree: consume the k nodes ``ids`` [k] at tree depth ``depth`` (1: the children of
        the last token consumed), each paired with its parent's feature ``feats`` [k, d], in one batched pass whose
        rows see the committed cache, the tree entries of earlier depths that ``ancestors`` [k, s] marks (in the
        order they were fed) and themselves. Returns (features [k, d], head inputs [k, d]). The entries are the
        head's own, so :meth:`rollback` drops them all."""
        k, past = ids.numel(), self.cache.get_seq_length()
        fed = ancestors.shape[1]
        committed = past - fed
        base = self.length - fed  # tokens consumed before the tree
        position = base - 1 + depth - 1  # the cache position of a token at sequence index base + depth - 1
        window = self.model.config.sliding_window
        seen = torch.ones(k, committed, dtype=torch.bool, device=ids.device)  # cache position i holds position i
        if window is not None:  # the tree's own entries lie within a few positions: only the committed ones fall out
            seen = position - torch.arange(committed, device=ids.device)[None, :] < window
        visible = torch.cat([seen, ancestors.to(ids.device), torch.eye(k, dtype=torch.bool, device=ids.device)], dim=1)
        dtype = self.model.fc.weight.dtype
        mask = torch.zeros(1, 1, k, past + k, dtype=dtype, device=ids.device)
        mask[0, 0].masked_fill_(~visible, torch.finfo(dtype).min)
        positions = torch.full((1, k), position, dtype=torch.long, device=ids.device)
        out, head_in = self.model(ids.view(1, -1), feats[None], positions, self.cache, attention_mask=mask)
        self.length += k
        return out[0], head_in[0]

    @torch.inference_mode()
    def rollback(self, length: int) -> None:
        """Keep the first ``length`` tokens, but none whose entry came from the head's own features: those are
        fed again with the target's (``length`` then says how many were kept)."""
        keep = min(length, self.trusted)
        remove = max(self.length - 1, 0) - max(keep - 1, 0)  # cache entries: one per token after x_0
        if remove > 0:
            self.cache.crop(-remove)
        self.length = self.trusted = keep


class Eagle1Draft(EagleDraft):
    """An EAGLE-1/2 head: its features are the target's final hidden states and it predicts through the target's
    own LM head, so its rows are target ids (int8 rows of it, a copy the draft owns, when its ``weights`` are int8;
    a copy in another step dtype; None: the target's rows as they are)."""

    def __init__(self, model: Eagle1Model, target: CausalLM, weights: str | None = None):
        super().__init__(model, target)
        self.softcap = target.softcap
        self.step_rows = tensor_rows(target.weight, target.bias, weights)  # ([V, d], [V] or None)
        self.info = DraftInfo(
            label="EAGLE-1 head", vocab_size=target.vocab_size, hidden_size=target.weight.shape[1],
            device=target.device, embedding=model.embed_tokens.weight.detach(), rows=self.head_rows,
            shares_target_head=True,
        )

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def _new_head(self) -> DraftHead:
        return DraftHead(self.head_rows, None, self.softcap)


class Eagle3Draft(EagleDraft):
    """An EAGLE-3 head: its features are the target's hidden states entering three layers (``tap``) and its
    ``lm_head`` covers its own draft vocabulary (:class:`~dynvocab.runtime.heads.mapped_head.MappedHead` answers in
    target ids); policies see no rows of target ids (``info.rows`` is None)."""

    def __init__(self, model: Eagle3Model, target: CausalLM, tap: LayerTap):
        super().__init__(model, target)
        self.tap = tap
        self.step_rows = module_rows(model.lm_head)  # ([Vd, d], None)
        self.info = DraftInfo(
            label="EAGLE-3 head", vocab_size=target.vocab_size, hidden_size=model.lm_head.weight.shape[1],
            device=target.device, embedding=model.embed_tokens.weight.detach(),
        )

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tap.features()

    def _new_head(self) -> MappedHead:
        return MappedHead(self.step_rows[0], self.model.draft_to_target(), self.target.vocab_size)


def _load_head(request: LoadRequest):
    """The EAGLE checkpoint ``request.found`` loaded for the target (refused in one line if it was built for
    another), its linears given the draft's prepared copies; returns (model, its config, weights in force)."""
    from dynvocab.models import parse_dtype
    from dynvocab.models.eagle import check_target, load_eagle, read_config

    config = request.target_model.config.get_text_config()
    embeddings = request.target_model.get_input_embeddings().weight.detach()  # [V, d]
    cfg = read_config(request.found)
    check_target(cfg, config.hidden_size, embeddings.shape[0], config.num_hidden_layers)
    model = load_eagle(request.found, embeddings, request.device, parse_dtype(request.dtype))
    model = model.pair_with(request.target_model)
    weights = prepare_draft_weights(
        model, getattr(model, "lm_head", None), request.draft_weights, request.device, request.dtype,
        request.prepacked,
    )
    return model, cfg, weights


def load_eagle1(request: LoadRequest) -> LoadedDraft:
    """An EAGLE-1/2 head for the target; its int8 copy of the target's head counts as the draft's own bytes."""
    model, _, weights = _load_head(request)
    draft = Eagle1Draft(model, request.target, weights)
    return LoadedDraft(draft, weights, draft_bytes(model, getattr(draft.step_rows[0], "nbytes", 0)))


def load_eagle3(request: LoadRequest) -> LoadedDraft:
    """An EAGLE-3 head for the target, with the tap on the target layers it reads."""
    model, cfg, weights = _load_head(request)
    layers = request.target_model.config.get_text_config().num_hidden_layers
    draft = Eagle3Draft(model, request.target, LayerTap(request.target_model, cfg.target_layers(layers)))
    return LoadedDraft(draft, weights, draft_bytes(model))


def _stand_in(label: str, shares_target_head: bool):
    def make(vocab: int, hidden: int, generator: torch.Generator) -> DraftInfo:
        from dynvocab.models.rows import FloatRows

        rows = torch.randn(vocab, hidden, generator=generator)  # the head's rows, tied to its embedding
        return DraftInfo(
            label, vocab, hidden, torch.device("cpu"), rows, FloatRows(rows) if shares_target_head else None,
            shares_target_head=shares_target_head,
        )

    return make


EAGLE1_KIND = DraftKind(
    "eagle1", "EAGLE-1 head", functools.partial(checkpoint_of_kind, kind=EAGLE1), load_eagle1, priority=10,
    stand_in=_stand_in("EAGLE-1 head", True), help="an EAGLE-1/2 head (EAGLE or SGLang layout) for the target",
    trees=True,
)
EAGLE3_KIND = DraftKind(
    "eagle3", "EAGLE-3 head", functools.partial(checkpoint_of_kind, kind=EAGLE3), load_eagle3, priority=10,
    stand_in=_stand_in("EAGLE-3 head", False), help="an EAGLE-3 head (EAGLE, SGLang or speculators layout)",
    trees=True,
)

__all__ = ["EAGLE1_KIND", "EAGLE3_KIND", "Eagle1Draft", "Eagle3Draft", "EagleDraft"]
