"""vLLM draft classes whose head runs a dynvocab selector (imported by vLLM's workers only).

Each class is vLLM's own draft class (``names.ARCHITECTURES``) with two methods replaced, as Gemma-4's MTP masked
embedder does it (``vllm/model_executor/models/gemma4_mtp.py``):

- ``get_top_tokens(hidden)``: greedy drafting under ``speculative_config["use_local_argmax_reduction"]``
  (``v1/spec_decode/llm_base_proposer.py:_greedy_sample``): each row's argmax over its own set, no full row made;
- ``compute_logits(hidden)``: probabilistic drafting and greedy drafting without that flag: each row's logits over
  its set scattered into a full row of ``-inf``, so vLLM's rejection sampler sees q = 0 outside the set and stays
  exact.

and ``forward`` wrapped, so a selector that reads the request's context gets the passes' fed ids and outputs
(:mod:`dynvocab.serving.vllm.context`; each batch row's request comes from the proposal hook,
:mod:`dynvocab.serving.vllm.proposal`). A ``+ngram`` strategy first drafts by lookup in each request's tokens: a row
whose request matched drafts the looked-up token (one-hot in ``compute_logits``: q is the deterministic proposal,
so rejection sampling stays exact), and where every row of a draft step is covered the head does not run.
Everything else (layers, caches, batching, weights) is vLLM's.
"""

from __future__ import annotations

import importlib

import torch

from dynvocab.errors import DynvocabError
from dynvocab.serving.vllm.context import EngineContext, LookedUp
from dynvocab.serving.vllm.head import DraftHeadPolicy, load_policy
from dynvocab.serving.vllm.kinds import kind_of_method
from dynvocab.serving.vllm.names import ARCHITECTURES


class SelectedHeadMixin:
    """Put before a vLLM draft class: its head scores only the rows the folder's selector picks per row."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        method = getattr(vllm_config.speculative_config, "method", None)
        self.dynvocab: DraftHeadPolicy = load_policy(vllm_config)
        kind = kind_of_method(method)
        self.dynvocab_context = EngineContext(vllm_config, target_states=kind is not None and kind.target_states,
                                              strategy=self.dynvocab.strategy)

    def forward(self, *args, **kwargs):
        """vLLM's forward; its fed ids, hidden-state input and output are recorded for a selector that reads the
        request's context or a lookup that reads its tokens. vLLM's draft classes take
        ``(input_ids, positions, hidden_states, …)``, as vLLM's proposer passes them by name."""
        out = super().forward(*args, **kwargs)
        if self.dynvocab.follows_requests:
            states = kwargs.get("hidden_states", args[2] if len(args) > 2 else None)
            self.dynvocab_context.forward(kwargs.get("input_ids", args[0] if args else None), out, states)
        return out

    def load_weights(self, weights):
        """vLLM's own loading, less an EAGLE-3 head's identity ``d2t``/``t2d`` over the target's full vocabulary:
        vLLM builds no ``draft_id_to_target_id`` there and refuses the tensor, which the eagle3 layout writes. Then
        the selector prepares what it lays over the draft's own head (:meth:`_owns_head`)."""
        if hasattr(self, "draft_id_to_target_id") and self.draft_id_to_target_id is None:
            weights = _without_identity_d2t(weights)
        loaded = super().load_weights(weights)
        if self._owns_head(loaded):
            self.dynvocab.prepare(self.lm_head.weight)
        return loaded

    def _owns_head(self, loaded) -> bool:
        """Whether the head is the draft's own, loaded now (its ``lm_head`` weights, or the embedding it is tied
        to), rather than one vLLM's proposer replaces after loading (an EAGLE head sharing the target's, which
        the selector prepares at its first draft step instead)."""
        head = getattr(self, "lm_head", None)  # an EAGLE head may have none until the proposer shares the target's
        embed = getattr(getattr(self, "model", None), "embed_tokens", None)
        return head is not None and (head is embed or any(name.startswith("lm_head.") for name in (loaded or ())))

    def _call(self, hidden_states: torch.Tensor) -> tuple[tuple[int, bool] | None, LookedUp | None]:
        """Count a head call (its draft position, where the passes are recorded) and the drafts a ``+ngram``
        lookup makes at it (None: no row covered)."""
        if not self.dynvocab.follows_requests:
            return None, None
        at = self.dynvocab_context.advance(hidden_states)
        lookup = self.dynvocab.lookup
        if lookup is None:
            return at, None
        share = _from_first_rank if getattr(self.lm_head, "tp_size", 1) > 1 else None
        return at, self.dynvocab_context.looked_up(hidden_states, at, lookup, share)

    def _selected(self, hidden_states: torch.Tensor,
                  at: tuple[int, bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [T, k], target ids [T, k])`` of ``hidden_states`` [T, d] over each row's set (``at``: the head
        call's count, where :meth:`_call` made it; None: a context selector counts the call itself)."""
        ctx = None
        if self.dynvocab.reads_context:
            selector = self.dynvocab.selector
            whole = self.lm_head.weight if getattr(self.lm_head, "tp_size", 1) == 1 else None  # not a shard
            ctx = self.dynvocab_context.step(hidden_states, selector.reads, selector.window, self.embed_input_ids,
                                             whole, at=at)
        return self.dynvocab.select_and_score(hidden_states, self.lm_head, self.logits_processor,
                                              getattr(self, "draft_id_to_target_id", None), ctx)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full rows [T, V]: the set's logits, ``-inf`` elsewhere; a row a lookup covers is one-hot on its token
        (every row covered: the head does not run)."""
        at, looked = self._call(hidden_states)
        if looked is not None and looked.every:
            self._drafted(lambda: looked.tokens, at)
            return looked.rows(None, self.dynvocab.vocab, hidden_states.dtype)
        logits, ids = self._selected(hidden_states, at)
        if at is not None:  # the greedy tokens are computed only where no pass records the next fed ids
            greedy = lambda: self.dynvocab.top_tokens(logits, ids)  # noqa: E731
            self._drafted(greedy if looked is None else (lambda: looked.over(greedy())), at)
        full = self.dynvocab.scatter(logits, ids, self.lm_head, self.logits_processor)
        return full if looked is None or full is None else looked.rows(full, self.dynvocab.vocab, full.dtype)

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The argmax target id [T] of each row over its set; a row a lookup covers drafts its looked-up token
        (every row covered: the head does not run)."""
        at, looked = self._call(hidden_states)
        if looked is not None and looked.every:
            self._drafted(lambda: looked.tokens, at)
            return looked.tokens
        logits, ids = self._selected(hidden_states, at)
        top = self.dynvocab.top_tokens(logits, ids, self.lm_head)
        top = top if looked is None else looked.over(top)
        self._drafted(lambda: top, at)
        return top

    def _drafted(self, top, at: tuple[int, bool] | None) -> None:
        """Tell the request context what computes the head call's greedy tokens (where it follows requests)."""
        if at is not None:
            self.dynvocab_context.drafted(top)


def _without_identity_d2t(weights):
    """``weights`` without ``d2t`` (all offsets 0: draft id = target id) and ``t2d``; another ``d2t`` is refused."""
    for name, tensor in weights:
        last = name.rsplit(".", 1)[-1]
        if last == "d2t" and bool(tensor.any()):
            raise DynvocabError("this EAGLE-3 head's d2t over the target's full vocabulary is not the identity; "
                                "vLLM cannot map it (write the head with draft_vocab_size < vocab_size)")
        if last not in ("d2t", "t2d"):
            yield name, tensor


def _from_first_rank(value):
    """``value`` as the tensor-parallel group's first rank has it (one small pickled object over the CPU group)."""
    from vllm.distributed import get_tp_group

    return get_tp_group().broadcast_object(value, src=0)


def _build(name: str, base_path: str) -> type:
    module, cls = base_path.split(":")
    base = getattr(importlib.import_module(module), cls)
    return type(name, (SelectedHeadMixin, base), {"__module__": __name__, "__qualname__": name,
                                                  "__doc__": f"vLLM's {cls} with a dynvocab selected head."})


def __getattr__(name: str) -> type:
    """The registered class ``name``, built on first use (vLLM imports ``module:class`` lazily, per worker)."""
    for arch, base in ARCHITECTURES.values():
        if arch == name:
            cls = _build(arch, base)
            globals()[name] = cls
            return cls
    raise AttributeError(name)
