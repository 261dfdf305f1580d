"""An independent draft model (any causal LM sharing the target's tokenizer) as a proposer, and its registry entry.

The body runs as the target's does (:class:`~dynvocab.runtime.drafts.lm.CausalLM`; one-token steps through
:mod:`~dynvocab.runtime.drafts.one_token` where the model is one it reproduces); the head is its own
:class:`~dynvocab.runtime.heads.head.DraftHead` over the head's step rows: the one-row copy in the step dtype when the
head was prepared with one, or its int8 rows with per-row scales when the draft's weights are int8.
"""

from __future__ import annotations

import torch

from dynvocab.runtime.drafts.draft import DraftInfo, OwnsHead
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.drafts.registry import DraftKind, LoadedDraft, LoadRequest
from dynvocab.runtime.drafts.weights import draft_bytes, module_rows, prepare_draft_weights
from dynvocab.runtime.heads.head import DraftHead

LABEL = "draft model"


class DraftModel(CausalLM, OwnsHead):
    """A draft model: its body steps, its head computes logits over active sets (target ids: the tokenizer is
    shared, and ``vocab_rows`` trims rows past the ids both models have)."""

    def __init__(self, model, vocab_rows: int | None = None, one_token_steps: bool = False):
        super().__init__(model, vocab_rows, one_token_steps)
        self.step_rows = module_rows(model.get_output_embeddings(), self.vocab_size)  # what the head multiplies
        self.info = DraftInfo(
            label=LABEL, vocab_size=self.vocab_size, hidden_size=self.hidden_size, device=self.device,
            embedding=model.get_input_embeddings().weight.detach(), rows=self.head_rows,
            index_rows=model.get_output_embeddings().weight.detach(), adaptable=self, hf_model=model,
        )

    def reset(self) -> None:
        """Drop the KV cache and the head's packed rows; the next ``step`` starts a new sequence."""
        super().reset()
        self._forget_head()

    def observe(self, start: int, hidden, rows) -> None:
        """A draft model reads no target features (see :class:`~dynvocab.runtime.drafts.draft.Proposer`)."""

    def _new_head(self) -> DraftHead:
        return DraftHead(self.head_rows, None, self.softcap)


def recognize(spec) -> object:
    """Any model argument: the catch-all kind, asked last (a causal LM the target's tokenizer matches)."""
    return spec


def load(request: LoadRequest) -> LoadedDraft:
    """Load the draft model, match its vocabulary to the target's (refused in one line where the tokenizers
    disagree on a shared id) and prepare what its steps read."""
    from dynvocab.models import load_model, load_tokenizer, match_vocabularies

    tokenizer = load_tokenizer(request.spec)
    model = load_model(request.spec, request.device, request.dtype)
    rows_t = request.target_model.get_output_embeddings().weight.shape[0]
    rows_d = model.get_output_embeddings().weight.shape[0]
    match = match_vocabularies(request.tokenizer, tokenizer, rows_t, rows_d)
    head = model.get_output_embeddings()
    weights = prepare_draft_weights(model, head, request.draft_weights, request.device, request.dtype, request.prepacked)
    draft = DraftModel(model, vocab_rows=match.shared, one_token_steps=True)

    def fingerprint():
        from dynvocab.artifacts import ModelFingerprint

        return ModelFingerprint.of_model(tokenizer, model, request.source)

    return LoadedDraft(draft, weights, draft_bytes(model, draft.fused_bytes), match, fingerprint)


def stand_in(vocab: int, hidden: int, generator: torch.Generator) -> DraftInfo:
    """A draft model's info with random weights: its own head rows (tied to its embedding) as ``index_rows``."""
    from dynvocab.models.rows import FloatRows

    rows = torch.randn(vocab, hidden, generator=generator)
    return DraftInfo(LABEL, vocab, hidden, torch.device("cpu"), rows, FloatRows(rows), index_rows=rows)


KIND = DraftKind(
    "draft-model", LABEL, recognize, load, priority=-100, stand_in=stand_in,
    help="a causal LM sharing the target's tokenizer (hub id, folder, .gguf, demo:*)",
)
