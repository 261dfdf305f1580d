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


@pytest.fixture(autouse=True)
def no_forward_context(monkeypatch):
    """No vLLM here (CI's first stage): no forward context, so every recorded pass counts as a first one."""
    from dynvocab.serving.vllm import context

    monkeypatch.setattr(context, "_attention_metadata", lambda: None)


def first_pass(ctx: EngineContext, ids: list[int], positions: list[int], starts: list[int]) -> None:
    """An EAGLE proposer's first pass as :meth:`EngineContext.forward` records it (its query starts, which vLLM's
    attention metadata holds, set by hand)."""
    out = torch.arange(len(ids) * 4, dtype=torch.float32).view(len(ids), 4)
    ctx.forward(torch.tensor(ids), out, None, torch.tensor(positions))
    ctx._starts = torch.tensor(starts)


def test_a_lookup_reads_the_record_then_the_passes_accepted_and_sampled_tokens():
    """Request a's record holds 6 tokens (through position 5); this step the target verified [7 @5, 8 @6, 9 @7,
    1 @8]; the proposer shifted the ids by one and wrote the sampled token 4 at the picked row (2 drafts accepted):
    a's tokens are the record, then 8, 9 and 4. Request b's pass starts past its record (a gap): no lookup."""
    from dynvocab.runtime.ngram import NgramLookup

    ctx = EngineContext(engine_config(torch.device("cpu")), runner({"a": [5, 6, 7, 8, 9, 7], "b": [1, 2]}))
    first_pass(ctx, ids=[8, 9, 4, 0, 3], positions=[5, 6, 7, 8, 9], starts=[0, 4, 5])
    ctx.lookups = []
    hidden = ctx._out[[2, 4]]  # the picked rows' outputs
    at = ctx.advance(hidden)
    assert at == (0, True)
    looked = ctx.looked_up(hidden, at, NgramLookup(longest=4, shortest=1))
    assert ctx.lookups[0]["tokens"] == [5, 6, 7, 8, 9, 7, 8, 9, 4] and ctx.lookups[1]["tokens"] is None
    assert ctx._continuations == [[], []]  # 4 never occurred before: nothing drafted
    assert looked is None


def test_a_lookup_drafts_its_continuation_one_position_at_a_time():
    from dynvocab.runtime.ngram import NgramLookup

    ctx = EngineContext(engine_config(torch.device("cpu")), runner({"a": [5, 6, 7, 5], "b": [1, 2, 3, 1, 2]}))
    first_pass(ctx, ids=[6, 3], positions=[3, 4], starts=[0, 1, 2])  # a: 6 fed at position 3; b: 3 at 4
    hidden = ctx._out
    steps = []
    for _ in range(3):
        at = ctx.advance(hidden)
        looked = ctx.looked_up(hidden, at, NgramLookup(longest=4, shortest=2))
        steps.append((looked.tokens.tolist(), looked.covered.tolist(), looked.every))
    # a: [5, 6, 7, 5, 6] -> 7, 5, 6; b: [1, 2, 3, 1, 2, 3] -> 1, 2, 3 (a repeating pattern repeats)
    assert steps == [([7, 1], [True, True], True), ([5, 2], [True, True], True), ([6, 3], [True, True], True)]
    top = torch.tensor([0, 0])
    assert looked.over(top).tolist() == [6, 3]
    full = torch.zeros(2, 10)
    rows = looked.rows(full, 10, torch.float32)
    assert rows.argmax(dim=1).tolist() == [6, 3] and torch.isinf(rows).sum().item() == 18
