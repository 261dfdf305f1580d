"""The engine test of the plugin's per-request state across vLLM's request lifecycle (run as a child process by
tests/test_vllm_context.py with vLLM's Python): ``python vllm_lifecycle.py REQUEST.json OUT.json``.

One engine setting, plain and with the plugin's draft folder: prefix caching on, prefill chunks of
``CHUNK`` tokens, a KV cache of ``BLOCKS`` blocks. Scenarios, each run on both engines: requests sent at different
steps with different lengths; two requests sharing a prompt prefix (the second finds it cached); a prompt longer
than a prefill chunk; more requests than the KV cache holds (vLLM preempts and recomputes); a request aborted mid
way beside one that finishes; ``SEQUENCE`` short requests one after another, reading after each how many requests
the plugin holds windows for. Writes each scenario's outputs, vLLM's preemption and prefix-cache counters, and the
plugin's held counts.
"""

from __future__ import annotations

import json
import sys

CHUNK, BLOCKS, SEQUENCE = 32, 10, 50  # a state that outlived its request shows from the second one on


def _engine(req: dict, spec: dict | None):
    from vllm import LLM

    from dynvocab.bench.engines.vllm.worker import EXTENSION

    kw = dict(model=req["target"], dtype="float32", enforce_eager=True, seed=0, max_model_len=256, max_num_seqs=4,
              disable_log_stats=False, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=CHUNK,
              num_gpu_blocks_override=BLOCKS, block_size=32, worker_extension_cls=EXTENSION)
    return LLM(**kw, **({"speculative_config": spec} if spec else {}))


def _run(llm, plan: list[tuple[int, list[int], int]], abort: set[str] = frozenset()) -> dict[str, list[int]]:
    """``plan``: (step to send at, prompt, max_tokens) per request; requests named in ``abort`` are aborted at their
    third step. Returns each finished request's ids."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine, out, step, sent = llm.llm_engine, {}, 0, {}
    pending = sorted(enumerate(plan), key=lambda x: x[1][0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, n) = pending.pop(0)
            name = f"r{i}-{id(plan)}-{step}"
            sent[name] = (i, step)
            engine.add_request(name, TokensPrompt(prompt_token_ids=prompt),
                               SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for o in engine.step():
            if o.finished:
                out[str(sent[o.request_id][0])] = list(o.outputs[0].token_ids)
        for name, (i, at) in sent.items():
            if str(i) in abort and step == at + 3 and engine.has_unfinished_requests():
                engine.abort_request([name])
        step += 1
    return out


def _counters(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if "preempt" in m.name or "prefix_cache" in m.name:
            out[m.name] = out.get(m.name, 0) + int(getattr(m, "value", 0) or 0)
    return out


def scenarios(llm, plugin: bool, base_len: int = 48, preempt_tokens: int = 60) -> dict:
    """Every scenario on ``llm``; with ``plugin``, the plugin's held windows after each of the sequence.
    ``base_len``: the shared prompt prefix (an EAGLE engine drops a cached prefix's last block, so it needs a longer
    one for a hit); ``preempt_tokens``: each of the preempted scenario's 4 requests' tokens."""
    base = list(range(10, 10 + base_len))
    result = {
        "staggered": _run(llm, [(0, [5, 6, 7, 8], 20), (2, [9, 10, 11], 9), (3, [12, 13, 14, 15, 16], 30),
                                (9, [40, 41], 14)]),
        "prefix": {**_run(llm, [(0, base + [3, 4, 5], 12)]), **{"1": _run(llm, [(0, base + [60, 61], 12)])["0"]}},
        "long": _run(llm, [(0, [(7 * i) % 250 + 3 for i in range(150)], 16)]),
        "preempt": _run(llm, [(0, [20 + j + i for j in range(30)], preempt_tokens) for i in range(4)]),
        "abort": _run(llm, [(0, [70, 71, 72, 73], 40), (0, [80, 81, 82], 20)], abort={"0"}),
    }
    held, last = [], {}
    for i in range(SEQUENCE):
        result.setdefault("sequence", {}).update({str(i): _run(llm, [(0, [3 + i % 200, 4, 5], 4)])["0"]})
        if plugin:
            last = llm.collective_rpc("dynvocab_take_log")[0][-1]
            held.append(last["held"])
    result["held"] = held
    result["selector"] = last.get("selector")  # a selector's own counters, over the engine's life
    result["counters"] = _counters(llm)
    return result


def checked_run(tmp_path, request: dict) -> dict:
    """``request`` through this script in a child process (the engine environment of :mod:`vllm_models`), and the
    checks every plugin must pass: each scenario's outputs equal plain vLLM's, the scenarios hit the prefix cache and
    preempted, and after each of the sequence the plugin held state for at most the one request vLLM ran. Returns
    the plugin engine's part of the result."""
    import os
    import subprocess
    from pathlib import Path

    from vllm_models import ENGINE_ENV

    req, out = tmp_path / "request.json", tmp_path / "out.json"
    req.write_text(json.dumps(request))
    proc = subprocess.run([sys.executable, str(Path(__file__)), str(req), str(out)], env={**os.environ, **ENGINE_ENV},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    result = json.loads(out.read_text())
    plain, plugin = result["plain"], result["plugin"]
    for scenario in ("staggered", "prefix", "long", "preempt", "abort", "sequence"):
        assert plugin[scenario] == plain[scenario], scenario
    assert list(plugin["abort"]) == ["1"] and len(plugin["sequence"]) == SEQUENCE
    counters = plugin["counters"]
    assert counters["vllm:prefix_cache_hits"] > 0 and counters["vllm:num_preemptions"] > 0, counters
    assert len(plugin["held"]) == SEQUENCE and all(0 <= n <= 1 for n in plugin["held"])
    return plugin


def main(argv: list[str]) -> int:
    req = json.loads(open(argv[0]).read())
    out = {"plain": None, "plugin": None}
    llm = _engine(req, None)
    sizes = {k: req[k] for k in ("base_len", "preempt_tokens") if k in req}
    out["plain"] = scenarios(llm, False, **sizes)
    del llm
    llm = _engine(req, req["speculative_config"])
    llm.collective_rpc("dynvocab_switch_head", args=(req["strategy"], req.get("budget"), req["bundle"], False))
    out["plugin"] = scenarios(llm, True, **sizes)
    with open(argv[1], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
