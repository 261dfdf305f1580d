"""The plugin's head: the draft folder's selector applied to vLLM's own head rows, per row of vLLM's batch.

The selection maths is dynvocab's (:mod:`dynvocab.runtime.policies.batch_select`); this module only maps vLLM's
objects onto it: the draft folder (``speculative_config.draft_model_config.model``) and its ``config.json`` section,
the head's weight (``lm_head.weight``, rows padded past the vocabulary), the logits processor's scale and soft cap,
and EAGLE-3's draft-to-target id map (``draft_id_to_target_id``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dynvocab.artifacts.bundle import load_bundle
from dynvocab.errors import DynvocabError
from dynvocab.runtime.policies.batch_select import BatchSelector, SelectedHead, SelectorSpec, build_selector
from dynvocab.serving.vllm.names import CONFIG_KEY, POLICY_FILE


class DraftHeadPolicy:
    """A selected head for one vLLM draft: ``select_and_score`` per row, ``scatter`` and ``top_tokens`` views."""

    def __init__(self, selector: BatchSelector, vocab: int, strategy: str):
        """``vocab``: the width of the rows ``compute_logits`` returns (the target's vocabulary)."""
        self.head = SelectedHead(selector)
        self.vocab = vocab
        self.strategy = strategy

    @property
    def selector(self) -> BatchSelector:
        """The batched selector (``hidden [T, d] -> ids [T, k]``)."""
        return self.head.selector

    def select_and_score(self, hidden: torch.Tensor, lm_head, logits_processor,
                         to_target: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [T, k], ids [T, k])``: each row's logits over its set, as vLLM's logits processor would give
        them at those ids (scale, soft cap), and the ids in the target's vocabulary (``to_target`` [V_d]: EAGLE-3's
        ``draft_id + d2t[draft_id]``)."""
        logits, ids = self.head.select_and_score(hidden, lm_head.weight)
        cap = getattr(logits_processor, "soft_cap", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        scale = getattr(logits_processor, "scale", 1.0)
        if scale != 1.0:
            logits = logits * scale
        if to_target is not None:
            ids = ids + to_target[ids]
        return logits, ids

    def scatter(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Full rows [T, vocab]: ``logits`` at ``ids``, ``-inf`` elsewhere (q = 0 outside the set)."""
        out = torch.full((logits.shape[0], self.vocab), float("-inf"), dtype=logits.dtype, device=logits.device)
        return out.scatter_(1, ids, logits)

    @staticmethod
    def top_tokens(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The argmax id [T] of each row over its set, without a full row."""
        return ids.gather(1, logits.argmax(dim=-1, keepdim=True))[:, 0]


def draft_section(hf_config) -> dict:
    """The folder's ``dynvocab`` section from the draft's config (vLLM keeps unknown keys as attributes)."""
    section = getattr(hf_config, CONFIG_KEY, None)
    if not isinstance(section, dict) or "strategy" not in section:
        raise DynvocabError(
            f"the draft's config.json has no '{CONFIG_KEY}' section; make the folder with "
            "`dynvocab export BUNDLE --format vllm --strategy S --draft D --out DIR`"
        )
    return section


def tensor_parallel_size() -> int:
    """The draft's tensor-parallel world size (1 outside a distributed engine)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size()
    except (ImportError, AssertionError):
        return 1


def load_policy(vllm_config) -> DraftHeadPolicy:
    """The selected head of the draft vLLM is building: its folder's section and policy file, checked against the
    draft's config; every mismatch is one line."""
    spec_config = vllm_config.speculative_config
    model_config = spec_config.draft_model_config if spec_config is not None else vllm_config.model_config
    hf_config = model_config.hf_config
    section = draft_section(hf_config)
    if tensor_parallel_size() > 1:
        raise DynvocabError("the dynvocab vLLM plugin runs its draft heads at tensor_parallel_size 1 in this version")
    path = Path(model_config.model) / section.get("policy_file", POLICY_FILE)
    if not path.is_file():
        raise DynvocabError(f"{path} is missing; make the folder again with `dynvocab export --format vllm`")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    head_vocab = int(getattr(text, "draft_vocab_size", None) or text.vocab_size)
    bundle = load_bundle(path, verify=True)
    try:
        selector = build_selector(bundle, SelectorSpec(section["strategy"], section.get("budget")),
                                  head_vocab, int(text.hidden_size), vllm_config.device_config.device)
    finally:
        bundle.close()
    return DraftHeadPolicy(selector, int(text.vocab_size), section["strategy"])
