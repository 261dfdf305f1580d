"""A draft model's one-token step (runtime/drafts/one_token.py) computes what transformers' forward computes, on the
same cache, for the layer kinds it accepts, and refuses the ones it does not reproduce."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama, tiny_qwen2
from dynvocab.models.int8 import int8_supported
from dynvocab.models.prepack import quantize_linears
from dynvocab.runtime.drafts import one_token
from dynvocab.runtime.drafts.lm import CausalLM

pytestmark = pytest.mark.transformers_api  # CI runs it again at transformers' lower bound


def pair(model, **kw):
    return CausalLM(model), CausalLM(model, one_token_steps=True, **kw)


def int8_pair_after(model, prompt):
    """``model`` with int8 linears through transformers' forward and through the one-token step, both after
    ``prompt``."""
    quantize_linears(model, model.get_output_embeddings())
    hf, fast = pair(model)
    for lm in (hf, fast):
        lm.reset()
        lm.step(torch.tensor(prompt))
    return hf, fast


@pytest.mark.parametrize("build", [tiny_qwen2, tiny_llama], ids=["qwen2", "llama"])
def test_one_token_steps_match_transformers_forward(build):
    model = build()
    assert one_token.supports(model) and model.config.num_key_value_heads < model.config.num_attention_heads
    hf, fast = pair(model)
    assert fast.one_token_steps
    prompt = torch.tensor([5, 9, 13, 40, 2])
    for lm in (hf, fast):
        lm.reset()
        lm.step(prompt)
    for token in (7, 11, 3, 60, 61, 62):  # steps, then a rollback and steps over the cropped cache
        ids = torch.tensor([token])
        a, b = hf.step(ids), fast.step(ids)
        assert b.shape == a.shape == (1, model.config.hidden_size)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        if token == 3:
            hf.rollback(6)
            fast.rollback(6)
    assert hf.length == fast.length and hf.cache.get_seq_length() == fast.cache.get_seq_length()
    several = torch.tensor([8, 9])  # a catch-up pass of several tokens stays transformers'
    torch.testing.assert_close(fast.step(several), hf.step(several), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not int8_supported("cpu"), reason="this torch has no fbgemm")
def test_one_token_steps_run_int8_linears_as_their_forward_does():
    hf, fast = int8_pair_after(tiny_qwen2(seed=1), [1, 2, 3])
    for token in (4, 5, 6):
        torch.testing.assert_close(fast.step(torch.tensor([token])), hf.step(torch.tensor([token])), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not int8_supported("cpu"), reason="this torch has no fbgemm")
def test_a_bfloat16_int8_draft_keeps_its_cache_in_bfloat16():
    """A bfloat16 model with int8 linears (the default on a CPU with native bf16): the stacked int8 products return
    float32, which must not turn the cache float32 under transformers' later passes over it."""
    hf, fast = int8_pair_after(tiny_qwen2(seed=2).to(torch.bfloat16), [1, 2, 3])
    for token in (4, 5, 6):
        a, b = hf.step(torch.tensor([token])), fast.step(torch.tensor([token]))
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
    assert all(layer.keys.dtype == torch.bfloat16 for layer in fast.cache.layers)
    torch.testing.assert_close(fast.step(torch.tensor([7, 8])), hf.step(torch.tensor([7, 8])), rtol=2e-2, atol=2e-2)


def test_layers_it_does_not_reproduce_are_left_to_transformers():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    windowed = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                            sliding_window=4, max_window_layers=0))
    assert any(layer.self_attn.sliding_window for layer in windowed.model.layers)
    assert not one_token.supports(windowed) and not CausalLM(windowed, one_token_steps=True).one_token_steps
    eager_only = tiny_llama()
    eager_only.config._attn_implementation = "flash_attention_2"
    assert not one_token.supports(eager_only)
