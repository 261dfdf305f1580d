"""The bench driver with a draft whose passes the plugin never sees, as under a drafter vLLM captured whole as a CUDA
graph (the graph replays without running the draft's Python ``forward``, where the plugin records the fed ids and
the first pass): run as a child process by tests/test_vllm_context.py with vLLM's Python,
``python vllm_captured_draft.py REQUEST.json OUT.json``. A CPU engine captures no graph, so the record is switched
off here: :meth:`EngineContext.forward <dynvocab.serving.vllm.context.EngineContext.forward>` does nothing. Writes
the driver's rows as :mod:`dynvocab.bench.engines.vllm.driver` does."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from dynvocab.bench.engines.vllm.driver import run
    from dynvocab.serving.vllm.context import EngineContext

    EngineContext.forward = lambda self, input_ids, output, hidden_states=None: None
    Path(argv[1]).write_text(json.dumps(run(json.loads(Path(argv[0]).read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
