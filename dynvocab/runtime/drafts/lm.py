"""A causal LM split into its body (with a KV cache we can roll back) and its output head: the target, and the body
of a draft model (:class:`~dynvocab.runtime.drafts.draft_model.DraftModel` adds the head over active sets)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from dynvocab.runtime.drafts import one_token
from dynvocab.runtime.heads.head import soft_cap
from dynvocab.runtime.trees.tree import DraftTree


class CausalLM:
    """Wraps a transformers causal LM: ``step`` runs the body over new tokens, ``logits`` applies the head.

    Splitting body and head lets the draft compute logits over a subset of rows and lets the target
    return hidden states without ``output_hidden_states`` (which would keep every layer's activations).
    """

    def __init__(self, model, vocab_rows: int | None = None, one_token_steps: bool = False):
        """``one_token_steps``: run one-token passes through :func:`~dynvocab.runtime.drafts.one_token.one_token_step`
        (a draft model's steps, where the model is one it supports) instead of transformers' forward."""
        self.model = model
        self.one_token_steps = one_token_steps and one_token.supports(model)
        self._fused: dict = {}  # int8 q/k/v and gate/up stacked for one-token steps (see one_token._fused)
        self.fused_bytes = one_token.prepare(model, self._fused) if self.one_token_steps else 0
        self.body = getattr(model, model.base_model_prefix)
        head = model.get_output_embeddings()
        rows = vocab_rows or head.weight.shape[0]
        self.head = head if rows == head.weight.shape[0] else None  # the module itself, which may be prepacked
        self.weight = head.weight[:rows].detach()  # [V, d]
        self.bias = None if getattr(head, "bias", None) is None else head.bias[:rows].detach()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        text = model.config.get_text_config()
        self.layer_types = list(getattr(text, "layer_types", None) or ["full_attention"])  # per layer
        self.sliding_window = getattr(text, "sliding_window", None)  # of the "sliding_attention" layers
        self.device = self.weight.device
        self.dtype = self.weight.dtype
        self.cache = None
        self.length = 0

    @property
    def vocab_size(self) -> int:
        """Rows of the (possibly trimmed) output head."""
        return self.weight.shape[0]

    def reset(self) -> None:
        """Drop the KV cache; the next ``step`` starts a new sequence."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        if hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()
        self.length = 0

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, tree: DraftTree | None = None) -> torch.Tensor:
        """Append ``ids`` [n] to the sequence; returns the final hidden states [n, d].

        With ``tree``, ``ids`` are its :meth:`~DraftTree.inputs` and the pass uses its positions and tree mask.
        """
        if self.cache is None:
            self.reset()
        if self.one_token_steps and tree is None and ids.numel() == 1:
            hidden = one_token.one_token_step(self.model, ids, self.length, self.cache, self._fused)
            self.length += 1
            return hidden
        extra = {}
        if tree is not None:
            extra["position_ids"] = tree.positions(self.length, ids.device)
            extra["attention_mask"] = self._tree_mask(tree, ids.device)
        out = self.body(input_ids=ids.view(1, -1), past_key_values=self.cache, use_cache=True, **extra)
        self.length += ids.numel()
        return out.last_hidden_state[0]

    def _tree_mask(self, tree: DraftTree, device) -> torch.Tensor | dict[str, torch.Tensor]:
        """The tree pass's attention mask: one 4-D mask, or — for a model with sliding-window layers (Gemma-3,
        Mistral) — one per layer type, each sized to what that type's cache layer holds (transformers' models take
        such a mapping in place of their own ``create_causal_mask`` / ``create_sliding_window_causal_mask``)."""
        types = self.layer_types
        if set(types) == {"full_attention"}:
            return tree.attention_mask(self.length, self.dtype, device)
        n = tree.size
        masks = {}
        for kind in set(types):
            layer = types.index(kind)
            window = self.sliding_window if kind == "sliding_attention" else None
            _, kv_offset = self.cache.get_mask_sizes(n, layer)  # the first position the layer's keys hold
            masks[kind] = tree.attention_mask(self.length, self.dtype, device, window, kv_offset)
        return masks

    @torch.inference_mode()
    def rollback(self, length: int, keep: Sequence[int] = ()) -> None:
        """Crop the KV cache to its first ``length`` positions; the cached positions ``keep`` (ascending, each at
        or after its destination: a tree pass's accepted path) are moved to ``length, length + 1, …`` first and
        kept as well. A sliding-window cache layer holds only its last positions: indices there are counted from
        the first position it still holds."""
        moves = [(src, length + i) for i, src in enumerate(keep) if src != length + i]
        if moves:
            for layer in self.cache.layers:
                start = layer.get_seq_length() - layer.keys.shape[-2]  # position of the layer's first cached entry
                src = torch.tensor([s - start for s, _ in moves], device=layer.keys.device)
                dst = torch.tensor([d - start for _, d in moves], device=layer.keys.device)
                for kv in (layer.keys, layer.values):
                    kv.index_copy_(-2, dst, kv.index_select(-2, src))
        length += len(keep)
        remove = self.length - length
        if remove > 0:
            self.cache.crop(-remove)
            self.length = length

    @property
    def hidden_size(self) -> int:
        """Width of the final hidden state (the head's input)."""
        return self.weight.shape[1]

    def finish(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply the model's final logit soft-capping, if it has one."""
        return soft_cap(logits, self.softcap)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [n, V] in float32 for hidden states [n, d] (no autograd: the head is frozen)."""
        if self.head is not None:
            return self.finish(self.head(hidden).float())
        return self.finish(F.linear(hidden, self.weight, self.bias).float())
