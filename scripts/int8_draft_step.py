"""One draft step of the demo draft (its real weights): int8 as the runtime now steps it (int8 weights, its own
one-token step, runtime/drafts/one_token.py), int8 through transformers' forward (``int8-hf``), the previous default
on an AVX2 CPU (float32 model, bfloat16 one-row copy, transformers' forward: ``bfloat16``), the default on a CPU with
native bf16 (a bfloat16 model: ``bf16-model`` through transformers' forward, ``bf16-model-1t`` through the
one-token step) and float32: body (one token after ``--context`` cached tokens) and head over all rows / a 32k
ranking prefix / a 3k set, through the draft's own head type (``DraftModel._new_head``, one per set so each keeps
its packed rows).

    PYTHONPATH=$PWD python scripts/int8_draft_step.py [--threads 1] [--repeats 15] [--json out.json]

Variants are interleaved (each repeat times every variant in turn), medians reported, ratios within one run.
The 32k head is a prefix of one fixed ranking, as FR-Spec's (int8: its own fbgemm pack once warmed up); the 3k
head is one packed set reused (a context window's within a cycle; int8: its gathered, dequantized rows).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from dynvocab.files import write_atomic
from dynvocab.models import load_model, resolve_model
from dynvocab.models.prepack import prepack_linears, quantize_linears, step_weight_bytes
from dynvocab.models.rows import Int8Rows
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.heads.active_set import ActiveSet, Prefix


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--variants", default="int8,int8-hf,bfloat16,bf16-model,bf16-model-1t,float32")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = load_model(resolve_model("demo:draft"), "cpu", "float32")
    drafts = {}
    for name in args.variants.split(","):
        model = copy.deepcopy(base)
        if name.startswith("int8"):
            quantize_linears(model, model.get_output_embeddings())
        elif name == "bfloat16":  # the previous AVX2 default: oneDNN packs for few rows + a bf16 one-row copy
            prepack_linears(model, packed=True, row_dtype=torch.bfloat16)
        elif name.startswith("bf16-model"):  # a CPU with native bf16: the whole model in bfloat16
            model = model.to(torch.bfloat16)
        lm = DraftModel(model, one_token_steps=name in ("int8", "bf16-model-1t"))  # the others: transformers' forward
        drafts[name] = (lm, step_weight_bytes(model) + lm.fused_bytes)
    vocab = drafts[next(iter(drafts))][0].vocab_size
    gen = torch.Generator().manual_seed(0)
    ranking = torch.randperm(vocab, generator=gen)
    window = torch.randperm(vocab, generator=gen)[:3072]
    sets = {  # a ranking's prefix and a kept window: sets whose keys say the head may reuse its packed rows
        "full": ActiveSet.full(vocab),
        "32k": ActiveSet.of(Prefix(ranking, min(32768, vocab))),
        "3k": ActiveSet.of(Prefix.whole(window)),
    }
    prompt = torch.randint(vocab, (args.context,), generator=gen)
    token = torch.randint(vocab, (1,), generator=gen)
    hidden, heads = {}, {}
    with torch.inference_mode():
        for name, (lm, _) in drafts.items():
            lm.reset()
            lm.step(prompt)
            hidden[name] = lm.step(token)
            lm.rollback(args.context)
            heads[name] = {part: lm._new_head() for part in sets}  # one head per set: each keeps its packed rows
            for part, s in sets.items():  # warm the packed rows (int8: past PACK_AFTER, the prefix is packed)
                for _ in range(Int8Rows.PACK_AFTER + 1):
                    heads[name][part].logits(hidden[name], s)

        def body(lm):
            lm.step(token)
            lm.rollback(args.context)

        times = {(n, part): [] for n in drafts for part in ("body", *sets)}
        for _ in range(args.repeats):
            for name, (lm, _) in drafts.items():
                t = time.perf_counter()
                body(lm)
                times[(name, "body")].append(time.perf_counter() - t)
                for part, s in sets.items():
                    t = time.perf_counter()
                    heads[name][part].logits(hidden[name], s)
                    times[(name, part)].append(time.perf_counter() - t)
    ms = {f"{n}/{p}": 1e3 * statistics.median(v) for (n, p), v in times.items()}
    out = {"threads": args.threads, "cpu": torch.backends.cpu.get_cpu_capability(), "context": args.context,
           "ms": ms, "prepared_bytes": {n: b for n, (_, b) in drafts.items()}}
    for name in drafts:
        b = ms[f"{name}/body"]
        heads = "  ".join(f"head {p} {ms[f'{name}/{p}']:6.2f} (share {ms[f'{name}/{p}'] / (b + ms[f'{name}/{p}']):.0%})"
                          for p in sets)
        print(f"{name:9s} body {b:7.2f} ms  {heads}  prepared {drafts[name][1] / 2**20:,.0f} MiB")
    for ref in ("bfloat16", "bf16-model"):
        for name in drafts:
            if name != ref and ref in drafts:
                print(f"{name} / {ref}: body {ms[f'{name}/body'] / ms[f'{ref}/body']:.2f}x, "
                      + ", ".join(f"head {p} {ms[f'{name}/{p}'] / ms[f'{ref}/{p}']:.2f}x" for p in sets))
    if args.json:  # whole or not at all
        write_atomic(args.json, lambda p: p.write_text(json.dumps(out, indent=1) + "\n"))


if __name__ == "__main__":
    main()
