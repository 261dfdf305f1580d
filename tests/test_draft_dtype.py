"""A draft in another dtype than the target (bfloat16 beside float32): the output is still the target's own."""

from __future__ import annotations

import pytest
import torch

from dynvocab.runtime.loop import DecodeConfig
from dynvocab.runtime.session import ModelConfig, Session


@pytest.fixture(scope="module")
def session(tiny_dirs):
    return Session(ModelConfig(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", "float32", draft_dtype="bfloat16"))


def test_the_draft_is_loaded_in_its_own_dtype(session):
    assert session.dtype == "float32" and session.draft_dtype == "bfloat16"
    assert session.target.dtype == torch.float32 and session.draft.dtype == torch.bfloat16


@pytest.mark.parametrize("strategy", ["full", "microspec"])
@pytest.mark.parametrize("prompt", [[5, 9, 13], [10, 11, 12, 13, 14, 15, 2]])
def test_greedy_with_a_bfloat16_draft_is_the_float32_target_own(session, strategy, prompt):
    decode = DecodeConfig(gamma=4, max_new_tokens=24)
    ar = session.generate(prompt, "ar", decode)
    spec = session.generate(prompt, strategy, decode)
    assert spec.token_ids == ar.token_ids
    assert len(ar.token_ids) > 10
    assert spec.metrics.mean_accepted_length > 1.0  # the bf16 draft still drafts something the target accepts
