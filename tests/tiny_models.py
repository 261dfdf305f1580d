"""A tiny real tokenizer + tiny random Qwen2 target/draft saved to disk, and a tiny corpus (no download).

Import the fixtures into a test module with ``from tiny_models import tiny_dirs, corpus_jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "the a model token draft target vocabulary head cluster graph index fast slow big small cat dog runs "
    "jumps over under code python def return import speculative decoding verify accept reject sample "
    "frequency rank corpus data train eval split hidden state query inner product search"
).split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` pseudo-sentences over a small word list, with some code-like lines."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        line = " ".join(words)
        out.append(f"def {words[0]}(x):\n    return x + {i % 7}" if i % 5 == 0 else line.capitalize() + ".")
    return out


def make_tokenizer(folder: Path, vocab_size: int = 300):
    """Train a byte-level BPE on the sentences and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(sentences(400), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return fast


def make_model(folder: Path, tokenizer, hidden: int, seed: int, rows: int, layers: int = 2) -> Path:
    """A random Qwen2ForCausalLM with ``rows`` head rows (padded past the tokenizer) and ``layers`` layers, saved to ``folder``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=rows, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # varied row norms, as in real LM heads
        model.lm_head.weight.mul_(torch.rand(rows, 1) * 4 + 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder, draft folder): same tokenizer, different random weights and hidden sizes."""
    root = tmp_path_factory.mktemp("tiny_models")
    tokenizer = make_tokenizer(root / "tokenizer")
    rows = len(tokenizer) + 20
    target = make_model(root / "target", tokenizer, hidden=32, seed=0, rows=rows)
    draft = make_model(root / "draft", tokenizer, hidden=16, seed=1, rows=rows)
    return target, draft


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory) -> Path:
    """A SlimPajama-format JSON-lines file: rows with ``text`` and ``meta``."""
    path = tmp_path_factory.mktemp("corpus") / "slimpajama_sample.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(sentences(300, seed=1)):
            f.write(json.dumps({"text": text, "meta": {"redpajama_set_name": "RedPajamaGithub" if i % 5 == 0 else "RedPajamaC4"}}) + "\n")
    return path
