"""EAGLE checkpoints in the published layouts, written with random weights and loaded the way users load them
(``--draft DIR``): every strategy equals ``ar``; heads built for another target are refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from cli_helpers import assert_one_line_error, run
from conftest import random_eagle3

from dynvocab.bench.micro.timing import StepParams
from dynvocab.builders.draft.init import init_eagle1_from_target
from dynvocab.models.eagle import EAGLE1, EAGLE3, EagleModel, config_like, save_eagle
from dynvocab.models.int8 import int8_supported

PROMPT = "w1 w2 w3 w4 w5 w1 w2"
STRATEGIES = ("full", "fr", "fr-pa", "microspec", "hybrid")


@pytest.fixture(scope="module")
def heads(tiny_dirs, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"], dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("eagle")
    eagle1 = init_eagle1_from_target(EagleModel(config_like(target.config, EAGLE1)).eval(), target)
    with torch.no_grad():
        eagle1.fc.weight.add_(0.05 * torch.randn_like(eagle1.fc.weight))
    cfg3 = config_like(target.config, EAGLE3, draft_vocab_size=48, aux_hidden_states=(1, 1, 2))
    eagle3 = random_eagle3(cfg3)  # every other target id: EOS (95) is outside
    dirs = {
        "eagle": save_eagle(eagle1, root / "eagle"),
        "eagle3": save_eagle(eagle3, root / "eagle3", embeddings=True),
        "speculators": save_eagle(eagle3, root / "speculators", layout="speculators", target_name="tiny"),
        "wide": save_eagle(EagleModel(replace(eagle1.config, hidden_size=48, num_attention_heads=4)), root / "wide"),
        "vocab": save_eagle(EagleModel(replace(eagle1.config, vocab_size=100)), root / "vocab"),
    }
    return dirs


@pytest.fixture(scope="module")
def token_map(tmp_path_factory):
    path = tmp_path_factory.mktemp("maps") / "freq.pt"
    torch.save(list(range(0, 96, 3)), path)
    return path


def generate(tiny_dirs, draft, strategy, *extra):
    result = run(
        "generate", PROMPT, "--target", tiny_dirs["target"], "--draft", draft, "--no-chat-template", "--quiet",
        "--dtype", "float32", "--strategy", strategy, "--max-new-tokens", 16, "--json", *extra,
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["eagle", "eagle3", "speculators"])
def test_every_strategy_equals_ar(tiny_dirs, heads, token_map, layout):
    ar = generate(tiny_dirs, heads[layout], "ar")["token_ids"]
    for strategy in STRATEGIES:
        extra = ["--token-map", token_map] if strategy in ("fr", "fr-pa", "hybrid") else []
        out = generate(tiny_dirs, heads[layout], strategy, *extra)
        assert out["token_ids"] == ar, (layout, strategy)
        assert out["metrics"]["cycles"] > 0


def test_sampling_runs_with_an_eagle3_head(tiny_dirs, heads):
    a = generate(tiny_dirs, heads["eagle3"], "full", "--temperature", "0.8", "--seed", "3")
    b = generate(tiny_dirs, heads["eagle3"], "full", "--temperature", "0.8", "--seed", "3")
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) > 0


@pytest.mark.parametrize("name,words", [("wide", ["hidden size 48", "32"]), ("vocab", ["100 ids", "96"])])
def test_heads_for_another_target_are_refused(tiny_dirs, heads, name, words):
    result = run("generate", PROMPT, "--target", tiny_dirs["target"], "--draft", heads[name], "--no-chat-template",
                 "--quiet", "--dtype", "float32", "--strategy", "full")
    assert_one_line_error(result, *words)


def test_bench_reports_the_eagle_head(tiny_dirs, heads, token_map, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "task": "code", "prompt": p})
                                 for i, p in (("a", "w1 w2 w3"), ("b", "w4 w5 w4 w5"))))
    out = tmp_path / "bench.json"
    result = run("bench", "--prompts", prompts, "--strategies", "ar,full,fr", "--max-new-tokens", 8, "--json", out,
                 "--token-map", token_map, "--target", tiny_dirs["target"], "--draft", heads["eagle3"],
                 "--no-chat-template", "--dtype", "float32")
    assert result.exit_code == 0, result.output
    assert "EAGLE-3 head draft" in result.output
    data = json.loads(out.read_text())
    assert data["config"]["draft"] == "EAGLE-3 head"
    assert data["summary"]["fr"]["all"]["matches_ar"] == 1.0
    assert 0.0 < data["summary"]["full"]["all"]["head_share_of_draft"] < 1.0
    assert data["oracle"]["all"]["tokens_per_s"] > 0


def test_eagle_step_bench_shapes():
    from dynvocab.bench.micro import eagle_step

    eagle_step.EAGLE_SHAPES["tiny-eagle3"] = dict(kind="eagle3", draft_vocab_size=4000, hidden_size=64,
                                                   intermediate_size=128, num_attention_heads=4,
                                                   num_key_value_heads=2, vocab_size=9000)
    try:
        r = eagle_step.eagle_step_bench("tiny-eagle3", step=StepParams(active=(32768, 3072), repeats=2, warmup=1))
    finally:
        del eagle_step.EAGLE_SHAPES["tiny-eagle3"]
    assert r["head_rows"] == 4000 and set(r["step_ms"]) == {"full", "3072"}  # 32k > the draft vocabulary
    fc, q, kv, o, mlp, norms = 3 * 64 * 64, 2 * 64 * 64, 2 * (2 * 64 * 32), 64 * 64, 3 * 64 * 128, 4 * 64
    assert r["layer_params"] == fc + q + kv + o + mlp + norms  # 2d-wide q/k/v, 16-wide heads, 2 kv heads
    assert r["ratio"]["full"] == 1.0 and r["body_ms"] > 0


@pytest.mark.skipif(not int8_supported("cpu"), reason="this torch has no fbgemm")
def test_eagle_step_bench_times_int8_weights_as_the_runtime_steps_them():
    from dynvocab.bench.micro import eagle_step

    eagle_step.EAGLE_SHAPES["tiny-eagle1"] = dict(kind="eagle", hidden_size=64, intermediate_size=128,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=9000)
    try:
        step = StepParams(active=(5000, 3072), repeats=2, warmup=1)
        plain = eagle_step.eagle_step_bench("tiny-eagle1", step=step)
        r = eagle_step.eagle_step_bench("tiny-eagle1", step=step, weights="int8")
    finally:
        del eagle_step.EAGLE_SHAPES["tiny-eagle1"]
    assert plain["weights"] == "float32" and r["weights"] == "int8"
    steps = {"full", "5000", "3072", "lowrank", "centroids"}  # an EAGLE-1 head: the candidate selectors too
    assert set(r["step_ms"]) == set(plain["step_ms"]) == steps and r["layer_params"] == plain["layer_params"]
    assert r["body_ms"] > 0 and all(t > 0 for t in r["step_ms"].values())


def test_eagle_step_refuses_a_step_dtype_other_than_the_dtype():
    result = run("microbench", "eagle-step", "--device", "cpu", "--dtype", "float32", "--draft-weights", "bfloat16")
    assert_one_line_error(result, "eagle-step", "pass --dtype bfloat16")
