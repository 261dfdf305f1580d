"""The bench driver with the runner's record as async scheduling leaves it (run as a child process by
tests/test_vllm_context.py with vLLM's Python): ``python vllm_async_record.py REQUEST.json OUT.json``.

Under async scheduling (vLLM's default for EAGLE on GPU engines; vLLM-CPU forces it off) the model runner writes -1
placeholders into ``input_batch.token_ids_cpu`` where each step's sampled tokens go, and the real ones to the device
only (vllm 0.32.0 ``v1/worker/gpu_model_runner.py:_bookkeeping_sync``). Here every proposal hook call sees the
record so: each output position of every request is -1 (the prompt stays), restored right after the hook read it
(the synchronous engine itself reads the record for its inputs). The plugin must take the outputs from what the hook
announced at earlier steps. Writes the driver's rows as :mod:`dynvocab.bench.engines.vllm.driver` does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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
            announce(runner, scheduler_output, sampled)
        finally:
            batch.token_ids_cpu[:rows] = saved

    return announce_async


def main(argv: list[str]) -> int:
    from dynvocab.bench.engines.vllm.driver import run
    from dynvocab.serving.vllm import proposal

    proposal.announce = with_placeholders(proposal.announce)  # the runner's wrapper looks it up at each call
    result = run(json.loads(Path(argv[0]).read_text()))
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
