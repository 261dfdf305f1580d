"""Every bad argument is one line and a non-zero exit, through the real CLI on tiny local models; a Ctrl-C prints
what was done so far and exits 130."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import assert_one_line_error, run

from dynvocab.artifacts import FreqTable, ModelFingerprint, Stage, write_bundle

PROMPT = "w1 w2 w3 w4 w5"
FP = ModelFingerprint(vocab_size=96, tokenizer_sha256="a" * 64, head_rows=96, hidden_size=32, source="t")


def models(dirs):
    return ["--target", dirs["target"], "--draft", dirs["draft"], "--no-chat-template", "--dtype", "float32"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Prompt files, a bundle with only a freq stage, and one whose header promises more bytes than it holds."""
    root = tmp_path_factory.mktemp("inputs")
    rows = {
        "good": [{"id": "a", "task": "code", "prompt": "w1 w2 w3"}, {"id": "b", "task": "chat", "prompt": "w4 w5"}],
        "dupes": [{"id": "a", "task": "code", "prompt": "w1"}, {"id": "a", "task": "chat", "prompt": "w2"}],
        "no_prompt": [{"id": "a", "task": "code", "prompt": "w1"}, {"id": "b", "task": "chat"}],
    }
    paths = {}
    for name, content in rows.items():
        paths[name] = root / f"{name}.jsonl"
        paths[name].write_text("\n".join(json.dumps(r) for r in content) + "\n")
    paths["bad_json"] = root / "bad_json.jsonl"
    paths["bad_json"].write_text('{"id": "a", "prompt": "w1"}\n{"id": "b", "prompt": \n')
    freq = FreqTable(torch.arange(96).flip(0), torch.arange(96), torch.tensor([95]))
    paths["freq_only"] = write_bundle(root / "freq.safetensors", [Stage("freq", freq.to_tensors(), {}, {})], FP, FP)
    data = bytearray(paths["freq_only"].read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].decode().replace('"shape":[96]', '"shape":[960]', 1)
    header = header[:-1] if header.endswith(" ") else header  # safetensors pads the header with spaces
    assert len(header) == n
    paths["bad_shape"] = root / "bad_shape.safetensors"
    paths["bad_shape"].write_bytes(bytes(data[:8]) + header.encode() + bytes(data[8 + n :]))
    paths["folder"] = root
    return paths


# (arguments after the command and its model flags, words the one line must hold); {name} is a path from `files`.
GENERATE = [
    (["--gamma", "0"], ["--gamma"]),
    (["--gamma", "1000"], ["--gamma", "32"]),
    (["--gamma", "three"], ["--gamma", "integer"]),
    (["--temperature", "-1"], ["--temperature", "≥ 0"]),
    (["--temperature", "nan"], ["--temperature", "finite"]),
    (["--temperature", "inf"], ["--temperature", "finite"]),
    (["--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["--top-p", "1.5"], ["--top-p", "(0, 1]"]),
    (["--top-p", "nan"], ["--top-p", "(0, 1]"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--max-new-tokens", "-5"], ["--max-new-tokens"]),
    (["--pa-k-max", "-3"], ["--pa-k-max"]),
    (["--fr-size", "-1"], ["--fr-size"]),
    (["--fr-size", "0"], ["--fr-size"]),
    (["--k-pre", "0"], ["--k-pre"]),
    (["--k-ver", "-1"], ["--k-ver"]),
    (["--window", "0"], ["--window"]),
    (["--core-size", "-10"], ["--core-size"]),
    (["--hybrid-window", "0"], ["--hybrid-window"]),
    (["--step-neighbours", "-1"], ["--step-neighbours"]),
    (["--k-max", "0"], ["--k-max"]),
    (["--stop-below", "2"], ["--stop-below"]),
    (["--branch-below", "-0.5"], ["--branch-below"]),
    (["--threads", "0"], ["--threads"]),
    (["--threads", "-2"], ["--threads"]),
    (["--tree", "4x0x8"], ["--tree 4x0x8", "1 or more"]),
    (["--tree", "abc"], ["--tree", "DEPTHxTOPKxTOKENS"]),
    (["--tree", "2x2x9"], ["--tree 2x2x9", "grows 6 candidate tokens"]),
    (["--tree", "3x2x6"], ["--tree needs an EAGLE head", "drafts chains"]),
    (["--bogus-flag"], ["No such option"]),
    (["--strategy", "dynaspec", "--bundle", "{freq_only}"], ["dynaspec", "clusters, router", "train-router"]),
    (["--strategy", "evospec", "--bundle", "{freq_only}"], ["evospec", "hnsw, graph", "build-index --stages hnsw"]),
    (["--strategy", "fr", "--bundle", "{bad_shape}"], ["damaged"]),
    ([" ".join(["w1"] * 600)], ["longer than the target's context of 512"]),
    ([" ".join(["w2"] * 480), "--max-new-tokens", "64"], ["leaves room for", "--max-new-tokens"]),
]

BENCH = [
    (["--top-p", "0"], ["--top-p", "(0, 1]"]),
    (["--temperature", "nan"], ["--temperature"]),
    (["--gamma", "0"], ["--gamma"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--pa-k-max", "-1"], ["--pa-k-max"]),
    (["--threads", "0"], ["--threads"]),
    (["--num-prompts", "0"], ["--num-prompts"]),
    (["--seeds", "a,b"], ["--seeds"]),
    (["--tree", "9x"], ["--tree", "DEPTHxTOPKxTOKENS"]),
    (["--prompts", "{good}", "--strategies", "ar,full@wide"], ["--tree", "wide"]),
    (["--prompts", "{good}", "--strategies", "ar,full@tree"], ["--tree needs an EAGLE head", "drop --tree"]),
    (["--seeds", "1,1"], ["--seeds", "distinct"]),
    (["--prompts", "{bad_json}"], ["bad_json.jsonl:2", "not valid JSON"]),
    (["--prompts", "{no_prompt}"], ["no_prompt.jsonl:2", "'prompt'", "'messages'"]),
    (["--prompts", "{dupes}"], ["dupes.jsonl:2", "repeats id 'a'", "line 1"]),
    (["--prompts", "{good}", "--ids", "a,zz"], ["--ids", "zz"]),
    (["--prompts", "{good}", "--strategies", "ar,nope"], ["nope"]),
    (["--prompts", "{good}", "--json", "/no/such/folder/out.json"], ["/no/such/folder", "--json", "does not exist"]),
    (["--prompts", "{good}", "--csv", "/proc/out.csv"], ["/proc", "--csv", "cannot be written"]),
    (["--prompts", "{good}", "--json", "{folder}"], ["--json", "is a folder"]),
    (["--prompts", "{good}", "--strategies", "ar,dynaspec", "--bundle", "{freq_only}"], ["dynaspec", "router"]),
]

OTHERS = [
    (["build-index", "--out", "/no/such/folder/b.safetensors"], ["/no/such/folder", "does not exist"]),
    (["build-index", "--out", "/proc/b.safetensors"], ["/proc", "cannot be written"]),
    (["build-index", "--out", "{folder}/b.safetensors", "--max-docs", "0"], ["--max-docs"]),
    (["build-index", "--out", "{folder}/b.safetensors", "--num-clusters", "-4"], ["--num-clusters"]),
    (["build-index", "--out", "{folder}/b.safetensors", "--hnsw-threads", "0"], ["--hnsw-threads"]),
    (["build-index", "--out", "{folder}/b.safetensors", "--stages", "freq,nope"], ["unknown stage", "nope"]),
    (["train-router", "--bundle", "{freq_only}", "--lr", "nan"], ["--lr"]),
    (["train-router", "--bundle", "{freq_only}", "--epochs", "0"], ["--epochs"]),
    (["train-router", "--bundle", "{freq_only}", "--out", "/no/such/folder/b.safetensors"], ["does not exist"]),
    (["export", "{freq_only}", "--out", "{folder}/m.pt", "--size", "0"], ["--size"]),
    (["export", "{freq_only}", "--out", "/no/such/folder/m.pt"], ["does not exist"]),
    (["inspect", "{bad_shape}"], ["damaged"]),
]


def fill(args, files):
    return [a.format(**{k: str(v) for k, v in files.items()}) if "{" in a else a for a in args]


@pytest.mark.parametrize("args, words", GENERATE, ids=[" ".join(a)[:40] for a, _ in GENERATE])
def test_generate_bad_input(tiny_dirs, files, args, words):
    args = fill(args, files)
    prompt, rest = (args[0], args[1:]) if not args[0].startswith("--") else (PROMPT, args)
    assert_one_line_error(run("generate", prompt, *models(tiny_dirs), "--quiet", *rest), *words)


@pytest.mark.parametrize("args, words", BENCH, ids=[" ".join(a)[:40] for a, _ in BENCH])
def test_bench_bad_input(tiny_dirs, files, args, words):
    assert_one_line_error(run("bench", *models(tiny_dirs), *fill(args, files)), *words)


@pytest.mark.parametrize("args, words", OTHERS, ids=[" ".join(a)[:40] for a, _ in OTHERS])
def test_build_and_bundle_commands_bad_input(files, args, words):
    assert_one_line_error(run(*fill(args, files)), *words)


@pytest.mark.parametrize(
    "error, words",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), ["out of memory", "--max-new-tokens"]),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"), ["out of memory"]),
        (MemoryError(), ["out of memory", "--max-new-tokens"]),
        (RuntimeError("shape '[960]' is invalid for input of size 96\nmore detail"), ["RuntimeError", "shape '[960]'"]),
    ],
)
def test_runtime_failures_are_one_line(tiny_dirs, monkeypatch, error, words):
    from dynvocab.runtime.decoding import loop

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(loop, "run_cycle", fail)  # a failure inside the decoding loop
    assert_one_line_error(run("generate", PROMPT, *models(tiny_dirs), "--quiet"), *words)


def test_ctrl_c_in_generate_prints_the_tokens_so_far(tiny_dirs, monkeypatch):
    from dynvocab.runtime.decoding import loop

    real, emitted = loop.run_cycle, []

    def interrupted_second(*args, **kwargs):  # Ctrl-C inside the second cycle
        if emitted:
            raise KeyboardInterrupt
        cycle = real(*args, **kwargs)
        emitted.extend(cycle.emitted)
        return cycle

    monkeypatch.setattr(loop, "run_cycle", interrupted_second)
    result = run("generate", PROMPT, *models(tiny_dirs), "--quiet", "--json")
    assert result.exit_code == 130 and emitted
    assert json.loads(result.stdout.strip().splitlines()[-1])["token_ids"] == emitted
    assert f"error: interrupted after {len(emitted)} new tokens" in result.output and "Traceback" not in result.output


def test_ctrl_c_in_bench_writes_the_finished_rows(tiny_dirs, files, tmp_path, monkeypatch):
    from dynvocab.bench.loop import runner

    real, calls = runner.generate_row, []

    def interrupted_third(*args, **kwargs):
        if args[3].max_new_tokens == 6:  # a timed row (each row's untimed warm-up first is not counted)
            calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "generate_row", interrupted_third)
    out, csv = tmp_path / "bench.json", tmp_path / "bench.csv"
    result = run("bench", *models(tiny_dirs), "--prompts", files["good"], "--strategies", "ar,full",
                 "--max-new-tokens", 6, "--json", out, "--csv", csv)
    assert result.exit_code == 130, result.output
    assert "error: interrupted after 2 of 4 rows" in result.output and "Traceback" not in result.output
    data = json.loads(out.read_text())
    assert data["interrupted"] is True
    assert [(g["id"], g["strategy"]) for g in data["generations"]] == [("a", "ar"), ("a", "full")]
    assert csv.read_text().count("\n") >= 2


def test_bench_takes_top_p(tiny_dirs, files, tmp_path):
    out = tmp_path / "b.json"
    result = run("bench", *models(tiny_dirs), "--prompts", files["good"], "--ids", "a", "--strategies", "ar,full",
                 "--max-new-tokens", 6, "--temperature", 0.8, "--top-p", 0.9, "--json", out)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["config"]["top_p"] == 0.9


def test_generate_and_bench_share_the_strategy_flags():
    import typer

    from dynvocab.cli import app
    from dynvocab.cli.common import strategy_flag_params

    commands = typer.main.get_command(app).commands
    shared = strategy_flag_params()
    assert {p.name for p in shared} >= {  # the shared flags, those the strategies contribute among them
        "gamma", "stop_below", "branch_below", "temperature", "top_p", "seed", "token_map", "fr_size", "pa_k_max",
        "k_pre", "k_ver", "window", "core_size", "hybrid_window", "step_neighbours", "step_successors", "k_max",
        "online_align", "bundle",
    }
    for field in shared:
        options = [{p.name: p for p in commands[c].params}[field.name] for c in ("generate", "bench")]
        assert options[0].opts == options[1].opts == [f"--{field.name.replace('_', '-')}"] or field.name == "online_align"
        assert options[0].default == options[1].default == field.default
