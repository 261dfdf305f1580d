"""``dynvocab bench --llamacpp``: the one-line refusals through the CLI, and the parsing of llama.cpp's output.

The output fixtures are lines recorded from the binaries scripts/build_llamacpp.sh builds (llama-cpp-python 0.3.36's
vendor/llama.cpp, demo pair, 2 threads). No test runs llama.cpp or reads a hub.
"""

from __future__ import annotations

import struct

import pytest
from cli_helpers import assert_one_line_error, run

from dynvocab.bench.engines import llamacpp
from dynvocab.bench.loop.report import llamacpp_note
from dynvocab.bench.loop.summary import summarize_bench
from dynvocab.errors import DynvocabError

COMPLETION_LOG = """\
0.01.890.431 I common_perf_print:    sampling time =       3.97 ms
0.01.890.432 I common_perf_print:    samplers time =       1.51 ms /    71 tokens
0.01.890.440 I common_perf_print:        load time =     259.24 ms
0.01.890.441 I common_perf_print: prompt eval time =     258.77 ms /    39 tokens (    6.64 ms per token,   150.72 tokens per second)
0.01.890.442 I common_perf_print:        eval time =     807.47 ms /    31 runs   (   26.05 ms per token,    38.39 tokens per second)
0.01.890.443 I common_perf_print:       total time =    1072.80 ms /    70 tokens
0.01.890.444 I common_perf_print: unaccounted time =       2.59 ms /   0.2 %      (total - sampling - prompt eval - eval) / (total)
0.01.890.444 I common_perf_print:    graphs reused =         30
"""

SPECULATIVE_LOG = """\
0.03.279.711 I encoded   39 tokens in    0.421 seconds, speed:   92.538 t/s
0.03.279.729 I decoded   38 tokens in    1.644 seconds, speed:   23.110 t/s
0.03.279.740 I
0.03.279.751 I n_draft   = 6
0.03.279.762 I n_predict = 38
0.03.279.773 I n_drafted = 37
0.03.279.784 I n_accept  = 31
0.03.279.795 I accept    = 83.784%
0.03.279.800 I
0.03.279.810 I draft:
0.03.279.964 I spec common_specu: statistics     draft-simple: #calls(b,g,a) =    1      7      7, #gen drafts =      7, \
#acc drafts =     6, #gen tokens =     37, #acc tokens =    31, #mean acc len = 5.43, #acc rate/pos = (0.857, 0.714, \
0.714, 0.714, 0.714, 0.714), dur(b,g,a) = 0.002, 544.264, 0.008 ms
0.03.280.001 I target:
0.03.280.101 I common_perf_print:        eval time =    1544.00 ms /     8 runs   (  193.00 ms per token,     5.18 tokens per second)
"""

PROMPT = "<|im_start|>user\nReverse a string.<|im_end|>\n<|im_start|>assistant\n"


def test_completion_timing_lines():
    p = llamacpp.parse_completion(COMPLETION_LOG)
    assert p == {"prompt_tokens": 39, "prompt_ms": 258.77, "eval_runs": 31, "eval_ms": 807.47, "sampling_ms": 3.97,
                 "new_tokens": 32}


def test_speculative_summary_and_statistics():
    s = llamacpp.parse_speculative(SPECULATIVE_LOG)
    assert s["prompt_tokens"] == 39 and s["encode_s"] == 0.421
    assert s["new_tokens"] == 38 and s["decode_s"] == 1.644
    assert (s["drafted"], s["accepted"], s["cycles"], s["drafter"]) == (37, 31, 7, "draft-simple")
    assert s["accept_by_position"] == [0.857, 0.714, 0.714, 0.714, 0.714, 0.714]
    assert round(s["new_tokens"] / s["cycles"], 2) == 5.43  # the line's own mean accepted length
    assert s["draft_s"] == 0.544264


def test_statistics_without_accepted_cycles():
    line = ("statistics     draft-simple: #calls(b,g,a) =    1      0      0, #gen drafts =      0, #acc drafts =     0, "
            "#gen tokens =      0, #acc tokens =     0\nencoded   5 tokens in 0.1 seconds\ndecoded   1 tokens in 0.1 seconds")
    s = llamacpp.parse_speculative(line)
    assert s["cycles"] == 0 and s["accept_by_position"] == [] and s["drafted"] == 0 and s["draft_s"] is None


def test_missing_lines_are_one_clear_error():
    with pytest.raises(DynvocabError, match="eval time"):
        llamacpp.parse_completion("nothing here")
    with pytest.raises(DynvocabError, match="statistics"):
        llamacpp.parse_speculative(SPECULATIVE_LOG.split("0.03.279.964")[0])


def test_generated_text_from_stdout():
    assert llamacpp.completion_text("def f():\n    pass\n [end of text]\n\n\n") == "def f():\n    pass\n"
    assert llamacpp.completion_text("cut at -n\n\n") == "cut at -n"
    assert llamacpp.speculative_text("\n\n" + PROMPT + "```python\n\n\n", PROMPT) == "```python\n"
    with pytest.raises(DynvocabError, match="echo the prompt"):
        llamacpp.speculative_text("\n\nsomething else", PROMPT)


def _gguf(path, arch: str):
    key, value = b"general.architecture", arch.encode()
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 8)
    path.write_bytes(header + struct.pack("<Q", len(value)) + value)
    return path


def test_gguf_architecture_selects_the_drafter(tmp_path):
    assert llamacpp.gguf_architecture(_gguf(tmp_path / "d.gguf", "qwen2")) == "qwen2"
    head = _gguf(tmp_path / "e3.gguf", "eagle3")
    llama = llamacpp.LlamaCpp(tmp_path, head, head, "t", "d", llamacpp.gguf_architecture(head))
    assert llama.spec_type == "draft-eagle3"
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    with pytest.raises(DynvocabError, match="GGUF magic"):
        llamacpp.gguf_architecture(tmp_path / "x.gguf")


@pytest.fixture
def bin_dir(tmp_path):
    """A folder with stand-ins for both binaries (never run: every refusal comes first)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in llamacpp.BINARIES.values():
        (folder / name).write_text("#!/bin/sh\nexit 1\n")
        (folder / name).chmod(0o755)
    return folder


def test_refused_without_the_binaries(tmp_path):
    result = run("bench", "--llamacpp", tmp_path, "--max-new-tokens", 4)
    assert_one_line_error(result, "--llamacpp", "llama-completion", "llama-speculative-simple", "build_llamacpp")


def test_refused_with_one_binary_missing(bin_dir):
    (bin_dir / "llama-speculative-simple").unlink()
    assert_one_line_error(run("bench", "--llamacpp", bin_dir), "llama-speculative-simple")


def test_refused_for_models_that_are_not_gguf(tiny_dirs, bin_dir, tmp_path):
    result = run("bench", "--llamacpp", bin_dir, "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"])
    assert_one_line_error(result, "GGUF", "--target")
    target = _gguf(tmp_path / "t.gguf", "qwen2")
    result = run("bench", "--llamacpp", bin_dir, "--target", target, "--draft", tiny_dirs["draft"])
    assert_one_line_error(result, "GGUF", "--draft")


def test_refused_when_sampling(bin_dir):
    assert_one_line_error(run("bench", "--llamacpp", bin_dir, "--temperature", 0.7), "greedily")


def test_llama_rows_need_the_option(tiny_dirs):
    result = run("bench", "--strategies", "ar,llama.cpp", "--target", tiny_dirs["target"], "--draft",
                 tiny_dirs["draft"], "--no-chat-template", "--dtype", "float32", "--max-new-tokens", 2)
    assert_one_line_error(result, "--llamacpp BIN_DIR")


def test_llama_rows_match_ar_by_text():
    metrics = {"new_tokens": 3, "cycles": 3, "mean_accepted_length": 1.0, "tokens_per_s": 1.0, "wall_s": 3.0,
               "mean_active_vocab": None}
    ar = {"id": "a", "task": "code", "seed": 0, "strategy": "ar", "token_ids": [1, 2, 3], "text": "x = 1\n",
          "metrics": metrics}
    same = {**ar, "strategy": "llama.cpp", "token_ids": [1, 9], "text": "x = 1", "compare": "text"}
    other = {**ar, "strategy": "llama.cpp-spec", "token_ids": [1, 2, 3], "text": "x = 2", "compare": "text"}
    summary = summarize_bench([ar, same, other], ("ar", "llama.cpp", "llama.cpp-spec"))
    assert summary["llama.cpp"]["all"]["matches_ar"] == 1.0
    assert summary["llama.cpp-spec"]["all"]["matches_ar"] == 0.0


def test_note_names_the_quantization_and_the_timing():
    note = llamacpp_note({"target": "Qwen (GGUF Q4_K_M)", "draft": "draft (GGUF)", "spec_type": "draft-simple"},
                         "bfloat16")
    assert "Q4_K_M" in note and "bfloat16" in note and "same-text" in note and "timing lines" in note
