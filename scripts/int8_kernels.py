"""Candidate int8 kernels for the draft's one-row (and few-row) passes, at the demo draft's shapes, on this CPU.

    PYTHONPATH=$PWD python scripts/int8_kernels.py [--threads 1] [--rows 1,7] [--repeats 30] [--json out.json]

Every kernel computes ``x @ W.T`` for a weight W [out, in] with per-output-channel int8 scales (the float
references read the same W). Variants are interleaved: each repeat runs every variant once, in turn, so a machine
that slows down slows all of them alike; the median of the repeats is reported, and the ratio to float32
``F.linear`` in the same run. Kernels:

- ``f32``: ``F.linear`` in float32 (MKL sgemm); ``f32_onednn``: the oneDNN-packed float32 copy (PrepackedLinear's
  few-row path); ``bf16``: ``F.linear`` over a bfloat16 copy (today's ``--draft-step-dtype bfloat16``).
- ``fbgemm``: ``quantized::linear_prepack`` + ``quantized::linear_dynamic`` (what ``quantize_dynamic`` runs),
  activations quantized per call inside the op.
- ``onednn_q``: ``onednn::qlinear_prepack`` + ``onednn::qlinear_pointwise`` (the inductor x86 quantizer's op),
  activations quantized to uint8 per tensor by us, float32 out.
- ``int8pack``: ``aten._weight_int8pack_mm`` (float activations, int8 weight, per-channel scales).
- ``int_mm``: ``torch._int_mm`` over int8 activations quantized per row by us, then scaled.
- ``dequant``: int8 rows converted to float32 per call, then ``F.linear`` (the reference path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from dynvocab.files import write_atomic

SHAPES = {  # name: (out, in), the demo draft (Qwen2.5-Coder-0.5B) and the 3k / 32k / full head
    "q/o 896x896": (896, 896),
    "k/v 128x896": (128, 896),
    "gate/up 4864x896": (4864, 896),
    "down 896x4864": (896, 4864),
    "head 3072": (3072, 896),
    "head 32768": (32768, 896),
    "head 151936": (151936, 896),
}


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q [out, in] int8, scale [out] float32) with w ≈ q * scale[:, None]."""
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def kernels(w: torch.Tensor, rows: int) -> dict:
    q, scale = quantize_rows(w)
    out_f, in_f = w.shape
    zeros = torch.zeros(out_f, dtype=torch.long)
    qw = torch.quantize_per_channel(w, scale.double(), zeros, 0, torch.qint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fbgemm = torch.ops.quantized.linear_prepack(qw, None)
    fb_warn = [str(c.message)[:80] for c in caught]
    onednn_w = torch.ops.onednn.qlinear_prepack(q, [rows, in_f])
    f32_packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
    wb = w.to(torch.bfloat16)
    qt = q.t().contiguous()  # [in, out] for _int_mm
    wq_deq_scale = scale

    def onednn_q(x):
        s = x.abs().amax().clamp(min=1e-12) / 127.0
        xq = (torch.round(x / s) + 128).clamp(0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(xq, float(s), 128, onednn_w, scale, zeros, None, 1.0, 0,
                                                  torch.float32, "none", [], "")

    def int_mm(x):
        s = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        xq = torch.round(x / s).clamp(-127, 127).to(torch.int8)
        return torch._int_mm(xq, qt).float() * s * scale

    return {
        "f32": lambda x: F.linear(x, w),
        "f32_onednn": lambda x: torch.ops.mkldnn._linear_pointwise(x, f32_packed, None, "none", [], ""),
        "bf16": lambda x: F.linear(x.to(torch.bfloat16), wb).float(),
        "fbgemm": lambda x: torch.ops.quantized.linear_dynamic(x, fbgemm),
        "onednn_q": onednn_q,
        "int8pack": lambda x: torch._weight_int8pack_mm(x, q, wq_deq_scale),
        "int_mm": int_mm,
        "dequant": lambda x: F.linear(x, q.float() * scale[:, None]),
    }, fb_warn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,7")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--skip", default="dequant", help="comma-separated kernels not to run")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    flush = torch.empty(64 << 20, dtype=torch.uint8)  # > L3: each op reads its weight from memory
    results = {"cpu": torch.backends.cpu.get_cpu_capability(), "threads": args.threads, "torch": torch.__version__,
               "times_ms": {}}
    skip = set(args.skip.split(",")) if args.skip else set()
    for shape in args.shapes.split(","):
        out_f, in_f = SHAPES[shape]
        w = torch.randn(out_f, in_f) * 0.02
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, in_f)
            fns, fb_warn = kernels(w, rows)
            fns = {k: v for k, v in fns.items() if k not in skip}
            ref = F.linear(x, w)
            errors = {}
            for name, fn in list(fns.items()):
                try:
                    got = fn(x)
                    errors[name] = float((got - ref).abs().max() / ref.abs().max())
                except Exception as exc:  # a kernel this build lacks for this shape
                    errors[name] = f"{type(exc).__name__}: {str(exc)[:60]}"
                    del fns[name]
            times = {k: [] for k in fns}
            for _ in range(3):
                for fn in fns.values():
                    fn(x)
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    flush.fill_(1)
                    t = time.perf_counter()
                    fn(x)
                    times[name].append((time.perf_counter() - t) * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            key = f"{shape} M={rows}"
            results["times_ms"][key] = {"ms": med, "rel_err": errors, "fbgemm_prepack_warnings": fb_warn}
            line = "  ".join(f"{k} {v:7.3f} ({v / med['f32']:.2f}x)" for k, v in med.items())
            print(f"{key:28s} {line}", flush=True)
            bad = {k: e for k, e in errors.items() if isinstance(e, str)}
            if bad:
                print("   unavailable:", bad)
    if args.json:  # whole or not at all
        write_atomic(args.json, lambda p: p.write_text(json.dumps(results, indent=1) + "\n"))


if __name__ == "__main__":
    main()
