"""The oneDNN-prepacked target linears: same results as nn.Linear, and the target's greedy tokens kept exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_qwen2
from dynvocab.errors import DynvocabError
from dynvocab.models.prepack import MAX_PACKED_ROWS, PrepackedLinear, prepack_linears, prepack_supported
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.selection import FullPolicy, SelectorPolicy
from dynvocab.runtime.selection.frequency import StaticSelector
from dynvocab.runtime.selection.context.window import MicroSpecConfig, MicroSpecPolicy
from dynvocab.runtime.session import ModelConfig, Session

pytestmark = pytest.mark.skipif(not prepack_supported("cpu", "float32"), reason="this torch has no oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (2, 48), (1, 5, 48), (3, 7, 48), (MAX_PACKED_ROWS, 48), (1, MAX_PACKED_ROWS + 1, 48)])
def test_prepacked_linear_matches_nn_linear(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=bias)
    packed = PrepackedLinear(linear)
    x = torch.randn(*shape)
    with torch.inference_mode():
        got, want = packed(x), linear(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert packed.weight is linear.weight and packed.bias is linear.bias


def test_one_row_passes_take_the_packed_kernel_unless_there_is_a_row_copy():
    """Decoding (one row) reads the packed copy too (oneDNN beats MKL's one-row sgemm here); without one it is
    F.linear bit for bit; a row copy (the draft's bf16 step weights) wins over both."""
    linear = nn.Linear(64, 96)
    x = torch.randn(1, 1, 64)
    with torch.inference_mode():
        packed = PrepackedLinear(linear)
        direct = torch.ops.mkldnn._linear_pointwise(x.view(1, 64), packed.packed, linear.bias, "none", [], "")
        assert torch.equal(packed(x), direct.view(1, 1, 96))
        assert torch.equal(PrepackedLinear(linear, packed=False)(x), F.linear(x, linear.weight, linear.bias))
        stepped = PrepackedLinear(linear, row_dtype=torch.bfloat16)(x)
        assert torch.equal(stepped, F.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16()).float())


def test_prepack_replaces_every_linear_and_keeps_the_logits():
    model = tiny_qwen2(seed=3)
    reference = copy.deepcopy(model)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert prepack_linears(model) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.get_output_embeddings(), PrepackedLinear)
    ids = torch.tensor([[5, 9, 13, 2, 40, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_with_a_prepacked_target_is_the_target_own(tiny_pair, seed):
    """Every strategy on the prepacked target emits the unpacked target's greedy tokens, token for token."""
    target, draft = tiny_pair
    plain = CausalLM(target)
    packed_model = copy.deepcopy(target)
    prepack_linears(packed_model)
    packed, drafter = CausalLM(packed_model), DraftModel(draft)
    vocab = plain.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (3 + seed,), generator=gen).tolist()
    cfg = DecodeConfig(gamma=2 + seed, max_new_tokens=30)
    want = speculative_generate(plain, prompt, cfg, set()).token_ids
    assert speculative_generate(packed, prompt, cfg, set()).token_ids == want
    ranking = torch.randperm(vocab, generator=gen)[:50]
    window = MicroSpecPolicy(MicroSpecConfig(window=24), vocab, "cpu")
    for policy in (FullPolicy(vocab), SelectorPolicy(StaticSelector(ranking)), window):
        got = speculative_generate(packed, prompt, cfg, set(), drafter, policy)
        assert got.token_ids == want, policy.name


def test_session_prepacks_only_where_asked_and_supported(tiny_dirs):
    target, draft = str(tiny_dirs["target"]), str(tiny_dirs["draft"])
    auto = Session(ModelConfig(target, draft, "cpu", "float32"))
    assert auto.prepacked and isinstance(auto.target.model.get_output_embeddings(), PrepackedLinear)
    assert all(m.packed is not None for m in auto.draft.body.modules() if isinstance(m, PrepackedLinear))
    off = Session(ModelConfig(target, draft, "cpu", "float32", prepack=False))
    assert not off.prepacked and not any(isinstance(m, PrepackedLinear) for m in off.target.model.modules())
    decode = DecodeConfig(gamma=3, max_new_tokens=12)
    assert auto.generate([3, 4, 5], "full", decode).token_ids == off.generate([3, 4, 5], "full", decode).token_ids
    with pytest.raises(DynvocabError, match="--prepack needs float32"):
        Session(ModelConfig(target, draft, "cpu", "bfloat16", prepack=True), need_draft=False)
