"""The CLI through typer's CliRunner on tiny local models: JSON contract and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import assert_one_line_error, run

PROMPT = "w1 w2 w3 w4 w5"


def model_args(dirs, draft="draft"):
    return ["--target", dirs["target"], "--draft", dirs[draft], "--no-chat-template", "--quiet", "--dtype", "float32"]


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def token_map(tmp_path_factory):
    path = tmp_path_factory.mktemp("maps") / "freq_40.pt"
    torch.save(list(range(0, 80, 2)), path)
    return path


def test_generate_json_matches_ar(tiny_dirs, token_map):
    outs = {}
    for strategy in ("ar", "full", "fr", "fr-pa"):
        extra = ["--token-map", token_map] if strategy.startswith("fr") else []
        result = run("generate", PROMPT, *model_args(tiny_dirs), "--strategy", strategy, "--max-new-tokens", 12, "--json", *extra)
        assert result.exit_code == 0, result.output
        payload = last_json(result.stdout)
        assert set(payload) == {"text", "token_ids", "strategy", "metrics"}
        assert payload["strategy"] == strategy
        for key in ("new_tokens", "cycles", "mean_accepted_length", "tokens_per_s", "draft_s", "verify_s", "head_s",
                    "mean_active_vocab", "active_hit_rate", "coverage", "leaf_hits", "accept_by_position"):
            assert key in payload["metrics"]
        outs[strategy] = payload["token_ids"]
    assert outs["full"] == outs["ar"] == outs["fr"] == outs["fr-pa"]


def test_generate_prints_text_and_a_summary_line(tiny_dirs):
    result = run("generate", PROMPT, *model_args(tiny_dirs), "--max-new-tokens", 6)
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.stdout.strip().splitlines()[-1]
    assert "mean accepted length" in result.stdout.strip().splitlines()[-1]


def test_generate_with_lookup_equals_ar_and_says_what_the_lookup_drafted(tiny_dirs):
    """``--strategy full+ngram`` (and ``ar+ngram``, no draft) on a prompt that repeats itself: ``ar``'s tokens in
    float32, and the summary line counts the lookup's cycles."""
    prompt = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"
    ids = {}
    for strategy in ("ar", "full+ngram", "ar+ngram"):
        result = run("generate", prompt, *model_args(tiny_dirs), "--strategy", strategy, "--max-new-tokens", 12, "--json")
        assert result.exit_code == 0, result.output
        payload = last_json(result.stdout)
        ids[strategy] = payload["token_ids"]
        if strategy != "ar":
            assert payload["metrics"]["lookup_cycles"] > 0
            assert "lookup drafted" in " ".join(result.output.split())  # the summary line, however wrapped
    assert ids["full+ngram"] == ids["ar"] == ids["ar+ngram"]


def test_bench_writes_json(tiny_dirs, tmp_path, token_map):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "a", "task": "code", "prompt": "w1 w2 w3"},
                {"id": "b", "task": "chat", "messages": [{"role": "user", "content": "w9 w8"}]},
                {"id": "c", "task": "chat", "prompt": "w4 w4 w4"},
            ]
        )
    )
    out = tmp_path / "bench.json"
    result = run("bench", "--prompts", prompts, "--strategies", "ar,full,fr", "--ids", "a,b", "--max-new-tokens", 8,
                 "--json", out, "--token-map", token_map, *model_args(tiny_dirs)[:-3], "--dtype", "float32")
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert len(data["generations"]) == 2 * 3
    assert {g["id"] for g in data["generations"]} == {"a", "b"}
    for g in data["generations"]:
        assert set(g) >= {"id", "task", "strategy", "token_ids", "text", "metrics"}
    assert set(data["summary"]) == {"ar", "full", "fr"}
    assert data["summary"]["full"]["all"]["matches_ar"] == 1.0
    assert set(data["summary"]["fr"]) == {"code", "chat", "all"}


@pytest.mark.parametrize(
    "args, words",
    [
        (["generate", "   "], ["empty"]),
        (["generate", PROMPT, "--strategy", "nope"], ["unknown strategy", "nope"]),
        (["generate", PROMPT, "--strategy", "fr"], ["--token-map"]),
        (["generate", PROMPT, "--strategy", "fr", "--token-map", "/no/such/map.pt"], ["does not exist"]),
        (["generate", PROMPT, "--dtype", "float8"], ["dtype"]),
        (["generate", PROMPT, "--draft-weights", "int4"], ["draft weights", "int4"]),
        (["generate", PROMPT, "--dtype", "bfloat16", "--prepack"], ["--prepack", "float32"]),
        (["generate", PROMPT, "--strategy", "dynaspec"], ["--bundle", "train-router"]),
        (["generate", PROMPT, "--strategy", "evospec"], ["--bundle", "hnsw"]),
        (["generate", PROMPT, "--strategy", "hybrid"], ["--token-map"]),
        (["generate", PROMPT, "--bundle", "/no/such/bundle.safetensors"], ["bundle"]),
    ],
)
def test_bad_input_one_line_error(tiny_dirs, args, words):
    cmd = args[:2] + model_args(tiny_dirs)[:-2] + args[2:]
    assert_one_line_error(run(*cmd), *words)


def test_missing_model_path(tiny_dirs):
    result = run("generate", PROMPT, "--target", "/no/such/model", "--draft", tiny_dirs["draft"], "--quiet")
    assert_one_line_error(result, "does not exist")


def test_incompatible_draft_is_refused(tiny_dirs):
    result = run("generate", PROMPT, *model_args(tiny_dirs, draft="alien"))
    assert_one_line_error(result, "tokenizers do not match")


@pytest.mark.parametrize(
    "content, words",
    [
        (b"not a torch file", ["not readable"]),
        ("range", ["out of range"]),
        ("dupes", ["repeats"]),
        ("floats", ["integer"]),
    ],
)
def test_bad_token_maps(tiny_dirs, tmp_path, content, words):
    path = tmp_path / "map.pt"
    if content == "range":
        torch.save([1, 2, 5000], path)
    elif content == "dupes":
        torch.save([1, 2, 2], path)
    elif content == "floats":
        torch.save(torch.tensor([1.0, 2.0]), path)
    else:
        path.write_bytes(content)
    result = run("generate", PROMPT, *model_args(tiny_dirs), "--strategy", "fr", "--token-map", path)
    assert_one_line_error(result, *words)


def test_bench_bad_prompt_file(tiny_dirs, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "task": "t"}\n')
    result = run("bench", "--prompts", bad, *model_args(tiny_dirs)[:-3])
    assert_one_line_error(result, "prompt")
    result = run("bench", "--prompts", tmp_path / "missing.jsonl", *model_args(tiny_dirs)[:-3])
    assert_one_line_error(result, "does not exist")
