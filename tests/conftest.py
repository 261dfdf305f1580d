"""Shared fixtures: tiny random models built from a config (no download)."""

from __future__ import annotations

import pytest
import torch


def tiny_qwen2(vocab: int = 96, layers: int = 2, hidden: int = 32, seed: int = 0, tie: bool = False):
    """A tiny random Qwen2 causal LM in float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    # Sharper, more varied logits than the default init, so drafts are sometimes right and sometimes wrong.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def tiny_pair():
    """(target, draft): same vocabulary, different random weights; the draft is a perturbed copy of the target."""
    target = tiny_qwen2(seed=0)
    draft = tiny_qwen2(seed=0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p) * p.std())
    return target, draft
