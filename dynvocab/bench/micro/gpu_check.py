"""The first hour on a GPU, in one command (``scripts/gpu_check.sh``): tests and step benchmarks into one JSON.

On a CUDA machine it builds random-weight models at real shapes from their configs (nothing is downloaded), runs
the test files that exercise CUDA (the Triton kernels compiled, not interpreted), and times:

- ``graph_step``: :func:`~dynvocab.bench.micro.graph_step.graph_step_bench`, one demo-draft step (Qwen2.5-0.5B shape,
  24 layers, a static KV cache) eagerly and as a replayed ``torch.cuda.CUDAGraph``, with the head over the full
  vocabulary and over packed K-row buffers;
- ``draft_step``: :func:`~dynvocab.bench.micro.draft_step.draft_step_bench` (body and head apart, the fused kernel);
- ``eagle_step``: :func:`~dynvocab.bench.micro.eagle_step.eagle_step_bench` at every shape of ``EAGLE_SHAPES``;
- ``kernels``: :func:`~dynvocab.bench.micro.microbench.run_kernel_bench` at the demo draft's and Llama-3-8B's head;
- ``batch_heads``: :func:`~dynvocab.bench.micro.batch_head_step.batch_head_bench`, every strategy that runs inside
  vLLM but evospec (host-side retrieval), selector and head over 1, 4 and 8 rows as the plugin calls them, eagerly and
  as a CUDA graph;
- ``tree_step``: :func:`~dynvocab.bench.micro.tree_step.tree_step_bench`, EAGLE-2 tree cycles (``--tree``) at
  Gemma-3-270M's shape beside the chain, with the full head and two static sets, and the host reads of each cycle.

Every section runs in a child process under its own time limit, inside an overall budget (10 minutes by default),
so a hang or a broken CUDA context costs one section, not the run; a budget past the default stretches every
section's limit by the same factor (a slower machine, not a hang). With ``--device cpu`` the same sections run at
small shapes (CI runs it so the script cannot rot) and the JSON's ``would_time_on_cuda`` names the settings and
the CUDA-only items the GPU run times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

from dynvocab.bench.micro.draft_step import QWEN2_0_5B
from dynvocab.bench.micro.timing import StepParams
from dynvocab.files import write_atomic
from dynvocab.models.loading import cpu_name

SECTIONS = ("tests", "graph_step", "draft_step", "eagle_step", "kernels", "batch_heads", "tree_step")
LIMIT_S = {"tests": 200, "graph_step": 150, "draft_step": 120, "eagle_step": 200, "kernels": 150,
           "batch_heads": 150, "tree_step": 120}
BUDGET_S = 570  # the whole run, under the 10 minutes a first GPU session has
TINY_DRAFT = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 4096, "max_position_embeddings": 512}
TINY_TREE_TARGET = {"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
                    "sliding_window": 8}
# What the test files use to mark a test as one that runs on CUDA (tests/triton_modes.py).
CUDA_TEST_MARKS = ("needs_cuda", "KERNEL_DEVICE", "kernel_runs_here")
CUDA_ONLY = {
    "tests": "the CUDA parametrizations of the Triton kernel tests, compiled (on CPU: interpreted, TRITON_INTERPRET=1)",
    "graph_step": "torch.cuda.CUDAGraph capture and replay of each draft step, replay vs eager ms and max |diff|",
    "draft_step": "the '<K>_gathered' heads through the fused Triton gathered_logits kernel (on CPU: the reference)",
    "kernels": "the 'fused' method (Triton gathered_logits) and the theoretical DRAM bandwidth",
    "batch_heads": "each strategy's selector + head captured as a torch.cuda.CUDAGraph (or why not), replay ms",
    "tree_step": "EAGLE-2 tree cycles at Gemma-3-270M's shape in bfloat16 (CUDA events): where a 16-60-token pass "
    "costs what a 1-token one does, the seeds' own regime",
}
NOT_CAPTURED = {
    "eagle_step": "not captured: the EAGLE head keeps a DynamicCache (torch.cat per step, cropped on the host), so "
    "its step has no static addresses; timed eagerly",
}


def settings(quick: bool, device: str) -> dict:
    """Each section's shapes and repeats: real shapes (``quick`` False) or small ones (CPU, CI)."""
    from dynvocab.bench.micro.eagle_step import EAGLE_SHAPES

    dtype = "bfloat16" if device == "cuda" else "float32"
    if not quick:
        return {
            "kernels": {"dtype": dtype,
                        "shapes": {"qwen2.5-0.5b-head": (151936, 896), "llama3-8b-head": (128256, 4096)},
                        "sizes": (1024, 2048, 3072, 4096, 8192, 16384, 32768), "ms": (1, 8, 64), "repeats": 20},
            "eagle_step": {"dtype": dtype, "shapes": tuple(EAGLE_SHAPES), "active": (32768, 3072), "repeats": 10},
            "draft_step": {"dtype": dtype, "config": "qwen2-0.5b", "layers": None, "active": (32768, 3072),
                           "repeats": 20},
            "graph_step": {"dtype": dtype, "dims": QWEN2_0_5B, "context": 128, "heads": (32768, 3072), "repeats": 50},
            "batch_heads": {"dtype": dtype, "vocab": 151936, "hidden": 896, "batches": (1, 4, 8), "steps": (0, 3),
                            "context": 1024, "repeats": 20, "bundle_sizes": {}},
            "tree_step": {"dtype": dtype, "target": "gemma3-270m", "shapes": ("4x4x16", "5x8x60", "6x10x60"),
                          "sets": (None, 32768, 1024), "context": 512, "cycles": 16},
        }
    return {
        "kernels": {"dtype": dtype, "shapes": {"tiny-head": (4096, 64)}, "sizes": (256, 1024), "ms": (1, 4),
                    "repeats": 2},
        "eagle_step": {"dtype": dtype, "shapes": ("gemma3-270m-eagle3",), "active": (3072,), "repeats": 2},
        "draft_step": {"dtype": dtype, "config": TINY_DRAFT, "layers": 1, "active": (1024, 128), "repeats": 2},
        "graph_step": {"dtype": dtype, "dims": {**TINY_DRAFT, "num_hidden_layers": 2}, "context": 16,
                       "heads": (1024,), "repeats": 3},
        "batch_heads": {"dtype": dtype, "vocab": 4096, "hidden": 64, "batches": (1, 4), "steps": (0, 3),
                        "context": 256, "repeats": 2,
                        "bundle_sizes": {"clusters": 32, "width": 32, "rank": 16, "candidates": 256, "block": 32,
                                         "blocks": 8}},
        "tree_step": {"dtype": dtype, "target": "tiny", "shapes": ("3x2x5",), "sets": (None, 256), "context": 16,
                      "cycles": 3},
    }


def would_time_on_cuda() -> dict:
    """What ``--device cuda`` times, by section: its settings, the items only CUDA runs, and what is not captured."""
    plan = {name: {"settings": _jsonable(value)} for name, value in settings(False, "cuda").items()}
    plan["tests"] = {"settings": {"files": "tests/test_*.py that mark CUDA tests (" + ", ".join(CUDA_TEST_MARKS) + ")",
                                  "TRITON_INTERPRET": "0"}}
    for name, text in CUDA_ONLY.items():
        plan[name]["cuda_only"] = text
    for name, text in NOT_CAPTURED.items():
        plan[name]["graph"] = text
    return plan


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def environment(device: str, root: Path) -> dict:
    """Versions and the device: what a number in this JSON was measured with."""

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "commit": commit.stdout.strip() or None,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count(),
                   l2_cache_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1))
    else:
        env["device_name"] = cpu_name()
    return env


def cuda_test_files(root: Path) -> list[str]:
    """The test files (relative to ``root``) that hold tests marked to run on CUDA."""
    files = sorted((root / "tests").glob("test_*.py"))
    return [str(f.relative_to(root)) for f in files if any(m in f.read_text() for m in CUDA_TEST_MARKS)]


def run_tests(device: str, root: Path, limit_s: float) -> dict:
    """The CUDA-marked test files in one pytest run with Triton compiling (CUDA) or interpreting (CPU); outcomes
    per test from its JUnit XML: counts, the failed tests' names and messages, and the skip reasons."""
    files = cuda_test_files(root)
    if not files:
        return {"status": "skipped", "reason": f"no CUDA-marked test files under {root / 'tests'}"}
    env = {**os.environ, "TRITON_INTERPRET": "0" if device == "cuda" else "1"}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
        try:
            run = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=limit_s)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "files": files}
        result = {"files": files, "returncode": run.returncode, "TRITON_INTERPRET": env["TRITON_INTERPRET"],
                  "summary": (run.stdout.strip().splitlines() or [""])[-1]}
        if not xml.exists():
            return {**result, "status": "failed", "error": (run.stdout + run.stderr)[-4000:]}
        result.update(_junit_outcomes(xml))
    result["status"] = "ok" if run.returncode == 0 and result["passed"] > 0 else "failed"
    return result


def _junit_outcomes(path: Path) -> dict:
    passed, failed, skipped = 0, {}, {}
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            failed[name] = (bad.get("message") or "")[:500]
        elif skip is not None:
            reason = skip.get("message") or ""
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            passed += 1
    return {"passed": passed, "failed": len(failed), "skipped": sum(skipped.values()), "failures": failed,
            "skip_reasons": skipped}


def run_section(name: str, device: str, quick: bool) -> dict:
    """Run one benchmark section in this process; returns its JSON-ready result."""
    cfg = settings(quick, device)[name]
    if name == "graph_step":
        from dynvocab.bench.micro.graph_step import graph_step_bench

        return graph_step_bench(cfg["dims"], device, cfg["dtype"], cfg["context"], cfg["heads"], cfg["repeats"])
    if name == "draft_step":
        from dynvocab.bench.micro.draft_step import draft_step_bench

        step = StepParams(active=cfg["active"], repeats=cfg["repeats"], warmup=2)
        return draft_step_bench(cfg["config"], device, cfg["dtype"], layers=cfg["layers"], step=step)
    if name == "eagle_step":
        from dynvocab.bench.micro.eagle_step import eagle_step_bench

        step = StepParams(active=cfg["active"], repeats=cfg["repeats"], warmup=1 if quick else 2)
        results = [eagle_step_bench(shape, device=device, dtype=cfg["dtype"], step=step) for shape in cfg["shapes"]]
        return {"results": results, "graph": NOT_CAPTURED["eagle_step"]}
    if name == "kernels":
        from dynvocab.bench.micro.microbench import run_kernel_bench

        return {shape: run_kernel_bench(device, cfg["dtype"], vocab=vocab, dim=dim, sizes=cfg["sizes"], ms=cfg["ms"],
                                        repeats=cfg["repeats"], warmup=1 if quick else 3, flush_cache=not quick)
                for shape, (vocab, dim) in cfg["shapes"].items()}
    if name == "batch_heads":
        from dynvocab.bench.micro.batch_head_step import batch_head_bench

        return batch_head_bench(cfg["vocab"], cfg["hidden"], batches=cfg["batches"], steps=cfg["steps"],
                                context=cfg["context"], device=device, dtype=cfg["dtype"], repeats=cfg["repeats"],
                                warmup=1 if quick else 3, bundle_sizes=cfg["bundle_sizes"])
    if name == "tree_step":
        from dynvocab.bench.micro.tree_step import GEMMA3_270M_TEXT, tree_step_bench

        shape = GEMMA3_270M_TEXT if cfg["target"] == "gemma3-270m" else TINY_TREE_TARGET
        return tree_step_bench(shape, device, cfg["dtype"], shapes=cfg["shapes"], sets=cfg["sets"],
                               context=cfg["context"], cycles=cfg["cycles"])
    raise ValueError(f"unknown section {name!r}; known: {SECTIONS}")


def _child(name: str, device: str, quick: bool, root: Path, limit_s: float) -> dict:
    """Section ``name`` in a child process under ``limit_s`` seconds (a hang or a broken CUDA context stays there)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "section.json"
        args = [sys.executable, "-m", "dynvocab.bench.micro.gpu_check", "--section", name, "--device", device,
                "--result", str(out), "--quick" if quick else "--full"]
        try:
            run = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=limit_s)
        except subprocess.TimeoutExpired:
            return {"status": "timeout"}
        if run.returncode != 0 or not out.exists():
            return {"status": "failed", "returncode": run.returncode, "error": (run.stdout + run.stderr)[-4000:]}
        return {"status": "ok", "result": json.loads(out.read_text())}


def gpu_check(device: str, out: Path, quick: bool, root: Path, budget_s: float = BUDGET_S,
              clock: Callable[[], float] = time.monotonic) -> dict:
    """Every section in turn within ``budget_s`` seconds of ``clock``, each within its limit (stretched by ``budget_s
    / BUDGET_S`` past the default budget) or what is left; writes the JSON to ``out`` and returns it.
    Keys: ``ok``, ``device``, ``quick``, ``started``, ``budget_s``, ``total_s``, ``env``, ``sections`` (per section
    ``status``: ok/failed/timeout/skipped, ``limit_s`` (the seconds it was given, unless skipped), ``seconds``, and
    ``result`` or ``error``/``reason``), ``would_time_on_cuda``."""
    start = clock()
    report = {"ok": False, "device": device, "quick": quick, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "budget_s": budget_s, "total_s": None, "env": environment(device, root), "sections": {},
              "would_time_on_cuda": would_time_on_cuda()}
    for name in SECTIONS:
        left = budget_s - (clock() - start)
        if left < 10:
            report["sections"][name] = {"status": "skipped", "reason": f"the {budget_s:.0f} s budget is spent"}
            continue
        t0 = clock()
        limit = min(LIMIT_S[name] * max(1.0, budget_s / BUDGET_S), left)
        section = run_tests(device, root, limit) if name == "tests" else _child(name, device, quick, root, limit)
        section["limit_s"] = round(limit, 1)
        section["seconds"] = round(clock() - t0, 1)
        report["sections"][name] = section
        print(f"gpu_check: {name}: {section['status']} ({section['seconds']} s)", file=sys.stderr, flush=True)
    report["total_s"] = round(clock() - start, 1)
    report["ok"] = all(s["status"] == "ok" for s in report["sections"].values())
    _write(out, report)
    return report


def _write(path: Path, payload: dict) -> None:
    """``payload`` as JSON at ``path``, whole or not at all (its folder made first)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=1, default=str)
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    """``python -m dynvocab.bench.micro.gpu_check``: the whole check (``--out``), or one section (``--section``, the
    children's entry point). Exit status 0 when every section passed, 1 when one did not, 2 for a bad request."""
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON report")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="quick", action="store_true", default=None,
                      help="small shapes and few repeats (the default on CPU)")
    size.add_argument("--full", dest="quick", action="store_false", help="real shapes (the default on CUDA)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the checkout holding tests/")
    parser.add_argument("--section", choices=SECTIONS[1:], help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.device == "cpu" if args.quick is None else args.quick
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
              "run with --device cpu", file=sys.stderr)
        return 2
    if args.section:
        _write(args.result, _jsonable(run_section(args.section, args.device, quick)))
        return 0
    report = gpu_check(args.device, args.out.resolve(), quick, args.root.resolve(), args.budget_s)
    failed = [name for name, s in report["sections"].items() if s["status"] != "ok"]
    print(f"gpu_check: wrote {args.out} ({report['total_s']} s)" + (f"; not ok: {', '.join(failed)}" if failed else ""),
          file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
