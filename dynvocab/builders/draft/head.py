"""The head ``train-draft`` trains: its shape from the target, EAGLE-3's draft vocabulary, its start from the target."""

from __future__ import annotations

import numpy as np
import torch

from dynvocab.builders.draft import vocab
from dynvocab.builders.draft.config import TrainDraftConfig
from dynvocab.builders.draft.init import init_eagle1_from_target, init_eagle3_from_target, init_from_head
from dynvocab.builders.models import end_token_ids
from dynvocab.models.eagle import EAGLE1, EAGLE3, EagleConfig, EagleModel, config_like


def head_config(model, kind: str, cfg: TrainDraftConfig, layers: int) -> EagleConfig:
    """A head shaped like the target's decoder layer; EAGLE-3 reads the default layers (2, L//2, L-3) when the
    target has at least 4 layers, else the hidden states entering layers (1, L//2, L) (L: the last output)."""
    layer_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if kind == EAGLE1:
        return config_like(layer_cfg, EAGLE1)
    aux = None if layers >= 4 else (1, max(1, layers // 2), layers)
    return config_like(
        layer_cfg, EAGLE3, draft_vocab_size=cfg.draft_vocab, target_hidden_size=layer_cfg.hidden_size, aux_hidden_states=aux
    )


def draft_vocab(cfg: TrainDraftConfig, reader, spec, tokenizer, target_fp) -> tuple[torch.Tensor, dict]:
    """EAGLE-3's draft vocabulary (target ids [K]) and what it was made from: the bundle's freq stage, else the
    training documents' (not the held-out ones') token counts."""
    if cfg.bundle is not None:
        return vocab.from_bundle(cfg.bundle, cfg.draft_vocab, target_fp)
    counts = np.zeros(target_fp.head_rows, dtype=np.int64)
    for k in range(len(reader)):
        if not cfg.optim.held_out(reader.doc_id(k)):
            np.add.at(counts, reader.read(k)["ids"].numpy(), 1)
    return vocab.from_counts(counts, end_token_ids(spec, tokenizer), cfg.draft_vocab)


def build_head(model, head_cfg: EagleConfig, draft_ids: torch.Tensor | None, init_from: str | None = None) -> EagleModel:
    """A head initialised from the target where the shapes allow (its last layer, embeddings, norm, head rows), or
    from the trained head ``init_from`` (its weights, the target's embeddings)."""
    torch.manual_seed(0)
    head = EagleModel(head_cfg).float()
    if head_cfg.kind == EAGLE1:
        init_eagle1_from_target(head, model)
    else:
        head.set_draft_vocab(draft_ids)
        init_eagle3_from_target(head, model, draft_ids)
    if init_from is not None:
        init_from_head(head, init_from, model)
    head.embed_tokens.weight.requires_grad_(False)  # the target's embeddings, frozen (EAGLE: requires_grad False)
    return head.to(next(model.parameters()).device)
