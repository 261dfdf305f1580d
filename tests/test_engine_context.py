"""The plugin's view of the request context keeps every tensor on the engine's device: windows, their slots, the
zeros of a missing record, and the sets a context selector builds from them with the EOS ids. PyTorch's ``meta``
device stands in for a GPU here (CI has none): any tensor left on the CPU beside it fails the same way a CPU tensor
beside a CUDA one does. The engine itself runs in tests/test_vllm_context.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dynvocab.runtime.policies.context_select import WindowSelector
from dynvocab.serving.vllm.context import EngineContext, find_runner

DEVICE = torch.device("meta")


def engine_config(device) -> SimpleNamespace:
    """The fields of vLLM's ``VllmConfig`` that :class:`EngineContext` reads."""
    draft = SimpleNamespace(get_vocab_size=lambda: 100)
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3, draft_model_config=draft),
                           scheduler_config=SimpleNamespace(max_num_seqs=4),
                           device_config=SimpleNamespace(device=device))


def runner(records: dict[str, list[int]]) -> SimpleNamespace:
    """The model runner's record of its batch, as ``input_batch`` holds it (host arrays)."""
    tokens = np.zeros((4, 32), dtype=np.int64)
    for i, ids in enumerate(records.values()):
        tokens[i, : len(ids)] = ids
    batch = SimpleNamespace(req_ids=list(records), token_ids_cpu=tokens,
                            num_tokens_no_spec=np.array([len(v) for v in records.values()] + [0] * (4 - len(records))))
    return SimpleNamespace(input_batch=batch)


@pytest.mark.parametrize("device", [torch.device("cpu"), DEVICE])
def test_windows_and_sets_live_on_the_engines_device(device):
    ctx = EngineContext(engine_config(device), runner({"a": [5, 6, 7], "b": [8, 9]}))
    hidden = torch.empty(2, 16, device=device)
    step = ctx.step(hidden, frozenset({"window", "fed"}), window=8, embed=None)
    assert ctx.windows.ids.device == device and step.windows.device == device
    assert step.fed.device == device  # no pass seen yet: zeros, on the device
    sets = WindowSelector(8, torch.tensor([1], device=device)).select(hidden, step)
    assert sets.ids(2).device == device
    if device.type == "cpu":
        assert sorted(set(step.windows[0].tolist())) == [5, 6, 7] and sets.ids(2)[:, 0].tolist() == [1, 1]


def test_a_batch_without_a_record_gets_slot_zero_on_the_device():
    ctx = EngineContext(engine_config(DEVICE), runner({}))
    step = ctx.step(torch.empty(3, 16, device=DEVICE), frozenset({"window"}), window=8, embed=None)
    assert step.windows.device == DEVICE and step.windows.shape[0] == 3


class _Runner:
    """A model runner's shape as :func:`find_runner` reads it: the request record and a ``load_model``."""

    input_batch = requests = drafter = None

    def load_model(self):
        return _build_draft()

    def compile(self):
        return _build_draft()


def _build_draft():
    """Where a draft's ``__init__`` calls :func:`find_runner`, a few frames below the runner's ``load_model``."""
    return find_runner()


def test_the_runner_is_the_self_of_the_load_model_that_builds_the_draft():
    runner_ = _Runner()
    assert runner_.load_model() is runner_
    assert runner_.compile() is None  # the same object, but not building a draft: not taken
    assert _build_draft() is None


def test_a_draft_built_without_a_runner_warns_once(monkeypatch):
    from dynvocab.serving.vllm import logger, models

    said = []
    monkeypatch.setattr(logger, "warning", lambda line: said.append(line))
    monkeypatch.setattr(models, "_WARNED", set())
    for _ in range(3):
        models._warn_once(models.NO_RUNNER.format(", ".join(models.RUNNER_RECORD), "microspec"))
    assert len(said) == 1 and "microspec" in said[0] and "output unchanged" in said[0] and "\n" not in said[0]
