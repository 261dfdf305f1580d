"""llama.cpp as bench rows (``dynvocab bench --llamacpp BIN_DIR``), and the build of its binaries.

* ``llama.cpp`` — plain greedy decoding, ``llama-completion`` (``tools/completion/completion.cpp``).
* ``llama.cpp-spec`` — its speculative decoding, ``llama-speculative-simple``
  (``examples/speculative-simple/speculative-simple.cpp``): ``--spec-type draft-simple`` with the draft GGUF, or
  ``draft-eagle3`` when the draft GGUF is an EAGLE-3 head (``general.architecture = eagle3``). The draft length
  and its confidence stop are bench's: ``--spec-draft-n-max γ --spec-draft-p-min stop_below``.

Both run on the GGUF files as stored (the demo target is Q4_K_M), on the prompt ids bench built (written as their
template text, which must re-tokenize to the same ids), greedy, with bench's ``--max-new-tokens`` and threads.
Every figure comes from llama.cpp's own log lines, parsed by :func:`parse_completion` and
:func:`parse_speculative`:

* ``llama-completion``: ``common_perf_print`` (``common/sampling.cpp:558-578``): ``prompt eval time``,
  ``eval time = … ms / N runs`` and ``sampling time``. ``wall_s`` = prompt eval + eval + sampling (prefill
  included, loading excluded, as the ``hf-*`` rows are timed); new tokens = N + 1 (the last sampled token is never
  evaluated, ``completion.cpp:544-683``); one target pass per token.
* ``llama-speculative-simple``: ``encoded N tokens in S seconds`` and ``decoded N tokens in S seconds``
  (``speculative-simple.cpp:349-350``; ``wall_s`` = both), ``n_drafted`` / ``n_accept`` (``:355-356``) and the
  drafter's ``statistics`` line at trace level (``common/speculative.cpp:2967``, ``-lv 4``): verification
  passes (``#calls(b,g,a)``'s accept count, one per pass), accepted share by draft position, and the time spent
  drafting (``dur(b,g,a)``'s g; ``verify_s`` = decode time − drafting: the target's passes, the draft's pass over
  each verified batch, ``common/speculative.cpp:262-300``, and sampling).

``llama-speculative-simple`` stops only after a pass that takes it past ``-n``, so it may emit up to γ tokens more
than asked: its rate counts every token it emitted in its time, its text is cut at ``--max-new-tokens`` tokens.
llama.cpp prints text, not token ids: a row's ``token_ids`` are its text re-tokenized, and its ``= ar`` compares
text with ``ar``'s (the record's ``compare`` is ``"text"``). With a quantized GGUF against bench's
bfloat16/float32 weights the texts differ by design; the rate says how often they still agree.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dynvocab.errors import DynvocabError

VERSION = "0.3.36"  # the registry's llama-cpp-python sdist whose vendor/llama.cpp is built
PLAIN, SPEC = "llama.cpp", "llama.cpp-spec"
LLAMA_ROWS = (PLAIN, SPEC)
BINARIES = {PLAIN: "llama-completion", SPEC: "llama-speculative-simple"}
BUILD_HINT = "build them with scripts/build_llamacpp.sh"
EAGLE3_ARCH = "eagle3"


@dataclass(frozen=True)
class LlamaCpp:
    """What the llama.cpp rows run: the binaries' folder and the GGUF files (``draft_arch``: the draft GGUF's
    ``general.architecture``; ``eagle3`` selects ``draft-eagle3``)."""

    bin_dir: Path
    target: Path
    draft: Path
    target_label: str
    draft_label: str
    draft_arch: str = ""

    @property
    def spec_type(self) -> str:
        """``llama-speculative-simple --spec-type``: the EAGLE-3 drafter for an EAGLE-3 head, else a draft model."""
        return "draft-eagle3" if self.draft_arch == EAGLE3_ARCH else "draft-simple"

    def describe(self) -> dict:
        """JSON-ready: what the rows ran (bench's ``config.llamacpp``)."""
        return {
            "bin_dir": str(self.bin_dir), "target_gguf": str(self.target), "draft_gguf": str(self.draft),
            "target": self.target_label, "draft": self.draft_label, "spec_type": self.spec_type,
            "timing": "llama.cpp's own timing lines (prefill included, loading excluded)",
            "compare": "text",
        }


def check_binaries(bin_dir: str | Path) -> Path:
    """``bin_dir`` resolved, refusing in one line a folder without both executables."""
    folder = Path(bin_dir).expanduser()
    missing = [name for name in BINARIES.values() if not os.access(folder / name, os.X_OK) or not (folder / name).is_file()]
    if missing:
        raise DynvocabError(f"--llamacpp {bin_dir}: no executable {', '.join(missing)} there; {BUILD_HINT}")
    return folder.resolve()


def gguf_path(source: str, flag: str) -> tuple[Path, str]:
    """The GGUF file behind a ``--target`` / ``--draft`` argument and a label for it: a ``.gguf`` path as is,
    ``demo:NAME`` assembled once from its chunk packages into the cache; anything else is refused in one line."""
    source = source.strip()
    if source.startswith("demo:"):
        from dynvocab.models.demo import DEMO_MODELS, assemble_gguf, cache_root

        name = source.split(":", 1)[1]
        if name not in DEMO_MODELS:
            raise DynvocabError(f"unknown demo model '{source}'; use {', '.join('demo:' + n for n in DEMO_MODELS)}")
        model = DEMO_MODELS[name]
        out = cache_root() / "gguf" / f"{name}-{model.sha256[:12]}.gguf"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            assemble_gguf(model, out)
        return out, model.original
    path = Path(source).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise DynvocabError(
            f"--llamacpp runs GGUF files, and {flag} {source} is not one; pass {flag} a .gguf file or a demo:* model"
        )
    return path.resolve(), path.name


def gguf_architecture(path: Path) -> str:
    """``general.architecture`` of a GGUF file, read from its header ('' when the key is not among the first ones)."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if head[:4] != b"GGUF":
        raise DynvocabError(f"{path} is not a GGUF file (no GGUF magic); pass a .gguf file")
    key = b"general.architecture"
    at = head.find(struct.pack("<Q", len(key)) + key)
    if at < 0:
        return ""
    at += 8 + len(key) + 4  # the key, then its value type (a string)
    (size,) = struct.unpack_from("<Q", head, at)
    return head[at + 8: at + 8 + size].decode("utf-8", "replace")


def prepare(bin_dir: str | Path, target: str, draft: str) -> LlamaCpp:
    """Check everything the llama.cpp rows need before any model loads; refusals are one line."""
    folder = check_binaries(bin_dir)
    target_path, target_label = gguf_path(target, "--target")
    draft_path, draft_label = gguf_path(draft, "--draft")
    return LlamaCpp(folder, target_path, draft_path, target_label, draft_label, gguf_architecture(draft_path))


def prompt_text(tokenizer, prompt_ids: list[int]) -> str:
    """The prompt as text llama.cpp tokenizes back to ``prompt_ids`` (special tokens parsed as such)."""
    text = tokenizer.decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if tokenizer(text, add_special_tokens=False)["input_ids"] != list(prompt_ids):
        raise DynvocabError("the prompt's text does not re-tokenize to its ids; llama.cpp cannot be given the same prompt")
    return text


# -- parsing llama.cpp's output -------------------------------------------------------------------------------
_NUM = r"([\d.]+)"
_PERF = {
    "prompt_ms": re.compile(r"prompt eval time =\s*" + _NUM + r" ms /\s*(\d+) tokens"),
    "eval_ms": re.compile(r"\beval time =\s*" + _NUM + r" ms /\s*(\d+) runs"),
    "sampling_ms": re.compile(r"sampling time =\s*" + _NUM + r" ms"),
}
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+" + _NUM + r" seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+" + _NUM + r" seconds")
_STATS = re.compile(
    r"statistics\s+(\S+): #calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+), #gen drafts =\s*(\d+), #acc drafts =\s*(\d+), "
    r"#gen tokens =\s*(\d+), #acc tokens =\s*(\d+)(?:, #mean acc len = ([\d.]+), #acc rate/pos = \(([^)]*)\))?"
    r"(?:, dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms)?"
)
END_OF_TEXT = " [end of text]\n"  # completion.cpp:929, printed after an end-of-generation token


def _match(pattern: re.Pattern, log: str, what: str) -> re.Match:
    m = pattern.search(log)
    if m is None:
        raise DynvocabError(f"llama.cpp printed no {what} line; is BIN_DIR's build the one scripts/build_llamacpp.sh makes?")
    return m


def parse_completion(log: str) -> dict:
    """``llama-completion``'s timing lines: ``{prompt_tokens, prompt_ms, eval_runs, eval_ms, sampling_ms,
    new_tokens}`` (``new_tokens`` = eval runs + 1: the last sampled token is not evaluated)."""
    prompt = _match(_PERF["prompt_ms"], log, "'prompt eval time'")
    evals = _match(_PERF["eval_ms"], log, "'eval time'")  # ``… ms / N runs``: the prompt's line says tokens
    sampling = _PERF["sampling_ms"].search(log)
    return {
        "prompt_tokens": int(prompt.group(2)), "prompt_ms": float(prompt.group(1)),
        "eval_runs": int(evals.group(2)), "eval_ms": float(evals.group(1)),
        "sampling_ms": float(sampling.group(1)) if sampling else 0.0,
        "new_tokens": int(evals.group(2)) + 1,
    }


def parse_speculative(log: str) -> dict:
    """``llama-speculative-simple``'s summary: ``{prompt_tokens, encode_s, new_tokens, decode_s, drafted, accepted,
    drafter, cycles, accepted_tokens, accept_by_position, draft_s}`` (``draft_s``: the drafter's time generating
    drafts, ``dur(b,g,a)``'s g; None where the line has no durations)."""
    enc = _match(_ENCODED, log, "'encoded … tokens'")
    dec = _match(_DECODED, log, "'decoded … tokens'")
    stats = _match(_STATS, log, "drafter 'statistics' (-lv 4)")
    drafted = re.search(r"n_drafted = (\d+)", log)
    accepted = re.search(r"n_accept\s+= (\d+)", log)
    rates = stats.group(10)
    return {
        "prompt_tokens": int(enc.group(1)), "encode_s": float(enc.group(2)),
        "new_tokens": int(dec.group(1)), "decode_s": float(dec.group(2)),
        "drafted": int(drafted.group(1)) if drafted else int(stats.group(7)),
        "accepted": int(accepted.group(1)) if accepted else int(stats.group(8)),
        "drafter": stats.group(1), "cycles": int(stats.group(4)), "accepted_tokens": int(stats.group(8)),
        "accept_by_position": [float(v) for v in rates.split(",") if v.strip()] if rates else [],
        "draft_s": float(stats.group(12)) / 1e3 if stats.group(12) else None,
    }


def completion_text(stdout: str) -> str:
    """The generated text of ``llama-completion --no-display-prompt``: its stdout without the closing blank lines
    (``completion.cpp:949``) and the end-of-text marker."""
    text = stdout.removesuffix("\n\n")
    return text.removesuffix(END_OF_TEXT)


def speculative_text(stdout: str, prompt: str) -> str:
    """The generated text of ``llama-speculative-simple``: its stdout is ``\\n\\n`` + the prompt's pieces + the
    generated pieces + ``\\n\\n`` (``speculative-simple.cpp:92-95, 347``)."""
    text = stdout.removeprefix("\n\n")
    if not text.startswith(prompt):
        raise DynvocabError("llama-speculative-simple did not echo the prompt as expected; cannot separate its reply")
    return text[len(prompt):].removesuffix("\n\n")


# -- running a row ---------------------------------------------------------------------------------------------
def _metrics(new_tokens: int, cycles: int, wall_s: float, prefill_s: float, verify_s: float | None) -> dict:
    from dynvocab.runtime.decoding.metrics import Metrics

    m = Metrics().as_dict()
    m.update(
        new_tokens=new_tokens, cycles=cycles,
        mean_accepted_length=round(new_tokens / cycles, 5) if cycles else 0.0,
        tokens_per_s=round(new_tokens / wall_s, 5) if wall_s > 0 else 0.0,
        wall_s=round(wall_s, 5), prefill_s=round(prefill_s, 5),
        verify_s=None if verify_s is None else round(verify_s, 5),
        draft_s=None, head_s=None, policy_s=None, mean_active_vocab=None, active_hit_rate=None, coverage=None,
        head_rows_copied=None, leaves=None, leaf_hits=None, draft_steps=None, accept_by_position=[],
        lookup_cycles=None, lookup_drafted=None, lookup_accepted=None,
    )
    return m


def _run(cmd: list[str]) -> tuple[str, str]:
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    if p.returncode:
        tail = [line for line in p.stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
        raise DynvocabError(f"{Path(cmd[0]).name} failed ({p.returncode}): {tail[0][:200]}")
    return p.stdout, p.stderr


def generate(llama: LlamaCpp, row: str, prompt: str, prompt_tokens: int, max_new_tokens: int, threads: int,
             gamma: int, p_min: float) -> tuple[str, dict]:
    """Run one llama.cpp row on one prompt (text); returns ``(generated text, metrics dict)``."""
    ctx = prompt_tokens + max_new_tokens + gamma + 16
    common = ["-t", str(threads), "-tb", str(threads), "--temp", "0", "--top-k", "1", "--seed", "0",
              "-c", str(ctx), "-b", str(ctx), "-ub", "512", "--no-escape"]
    with tempfile.TemporaryDirectory(prefix="dynvocab-llamacpp-") as tmp:
        path = Path(tmp) / "prompt.txt"
        # -f drops one trailing newline (common/arg.cpp:1807-1809); the template's own must stay
        path.write_text(prompt + "\n", encoding="utf-8")
        if row == PLAIN:
            out, log = _run([str(llama.bin_dir / BINARIES[PLAIN]), "-m", str(llama.target), "-f", str(path),
                             "-n", str(max_new_tokens), *common, "-no-cnv", "--no-display-prompt", "--no-warmup",
                             "-lv", "3"])
            p = parse_completion(log)
            wall = (p["prompt_ms"] + p["eval_ms"] + p["sampling_ms"]) / 1e3
            return completion_text(out), _metrics(p["new_tokens"], p["new_tokens"], wall, p["prompt_ms"] / 1e3,
                                                  p["eval_ms"] / 1e3)
        if row != SPEC:
            raise DynvocabError(f"unknown llama.cpp row '{row}'; use one of {', '.join(LLAMA_ROWS)}")
        # -n max_new - 1: speculative-simple stops only once past -n tokens (speculative-simple.cpp:181-185, 338)
        out, log = _run([str(llama.bin_dir / BINARIES[SPEC]), "-m", str(llama.target), "-md", str(llama.draft),
                         "--spec-type", llama.spec_type, "--spec-draft-n-max", str(gamma),
                         "--spec-draft-p-min", f"{p_min:g}", "-f", str(path), "-n", str(max(max_new_tokens - 1, 1)),
                         *common, "-lv", "4"])
    s = parse_speculative(log)
    verify = None if s["draft_s"] is None else max(s["decode_s"] - s["draft_s"], 0.0)  # passes over verified batches
    m = _metrics(s["new_tokens"], s["cycles"], s["encode_s"] + s["decode_s"], s["encode_s"], verify)
    m["draft_s"] = None if s["draft_s"] is None else round(s["draft_s"], 5)
    m["accept_by_position"] = [round(v, 4) for v in s["accept_by_position"]]
    m["draft_steps"] = s["drafted"]
    return speculative_text(out, prompt), m


# -- building the binaries from the registry's sdist -----------------------------------------------------------
def _build_step(cmd: list, log: Path) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    p = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    log.write_text(p.stdout)
    if p.returncode:
        tail = "\n".join(p.stdout.splitlines()[-25:])
        raise DynvocabError(f"failed ({p.returncode}): {' '.join(map(str, cmd))} (log: {log})\n{tail}")


def llama_tree(work: Path) -> Path:
    """``vendor/llama.cpp`` of the registry's llama-cpp-python ``VERSION`` sdist, downloaded and unpacked in
    ``work`` unless it is there already."""
    tree = work / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not tree.is_dir():
        sdist = work / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            _build_step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                         f"llama-cpp-python=={VERSION}", "-d", work], work / "download.log")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
    return tree


def build(tree: Path, work: Path, jobs: int) -> Path:
    """Build ``llama-completion`` and ``llama-speculative-simple`` from ``tree`` in ``work/build`` (Release,
    ``GGML_NATIVE=ON``, no curl); returns the binaries' folder (``--llamacpp``'s BIN_DIR)."""
    out = work / "build"
    if not (out / "build.ninja").is_file() and not (out / "Makefile").is_file():
        ninja = any((Path(p) / "ninja").is_file() for p in os.environ.get("PATH", "").split(os.pathsep))
        _build_step(["cmake", "-S", tree, "-B", out, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                     "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF"]
                    + (["-G", "Ninja"] if ninja else []), work / "cmake.log")
    _build_step(["cmake", "--build", out, "-j", str(jobs), "--target", *BINARIES.values()], work / "build.log")
    return out / "bin"
