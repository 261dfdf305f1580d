"""Run prompts through a vLLM engine, with and without the plugin's heads: the child process behind
``dynvocab bench --vllm`` and the plugin's engine tests (imports vLLM; run it in an environment that has it).

``python -m dynvocab.serving.vllm.run REQUEST.json OUT.json``. The request names the target, the prompts (token
ids), decoding settings and the rows:

- ``{"name": "vllm"}``: plain decoding, an engine of its own;
- ``{"name": "vllm-spec", "speculative_config": {...}}``: vLLM's own speculation with the draft's full head;
- ``{"name": "vllm-spec:lowrank", "speculative_config": {...}, "strategy": "lowrank", "budget": null}``: the same
  engine with the plugin's head switched to a strategy (the draft folder's architecture is the plugin's).

Rows that share a ``speculative_config`` share one engine: the head is switched between them through
``LLM.collective_rpc`` (``switch_head``), and with ``rounds`` > 1 the rows run interleaved, round after round, so the
machine's drift falls on every row alike. Each row gets the generated ids per prompt, the wall time, vLLM's own
spec-decode counters (drafts, draft tokens, accepted tokens, accepted per position) and, with ``time_head``, the
draft head's and the selector's time per call measured in the worker around the draft's ``compute_logits`` /
``get_top_tokens`` (synchronous on a CPU; on a GPU the timer synchronises the device, which costs time).

The output is written whole (temp file, then rename). Errors are one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _drafter_model(worker):
    """The draft model inside ``worker``'s runner (vLLM's ``model_runner.drafter.model``)."""
    drafter = getattr(worker.model_runner, "drafter", None)
    if drafter is None:
        raise RuntimeError("the engine has no drafter: the row has no speculative_config")
    return drafter.model


def switch_head(worker, strategy: str | None, budget: int | None, bundle: str | None, timed: bool) -> str:
    """Worker-side: run the draft's head with ``strategy`` from ``bundle`` (None: the draft's own full head), and
    time its calls when ``timed``; returns what the head now runs."""
    from dynvocab.artifacts.bundle import load_bundle
    from dynvocab.runtime.policies.batch_select import SelectorSpec, build_selector
    from dynvocab.serving.vllm.head import DraftHeadPolicy

    model = _drafter_model(worker)
    if not hasattr(model, "_dynvocab_timer"):
        _install_timer(model)
    if not hasattr(model, "dynvocab"):
        if strategy is not None:
            raise RuntimeError("the draft is not one of the plugin's classes; export it with --format vllm")
    elif strategy is None:
        model.dynvocab = None
    else:
        text = model.config
        head_vocab = int(getattr(text, "draft_vocab_size", None) or text.vocab_size)
        with load_bundle(bundle) as b:
            selector = build_selector(b, SelectorSpec(strategy, budget), head_vocab, int(text.hidden_size),
                                      model.lm_head.weight.device)
        model.dynvocab = DraftHeadPolicy(selector, int(text.vocab_size), strategy)
        if timed:
            _time_selector(model.dynvocab)
    model._dynvocab_timer.update(on=timed, head_s=0.0, selector_s=0.0, calls=0, rows=0)
    return strategy or "full"


def _install_timer(model) -> None:
    """Wrap the draft's two head entry points with a timer kept on the model."""
    model._dynvocab_timer = {"on": False, "head_s": 0.0, "selector_s": 0.0, "calls": 0, "rows": 0}
    for name in ("compute_logits", "get_top_tokens"):
        inner = getattr(model, name, None)
        if inner is None:
            continue

        def timed(hidden_states, _inner=inner):
            t = model._dynvocab_timer
            if not t["on"]:
                return _inner(hidden_states)
            start = time.perf_counter()
            out = _inner(hidden_states)
            t["head_s"] += time.perf_counter() - start
            t["calls"] += 1
            t["rows"] += int(hidden_states.shape[0])
            return out

        setattr(model, name, timed)


class _TimedSelector:
    """A changing set's selector that adds its calls' time to the policy's ``selector_s``."""

    def __init__(self, selector, policy):
        self.inner, self.policy, self.k = selector, policy, selector.k

    def __call__(self, hidden):
        start = time.perf_counter()
        out = self.inner(hidden)
        self.policy.selector_s += time.perf_counter() - start
        return out


def _time_selector(policy) -> None:
    """Time the policy's selector calls (a static set's selector is left as it is: its rows are packed once, and
    its call is a view of its ids)."""
    from dynvocab.runtime.policies.batch_select import StaticSelector

    policy.selector_s = 0.0
    if not isinstance(policy.head.selector, StaticSelector):
        policy.head.selector = _TimedSelector(policy.head.selector, policy)


def read_timer(worker) -> dict:
    """Worker-side: the head timer since the last switch (head and selector seconds, calls, rows) and the ids the
    head scores per step (the selector's k; the head's rows for the full head)."""
    model = _drafter_model(worker)
    t = dict(getattr(model, "_dynvocab_timer", {}))
    policy = getattr(model, "dynvocab", None)
    t["selector_s"] = float(getattr(policy, "selector_s", 0.0)) if policy is not None else 0.0
    t["ids"] = int(policy.selector.k) if policy is not None else int(
        getattr(model.config, "draft_vocab_size", None) or model.config.vocab_size)
    t.pop("on", None)
    return t


def probe_head(worker, rows: int, seed: int) -> dict:
    """Worker-side check of the plugin's head on ``rows`` random hidden states (the same on every rank): each row's
    set, ``get_top_tokens``, and where the rank has the full rows, the ids where ``compute_logits`` is finite, its
    argmax, and the largest gap between the set's logits and the full head's at the same ids."""
    import torch

    model = _drafter_model(worker)
    weight = model.lm_head.weight
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, weight.shape[1], generator=g) * 4).to(weight.device, weight.dtype)
    with torch.inference_mode():
        _, ids = model._selected(hidden)
        logits = model.compute_logits(hidden)
        top = model.get_top_tokens(hidden)
        saved, model.dynvocab = model.dynvocab, None
        full = model.compute_logits(hidden)
        model.dynvocab = saved
    out = {"sets": [sorted(set(r.tolist())) for r in ids], "top": top.tolist()}
    if logits is not None:  # None on the ranks a tensor-parallel gather leaves without the full rows
        out.update(finite=[torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in logits],
                   argmax=logits.argmax(dim=-1).tolist(), vocab=int(logits.shape[1]),
                   max_gap=max(float((logits[i, ids[i]] - full[i, ids[i]]).abs().max()) for i in range(rows)))
    return out


def _spec_counters(llm) -> dict:
    """vLLM's spec-decode counters now (summed over engines)."""
    out: dict = {v: 0 for v in SPEC_COUNTERS.values()}
    out["accepted_per_pos"] = []
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            vals = list(m.values)
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * (len(vals) - len(acc)), vals)]
    return out


def _delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    b = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    out["accepted_per_pos"] = [x - y for x, y in zip(after["accepted_per_pos"], b)]
    return out


def _engine(req: dict, spec: dict | None):
    from vllm import LLM

    kw = dict(model=req["target"], dtype=req.get("dtype", "bfloat16"), enforce_eager=True, seed=req.get("seed") or 0,
              max_model_len=req.get("max_model_len", 2048), max_num_seqs=req.get("max_num_seqs", 8),
              disable_log_stats=False, tensor_parallel_size=req.get("tensor_parallel_size", 1))
    if kw["tensor_parallel_size"] > 1:
        kw["distributed_executor_backend"] = "mp"
    if spec is not None:
        kw["speculative_config"] = spec
    return LLM(**kw)


def _generate(llm, req: dict, params) -> tuple[list[list[int]], float]:
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req["prompts"]]
    start = time.perf_counter()
    if req.get("batch"):
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def run(req: dict) -> dict:
    """Every row of ``req`` (see the module's docstring); returns ``{"rows": [...]}``."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=req.get("temperature", 0.0), top_p=req.get("top_p", 1.0),
                            max_tokens=req["max_tokens"], ignore_eos=req.get("ignore_eos", False),
                            seed=req.get("seed", 0) if req.get("temperature", 0.0) > 0 else None)
    groups: dict[str, list[dict]] = {}
    for row in req["rows"]:
        groups.setdefault(json.dumps(row.get("speculative_config"), sort_keys=True), []).append(row)
    results: dict[str, dict] = {}
    for key, rows in groups.items():
        llm = _engine(req, json.loads(key))
        if req.get("warmup", True):
            _generate(llm, {**req, "prompts": req["prompts"][:1]}, SamplingParams(max_tokens=4))
        for r in range(req.get("rounds", 1)):
            for row in rows:
                spec = row.get("speculative_config") is not None
                if spec:
                    llm.collective_rpc(switch_head, args=(row.get("strategy"), row.get("budget"),
                                                          req.get("bundle"), req.get("time_head", False)))
                before = _spec_counters(llm)
                ids, wall = _generate(llm, req, params)
                counts = _delta(_spec_counters(llm), before)
                timer = llm.collective_rpc(read_timer)[0] if spec else {}
                out = results.setdefault(row["name"], {"name": row["name"], "rounds": []})
                if row.get("probe"):
                    out["probe"] = llm.collective_rpc(probe_head, args=(row["probe"], r))  # one per rank
                out["token_ids"] = ids
                out["rounds"].append({"wall_s": wall, "new_tokens": sum(map(len, ids)), **counts, "head": timer})
        del llm
    return {"rows": [results[row["name"]] for row in req["rows"]]}


def main(argv: list[str]) -> int:
    """``REQUEST.json OUT.json``: run, write the result whole."""
    if len(argv) != 2:
        print("usage: python -m dynvocab.serving.vllm.run REQUEST.json OUT.json", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc sends switch_head by value
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"vLLM is not installed in {sys.executable} ({e}); see docs/vllm.md", file=sys.stderr)
        return 2
    from dynvocab.files import write_atomic

    result = run(json.loads(Path(argv[0]).read_text()))
    write_atomic(Path(argv[1]), lambda tmp: Path(tmp).write_text(json.dumps(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
