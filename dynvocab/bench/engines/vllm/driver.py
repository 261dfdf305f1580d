"""Run prompts through a vLLM engine, with and without the plugin's heads: the child process behind
``dynvocab bench --vllm`` and the plugin's engine tests (imports vLLM; run it in an environment that has it).

``python -m dynvocab.bench.engines.vllm.driver REQUEST.json OUT.json``. The request names the target, the prompts
(token ids), decoding settings and the rows:

- ``{"name": "vllm"}``: plain decoding, an engine of its own (``train-draft --self-distill --distill-engine vllm``
  writes its training answers with it: ``stop_token_ids``, every prompt at ``concurrency`` requests in flight);
- ``{"name": "vllm-spec", "speculative_config": {...}}``: vLLM's own speculation with the draft's full head;
- ``{"name": "vllm-spec:lowrank", "speculative_config": {...}, "strategy": "lowrank", "budget": null}``: the same
  engine with the plugin's head switched to a strategy (the draft folder's architecture is the plugin's);
- ``{"name": "vllm-spec:ngram", "speculative_config": {"method": "ngram", ...}, "head": false}``: vLLM's own
  draft-free speculation (prompt lookup), which has no head to switch or time.

``concurrency`` (a list, default ``[1]``; ``batch: true`` = every prompt at once) runs each row at each level of
requests in flight, as a closed loop: each of N users sends its next prompt when its last one finished (through
vLLM's ``LLMEngine.add_request`` / ``step``, as a server's clients would), so the engine holds N requests until
the prompts run out. One result row per row and level.

Rows that share a ``speculative_config`` share one engine: the head is switched between them through
``LLM.collective_rpc`` on the worker methods :class:`~dynvocab.bench.engines.vllm.worker.HeadBench` adds (vLLM's
``worker_extension_cls``: named methods, so nothing is sent by value). Every engine is started first (each warmed by one
short request), then the rows run interleaved, round after round and engine after engine (plain vLLM and ``ngram`` among
them), so the machine's drift falls on every row alike. Every run of a row at a level starts from an empty prefix cache,
so no run reuses keys and values that another row's batches computed (other rows' drafts change the target's verify
shapes, and in bfloat16 the last bits with them). Run the driver with its engine cores in the driver's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as :func:`dynvocab.bench.engines.vllm.rows.engine_env` sets): then its own
``add_request`` / ``step`` calls form every batch, and greedy rounds repeat exactly at every level of requests in
flight. Each strategy's selector is built once per engine and warmed by one untimed request before its first round, so
no timed round pays for building or packing it. Each row gets the generated ids per prompt, the wall time, vLLM's own
spec-decode counters (drafts, draft tokens, accepted tokens, accepted per position), the machine's load over the round
(:mod:`dynvocab.bench.stability`) and, with ``time_head``, the draft head's and the selector's time per call measured in
the worker around the draft's ``compute_logits`` / ``get_top_tokens`` (synchronous on a CPU; elsewhere the timer
synchronises the device before and after each call, so it measures the call and adds the wait it forces: timed rows run
slower there than untimed ones). With ``log_context`` each row also gets ``context_log``: what a context selector read
at each head call (draft position, fed ids, each row's window), the greedy tokens of each head call, and the requests
whose windows the plugin held after the level (the engine tests check the plugin's view of the request against the
output).

The switch between the plugin's head and vLLM's own full head, and the timers, are the bench's
(:class:`~dynvocab.bench.engines.vllm.worker.HeadSwitch`): the served classes (:mod:`dynvocab.serving.vllm.models`)
always run their selector.

The output is written whole (temp file, then rename). Errors are one line on stderr and exit code 2.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

from dynvocab.bench.engines.vllm.worker import EXTENSION
from dynvocab.bench.stability import Probe

SPEC_COUNTERS = {  # vLLM's Prometheus names of the counters a row reports (what /metrics shows a served engine)
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}
SPEC_FIELDS = {"num_drafts": "drafts", "num_draft_tokens": "draft_tokens",
               "num_accepted_tokens": "accepted_tokens"}  # the same, in vLLM's per-step SpecDecodingStats


class SpecCounts:
    """vLLM's spec-decode counters of one engine (drafts, draft tokens, accepted tokens, accepted per position),
    added up from the scheduler's stats of each step: a stat logger the bench adds to that engine's own
    ``StatLoggerManager`` (vLLM's ``StatLoggerBase`` interface: ``record``, ``log``, ...). vLLM's Prometheus
    registry is one per process, and each engine started clears it, so with every engine up at once
    ``LLM.get_metrics`` reads only the last one's."""

    def __init__(self):
        self.totals: dict = {v: 0 for v in SPEC_COUNTERS.values()}
        self.totals["accepted_per_pos"] = []

    def record(self, scheduler_stats, iteration_stats=None, mm_cache_stats=None, engine_idx: int = 0) -> None:
        """Add one step's ``scheduler_stats.spec_decoding_stats``."""
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        if spec is None:
            return
        for name, key in SPEC_FIELDS.items():
            self.totals[key] += int(getattr(spec, name))
        acc, vals = self.totals["accepted_per_pos"], list(spec.num_accepted_tokens_per_pos)
        self.totals["accepted_per_pos"] = [a + b for a, b in itertools.zip_longest(acc, vals, fillvalue=0)]

    def log(self) -> None:
        """Nothing to print (vLLM's own loggers print)."""

    def log_engine_initialized(self) -> None:
        """Nothing to print."""

    def record_sleep_state(self, is_awake: int = 0, level: int = 0) -> None:
        """Nothing to keep."""

    def now(self) -> dict:
        """The counters now (a copy)."""
        return {**self.totals, "accepted_per_pos": list(self.totals["accepted_per_pos"])}


def _delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    b = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    out["accepted_per_pos"] = [x - y for x, y in zip(after["accepted_per_pos"], b)]
    return out


def _register_kernel_overrides_once() -> None:
    """Make vLLM's platform register its kernel overrides once in this process. vLLM-CPU's workers register its
    Triton fallbacks at each start (``v1/worker/worker_base.py:init_worker``); where the engine core and worker run
    in the driver's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), a second engine's registration rescans every
    loaded module and fails on one that the n-gram proposer brings (vllm 0.32.0 ``triton_utils/dispatcher.py:139``:
    ``'_lib_fn_wrapper' object has no attribute 'get'``). The first registration rebinds the kernels for the whole
    process, so the later ones have nothing to do."""
    from vllm.platforms import current_platform

    register = current_platform.register_triton_kernel_overrides
    if getattr(register, "dynvocab_once", False):
        return
    done: list[bool] = []

    def once() -> None:
        if not done:
            done.append(True)
            register()

    once.dynvocab_once = True
    current_platform.register_triton_kernel_overrides = once


def _engine(req: dict, spec: dict | None):
    from vllm import LLM

    _register_kernel_overrides_once()

    kw = dict(model=req["target"], dtype=req.get("dtype", "bfloat16"), enforce_eager=True, seed=req.get("seed") or 0,
              max_model_len=req.get("max_model_len", 2048), max_num_seqs=req.get("max_num_seqs", 8),
              disable_log_stats=False, tensor_parallel_size=req.get("tensor_parallel_size", 1),
              worker_extension_cls=EXTENSION)
    if kw["tensor_parallel_size"] > 1:
        kw["distributed_executor_backend"] = "mp"
    if spec is not None:
        kw["speculative_config"] = spec
    if "enable_prefix_caching" in req:  # as a server to compare with was started; else vLLM's default
        kw["enable_prefix_caching"] = req["enable_prefix_caching"]
    llm = LLM(**kw)
    counts = SpecCounts()
    llm.llm_engine.logger_manager.stat_loggers.append(counts)
    return llm, counts


_REQUEST_IDS = itertools.count()  # vLLM request ids, unique over the engine's life


def _generate(llm, prompts: list[list[int]], params, users: int) -> tuple[list[list[int]], float]:
    """Every prompt through the engine with ``users`` requests in flight (a closed loop, as a benchmark client with
    that many users sends: each sends its next prompt when its last one finished, so the engine always holds
    ``users`` requests until the prompts run out): the generated ids per prompt, in order, and the wall time."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    waiting = list(range(len(prompts)))
    ids: dict[str, int] = {}
    out: dict[int, list[int]] = {}

    def send() -> None:
        i = waiting.pop(0)
        request_id = f"dynvocab-{next(_REQUEST_IDS)}"
        ids[request_id] = i
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompts[i]), params)

    start = time.perf_counter()
    for _ in range(min(users, len(waiting))):
        send()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[ids[o.request_id]] = list(o.outputs[0].token_ids)
                if waiting:
                    send()
    return [out[i] for i in range(len(prompts))], time.perf_counter() - start


def concurrency(req: dict) -> list[int]:
    """The request's levels of requests in flight (``concurrency``; ``batch``: all prompts at once; else one)."""
    if req.get("concurrency"):
        return [int(c) for c in req["concurrency"]]
    return [len(req["prompts"])] if req.get("batch") else [1]


WARM_TOKENS = 16  # a row's warm-up: one prompt, this many tokens, before its first timed round


def _switch_to(llm, row: dict, req: dict, warm: bool) -> None:
    """Switch the engine's draft head to ``row``'s strategy (built once per engine, then reused); with ``warm``, run
    one untimed request through it first (its selector's packs and first-call work), then zero the timer and drop
    what the log kept of it."""
    args = (row.get("strategy"), row.get("budget"), req.get("bundle"), req.get("time_head", False), row.get("ngram"))
    llm.collective_rpc("dynvocab_switch_head", args=args)
    if warm:
        from vllm import SamplingParams

        _generate(llm, req["prompts"][:1], SamplingParams(max_tokens=WARM_TOKENS, ignore_eos=True), 1)
        llm.collective_rpc("dynvocab_read_timer")
    if req.get("log_context"):
        llm.collective_rpc("dynvocab_keep_log")  # from now on: the warm-up's calls are not in it


def run(req: dict) -> dict:
    """Every row of ``req`` (see the module's docstring) at every level of ``concurrency``; returns ``{"rows":
    [...]}``, one per row and level."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=req.get("temperature", 0.0), top_p=req.get("top_p", 1.0),
                            max_tokens=req["max_tokens"], ignore_eos=req.get("ignore_eos", False),
                            stop_token_ids=req.get("stop_token_ids"),
                            seed=req.get("seed", 0) if req.get("temperature", 0.0) > 0 else None)
    levels = concurrency(req)
    groups: dict[str, list[dict]] = {}
    for row in req["rows"]:
        groups.setdefault(json.dumps(row.get("speculative_config"), sort_keys=True), []).append(row)
    results: dict[tuple[str, int], dict] = {}
    probe = Probe()  # the machine's load around each round of each row (this process tree holds the engines)
    engines = {}
    for key in groups:  # every engine up at once, so that the rounds below interleave all rows, plain ones too
        engines[key] = _engine({**req, "max_num_seqs": max(req.get("max_num_seqs", 8), *levels)}, json.loads(key))
        if req.get("warmup", True):
            _generate(engines[key][0], req["prompts"][:1], SamplingParams(max_tokens=4), 1)
    for r in range(req.get("rounds", 1)):
        for key, rows in groups.items():
            llm, spec_counts = engines[key]
            for row in rows:
                # a row with a draft head (every speculative row but vLLM's draft-free ones, "head": false)
                head = row.get("speculative_config") is not None and row.get("head", True)
                if head:
                    _switch_to(llm, row, req, warm=r == 0 and req.get("warmup", True))
                for users in levels:
                    llm.reset_prefix_cache()  # every run from a cold cache: see the module's docstring
                    before = spec_counts.now()
                    probe.start()
                    ids, wall = _generate(llm, req["prompts"], params, users)
                    load = probe.stop()
                    counts = _delta(spec_counts.now(), before)
                    timer = llm.collective_rpc("dynvocab_read_timer")[0] if head else {}  # and zeroed
                    out = results.setdefault((row["name"], users), {"name": row["name"], "concurrency": users,
                                                                    "rounds": []})
                    if head and req.get("log_context"):
                        out.setdefault("context_log", []).append(llm.collective_rpc("dynvocab_take_log")[0])
                    if head and row.get("probe"):
                        out["probe"] = llm.collective_rpc("dynvocab_probe_head", args=(row["probe"], r))  # per rank
                    out["token_ids"] = ids
                    out["rounds"].append({"wall_s": wall, "new_tokens": sum(map(len, ids)), **counts, "head": timer,
                                          "load": load})
    engines.clear()
    return {"rows": [results[(row["name"], users)] for row in req["rows"] for users in levels]}


def main(argv: list[str]) -> int:
    """``REQUEST.json OUT.json``: run, write the result whole."""
    if len(argv) != 2:
        print("usage: python -m dynvocab.bench.engines.vllm.driver REQUEST.json OUT.json", file=sys.stderr)
        return 2
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"vLLM is not installed in {sys.executable} ({e}); see docs/vllm.md", file=sys.stderr)
        return 2
    from dynvocab.files import write_atomic
    from dynvocab.serving.vllm import contract

    lost = contract.missing("bench")
    if lost:
        print(f"dynvocab bench --vllm cannot drive vLLM {contract.vllm_version()}: it lacks {', '.join(lost)} "
              f"(tested: vLLM {', '.join(contract.TESTED_VERSIONS)})", file=sys.stderr)
        return 2
    result = run(json.loads(Path(argv[0]).read_text()))
    write_atomic(Path(argv[1]), lambda tmp: Path(tmp).write_text(json.dumps(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
