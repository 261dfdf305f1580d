"""``--draft-weights bfloat16``: the draft's one-token steps on a bfloat16 copy of its weights; the output is still the
target's own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import requires_packages, tiny_qwen2
from dynvocab.models.prepack import PrepackedLinear, prepack_linears, prepack_supported
from dynvocab.runtime.decoding.loop import DecodeConfig
from dynvocab.runtime.session import ModelConfig, Session

pytestmark = pytest.mark.skipif(not prepack_supported("cpu", "float32"), reason="this torch has no oneDNN")


@pytest.fixture(scope="module")
def session(tiny_dirs):
    return Session(ModelConfig(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", "float32", draft_weights="bfloat16"))


def test_bfloat16_draft_weights_step_the_draft_on_a_bfloat16_copy(session):
    assert session.dtype == "float32" and session.draft_weights == "bfloat16"
    assert session.target.dtype == torch.float32 and session.draft.dtype == torch.float32  # the prompt pass
    body = [m for m in session.draft.body.modules() if isinstance(m, nn.Linear)]
    assert body and all(isinstance(m, PrepackedLinear) and m.row_weight.dtype == torch.bfloat16 for m in body)
    head = session.draft.model.get_output_embeddings()  # hf-assisted steps through the module itself
    assert head.weight.dtype == torch.float32 and head.row_weight.dtype == torch.bfloat16
    assert session.draft.step_rows[0].data_ptr() == head.row_weight.data_ptr()  # our head reads the same copy


def test_float32_steps_keep_no_copy(tiny_dirs):
    s = Session(ModelConfig(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", "float32", draft_weights="float32"))
    assert s.draft.step_rows[0].data_ptr() == s.draft.weight.data_ptr()  # a view of the head: no copy
    assert all(m.row_weight is None for m in s.draft.body.modules() if isinstance(m, PrepackedLinear))


@pytest.mark.parametrize("strategy", ["full", "microspec"])
@pytest.mark.parametrize("prompt", [[5, 9, 13], [10, 11, 12, 13, 14, 15, 2]])
def test_greedy_with_bfloat16_draft_steps_is_the_float32_target_own(session, strategy, prompt):
    decode = DecodeConfig(gamma=4, max_new_tokens=24)
    ar = session.generate(prompt, "ar", decode)
    spec = session.generate(prompt, strategy, decode)
    assert spec.token_ids == ar.token_ids
    assert len(ar.token_ids) > 10
    assert spec.metrics.mean_accepted_length > 1.0  # the bf16 steps still draft what the target accepts


def test_one_row_steps_use_the_copy_and_return_the_input_dtype():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    fast = PrepackedLinear(linear, packed=False, row_dtype=torch.bfloat16)
    x = torch.randn(1, 1, 64)
    with torch.inference_mode():
        one = fast(x)
        want = nn.functional.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16()).float()
        assert one.dtype == torch.float32 and torch.equal(one, want)
        many = torch.randn(1, 5, 64)
        assert torch.equal(fast(many), linear(many))  # more rows: the float32 weight, untouched


@requires_packages("peft")
def test_lora_wraps_prepared_linears_and_trains():
    """EvoSpec's online alignment puts peft LoRA on the draft's q/v projections, which are prepared here."""
    from peft import LoraConfig, inject_adapter_in_model

    model = tiny_qwen2(seed=4)
    prepack_linears(model.model, packed=True, row_dtype=torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), model)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.requires_grad for p in lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    model(torch.tensor([[5, 9, 13, 2]])).logits.square().mean().backward()
    assert all(p.grad is not None for p in lora) and any(float(p.grad.abs().sum()) > 0 for p in lora)
