"""The public Python API on tiny local models: the same tokens and metrics as the CLI, streaming, bench rows,
one-line refusals that never exit, a light import, and ``help(dynvocab)`` listing the API."""

from __future__ import annotations

import json
import pydoc
import subprocess
import sys

import pytest
import torch
from cli_helpers import run

import dynvocab
from dynvocab.errors import DynvocabError

pytestmark = [pytest.mark.transformers_api, pytest.mark.usefixtures("one_thread")]

PROMPT = "w1 w2 w3 w4 w5"
HEAVY = ("torch", "transformers", "safetensors", "numpy", "triton", "tokenizers", "huggingface_hub", "typer", "rich")


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    return dynvocab.load(target=str(tiny_dirs["target"]), draft=str(tiny_dirs["draft"]), dtype="float32")


def test_the_cli_and_the_api_give_the_same_tokens_and_metrics_keys(pair, tiny_dirs):
    for strategy in ("ar", "full", "microspec"):
        result = run("generate", PROMPT, "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"],
                     "--dtype", "float32", "--no-chat-template", "--quiet", "--strategy", strategy,
                     "--max-new-tokens", 12, "--json")
        assert result.exit_code == 0, result.output
        cli = json.loads(result.stdout.strip().splitlines()[-1])
        api = pair.generate(PROMPT, strategy, chat_template=False, max_new_tokens=12, timing=True)
        assert api.token_ids == cli["token_ids"] and api.text == cli["text"], strategy
        assert set(api.as_dict()) == set(cli) and set(api.as_dict()["metrics"]) == set(cli["metrics"])
        assert api.metrics.new_tokens == len(api.token_ids) and api.strategy == strategy


def test_stream_yields_the_generated_text(pair):
    whole = pair.generate(PROMPT, "full", chat_template=False, max_new_tokens=16)
    pieces = list(pair.stream(PROMPT, "full", chat_template=False, max_new_tokens=16))
    assert "".join(pieces) == whole.text and len(pieces) >= 1
    stream = pair.stream(PROMPT, "full", chat_template=False, max_new_tokens=16)
    next(stream, None)
    stream.close()  # closing early stops the generation; the pair stays usable
    assert pair.generate(PROMPT, "full", chat_template=False, max_new_tokens=16).token_ids == whole.token_ids


def test_bench_returns_the_rows_the_cli_prints(pair):
    calls = []
    out = pair.bench([("a", "w1 w2 w3 w1 w2"), "w4 w5 w6"], strategies=["ar", "full"], chat_template=False,
                     max_new_tokens=6, progress=lambda stage, done, total: calls.append((stage, done, total)))
    assert [r["strategy"] for r in out.rows] == ["ar", "full"]
    assert out.rows[1]["matches_ar"] == 1.0 and out.rows[0]["tokens_per_s"] > 0
    assert {g["id"] for g in out.generations} == {"a", "p1"}
    assert calls[-1][0].startswith("bench") and calls[-1][1:] == (4, 4)
    pandas = pytest.importorskip("pandas")
    frame = out.to_pandas()
    assert isinstance(frame, pandas.DataFrame) and list(frame.index) == ["ar", "full"]


def test_refusals_raise_one_line_errors_and_never_exit(pair):
    cases = [
        (lambda: pair.generate(PROMPT, "nope"), "unknown strategy 'nope'"),
        (lambda: pair.generate(PROMPT, "full", max_tokens=3), "unknown decoding setting max_tokens"),
        (lambda: pair.generate(" ", "full"), "the prompt is empty"),
        (lambda: pair.generate(PROMPT, "full", max_new_tokens=0), "max_new_tokens must be at least 1"),
        (lambda: pair.bench([], strategies=["ar"]), "no prompts"),
        (lambda: dynvocab.load(device="tpu"), "unknown device 'tpu'"),
        (lambda: dynvocab.export("missing.safetensors", "x.pt", format="onnx"), "unknown export format 'onnx'"),
    ]
    for call, words in cases:
        with pytest.raises(DynvocabError, match=words) as err:
            call()
        assert "\n" not in str(err.value)


def test_export_writes_what_the_cli_writes(tmp_path):
    from dynvocab.artifacts import FreqTable, ModelFingerprint, Stage, write_bundle

    fp = ModelFingerprint(vocab_size=96, tokenizer_sha256="a" * 64, head_rows=96, hidden_size=32, source="t")
    ranking = torch.randperm(96, generator=torch.Generator().manual_seed(0))
    freq = FreqTable(torch.ones(96, dtype=torch.long), ranking, torch.tensor([95]))
    bundle = write_bundle(tmp_path / "b.safetensors", [Stage("freq", freq.to_tensors(), {}, {})], fp, fp)
    api_out = dynvocab.export(bundle, tmp_path / "api.pt", format="sglang", size=10)
    result = run("export", bundle, "--out", tmp_path / "cli.pt", "--format", "sglang", "--size", 10)
    assert result.exit_code == 0, result.output
    assert torch.load(api_out) == torch.load(tmp_path / "cli.pt") == ranking[:10].tolist()


def test_import_is_light_and_help_lists_the_api():
    code = ("import json, sys; import dynvocab; light = sorted(sys.modules); dynvocab.Pair; "
            "print(json.dumps([light, sorted(sys.modules)]))")
    light, used = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                            check=True).stdout)
    assert [m for m in HEAVY if m in light] == []
    assert {m for m in light if m.split(".")[0] == "dynvocab"} == {"dynvocab", "dynvocab.errors", "dynvocab.version"}
    assert {"torch", "dynvocab.api"} <= set(used)  # the API's first use loads them: the check sees what is imported
    text = pydoc.render_doc(dynvocab, renderer=pydoc.plaintext)
    for name in ("load", "build_index", "train_router", "export", "Pair", "GenerationResult", "BenchResult"):
        assert name in text, name
    assert "Load a target and its draft once" in text and "Run every row on every prompt" in text


def test_the_cli_bench_and_the_api_bench_give_the_same_tokens_and_keys(pair, tiny_dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "task": "code", "prompt": "w1 w2 w3 w1 w2"}))
    out = tmp_path / "bench.json"
    result = run("bench", "--prompts", prompts, "--strategies", "ar,full", "--max-new-tokens", 6, "--json", out,
                 "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--dtype", "float32",
                 "--no-chat-template")
    assert result.exit_code == 0, result.output
    cli = json.loads(out.read_text())
    api = pair.bench([("a", "w1 w2 w3 w1 w2")], strategies=["ar", "full"], chat_template=False, max_new_tokens=6)
    assert [g["token_ids"] for g in api.generations] == [g["token_ids"] for g in cli["generations"]]
    assert set(api.raw["summary"]) == set(cli["summary"]) == {"ar", "full"}
    assert set(api.rows[1]) - {"strategy"} == set(cli["summary"]["full"]["all"])
