"""A causal LM split into its body (with a KV cache we can roll back) and its output head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynvocab.runtime.head import soft_cap
from dynvocab.runtime.tree import DraftTree


class CausalLM:
    """Wraps a transformers causal LM: ``step`` runs the body over new tokens, ``logits`` applies the head.

    Splitting body and head lets the draft compute logits over a subset of rows and lets the target
    return hidden states without ``output_hidden_states`` (which would keep every layer's activations).
    """

    def __init__(self, model, vocab_rows: int | None = None):
        self.model = model
        self.body = getattr(model, model.base_model_prefix)
        head = model.get_output_embeddings()
        rows = vocab_rows or head.weight.shape[0]
        self.head = head if rows == head.weight.shape[0] else None  # the module itself, which may be prepacked
        self.weight = head.weight[:rows].detach()  # [V, d]
        self.bias = None if getattr(head, "bias", None) is None else head.bias[:rows].detach()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
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
        extra = {}
        if tree is not None:
            extra["position_ids"] = tree.positions(self.length, ids.device)
            extra["attention_mask"] = tree.attention_mask(self.length, self.dtype, ids.device)
        out = self.body(input_ids=ids.view(1, -1), past_key_values=self.cache, use_cache=True, **extra)
        self.length += ids.numel()
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def rollback(self, length: int, keep: int | None = None) -> None:
        """Crop the KV cache to its first ``length`` positions; with ``keep``, the cached position ``keep``
        (an accepted tree leaf) is moved to ``length`` first and kept as well."""
        if keep is not None:
            for layer in self.cache.layers:
                for kv in (layer.keys, layer.values):
                    kv[..., length, :] = kv[..., keep, :]
            length += 1
        remove = self.length - length
        if remove > 0:
            self.cache.crop(-remove)
            self.length = length

    def observe(self, start: int, hidden, rows) -> None:
        """A draft model reads no target features (see :class:`~dynvocab.runtime.draft.Draft`)."""

    def finish(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply the model's final logit soft-capping, if it has one."""
        return soft_cap(logits, self.softcap)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [n, V] in float32 for hidden states [n, d] (no autograd: the head is frozen)."""
        if self.head is not None:
            return self.finish(self.head(hidden).float())
        return self.finish(F.linear(hidden, self.weight, self.bias).float())
