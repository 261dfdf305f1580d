"""The bench driver with the runner's record as async scheduling leaves it (run as a child process by
tests/test_vllm_context.py with vLLM's Python): ``python vllm_async_record.py REQUEST.json OUT.json``.

Under async scheduling (vLLM's default for EAGLE on GPU engines; vLLM-CPU forces it off) the model runner writes -1
placeholders into ``input_batch.token_ids_cpu`` where each step's sampled tokens go, and the real ones to the device
only (vllm 0.32.0 ``v1/worker/gpu_model_runner.py:_bookkeeping_sync``). Here every proposal hook call sees the
record so: each output position of every request is -1 (the prompt stays), restored right after the hook read it
(the synchronous engine itself reads the record for its inputs). The plugin must take the outputs from what the hook
announced at earlier steps. Writes the driver's rows as :mod:`dynvocab.bench.engines.vllm.driver` does, and under ``"read"``
every attribute the hook read off vLLM's objects, named by the class of the object it was read from (its MRO), for
tests/test_vllm_contract.py's check of the seams by object.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


class Recorder:
    """A view of a vLLM object that notes each attribute read off it (``module:Class.attr`` for every class of its
    MRO from vLLM) in ``read``, and hands vLLM objects it returns out as recorders too."""

    def __init__(self, obj, read: set):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_read", read)

    def __getattr__(self, name):
        obj = object.__getattribute__(self, "_obj")
        read = object.__getattribute__(self, "_read")
        classes = [c for c in type(obj).__mro__ if c.__module__.startswith("vllm")]
        read.add(tuple(f"{c.__module__}:{c.__qualname__}.{name}" for c in classes))
        value = getattr(obj, name)
        return Recorder(value, read) if type(value).__module__.startswith("vllm") else value


READ: set = set()  # what the hook read, as tuples of equivalent names (one per class of the object's MRO)


def with_placeholders(announce):
    """``announce`` that reads a record whose output positions hold -1, as under async scheduling."""

    def announce_async(runner, scheduler_output, sampled):
        batch = runner.input_batch
        rows = batch.num_reqs
        saved = batch.token_ids_cpu[:rows].copy()
        for row, request in enumerate(batch.req_ids[:rows]):
            start = runner.requests[request].num_prompt_tokens
            batch.token_ids_cpu[row, start: batch.num_tokens_no_spec[row]] = -1
        try:
            announce(Recorder(runner, READ), Recorder(scheduler_output, READ), sampled)
        finally:
            batch.token_ids_cpu[:rows] = saved

    return announce_async


def main(argv: list[str]) -> int:
    from dynvocab.bench.engines.vllm.driver import run
    from dynvocab.serving.vllm import proposal

    proposal.announce = with_placeholders(proposal.announce)  # the runner's wrapper looks it up at each call
    result = run(json.loads(Path(argv[0]).read_text()))
    result["read"] = sorted(READ)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
