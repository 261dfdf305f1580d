"""The plugin's view of the request context, without an engine: what the proposal hook announces (each row's
request, its record with async-scheduling placeholders filled, this step's sampled tokens, k), the draft positions
counted from it, each request's window and lookup, and the rows that draft without their request's context,
counted. Tensors stay on the engine's device: PyTorch's ``meta`` device stands in for a GPU here (CI has none): any
tensor left on the CPU beside it fails the same way a CPU tensor beside a CUDA one does. The engine itself runs in
tests/test_vllm_context.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dynvocab.runtime.ngram import NgramLookup
from dynvocab.runtime.selectors.context_select import WindowSelector
from dynvocab.serving.vllm import proposal
from dynvocab.serving.vllm.context import EngineContext
from dynvocab.serving.vllm.proposal import RequestTokens, sampled_lists

DEVICE = torch.device("meta")
WINDOW = frozenset({"window", "fed", "requests"})


def engine_config(device) -> SimpleNamespace:
    """The fields of vLLM's ``VllmConfig`` that :class:`EngineContext` reads."""
    draft = SimpleNamespace(get_vocab_size=lambda: 100)
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3, draft_model_config=draft),
                           scheduler_config=SimpleNamespace(max_num_seqs=4),
                           device_config=SimpleNamespace(device=device))


@pytest.fixture(autouse=True)
def no_forward_context(monkeypatch):
    """No vLLM here (CI's first stage): no forward context, so a first pass has no query starts."""
    from dynvocab.serving.vllm import context

    monkeypatch.setattr(context, "_attention_metadata", lambda: None)


def record(rows: list[list[int]], width: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """The runner's record of its batch (``token_ids_cpu``, ``num_tokens_no_spec``), host arrays."""
    tokens = np.zeros((4, width), dtype=np.int64)
    for i, ids in enumerate(rows):
        tokens[i, : len(ids)] = ids
    return tokens, np.array([len(r) for r in rows] + [0] * (4 - len(rows)))


def begin(ctx: EngineContext, requests: dict[str, list[int]], sampled: list[list[int]] | None = None, k: int = 3):
    tokens, counts = record(list(requests.values()))
    ctx.begin(tuple(requests), tokens, counts[: len(requests)], sampled or [[] for _ in requests], k)


@pytest.mark.parametrize("device", [torch.device("cpu"), DEVICE])
def test_windows_and_sets_live_on_the_engines_device(device):
    ctx = EngineContext(engine_config(device))
    begin(ctx, {"a": [5, 6, 7], "b": [8, 9]}, sampled=[[4], [3]])
    hidden = torch.empty(2, 16, device=device)
    step = ctx.step(hidden, WINDOW, window=8, embed=None)
    assert ctx.windows.ids.device == device and step.windows.device == device and step.fed.device == device
    sets = WindowSelector(8, torch.tensor([1], device=device)).select(hidden, step)
    assert sets.ids(2).device == device
    if device.type == "cpu":
        assert sorted(set(step.windows[0].tolist())) == [4, 5, 6, 7] and sets.ids(2)[:, 0].tolist() == [1, 1]
        assert step.fed.tolist() == [4, 3] and step.requests == ("a", "b")  # position 0 is fed the sampled token
    assert ctx.misses.total == 0


def test_head_calls_count_from_the_proposal_and_k_changes_per_step():
    ctx = EngineContext(engine_config(torch.device("cpu")))
    hidden = torch.empty(2, 16)
    for k in (3, 1, 2):  # a batch-size schedule changes k between steps
        begin(ctx, {"a": [5, 6], "b": [7]}, k=k)
        assert [ctx.advance(hidden) for _ in range(k)] == [(i, i == 0) for i in range(k)]
    assert ctx.misses.total == 0
    ctx.advance(hidden)  # one head call more than the proposal asked for: no proposal announced it
    assert ctx.misses.total == 2 and "no proposal" in next(iter(ctx.misses.by_reason))


def test_continuation_positions_are_fed_the_pass_or_else_the_last_greedy_tokens():
    ctx = EngineContext(engine_config(torch.device("cpu")))
    begin(ctx, {"a": [5, 6], "b": [7]}, sampled=[[8], [9]])
    hidden = torch.empty(2, 16)
    ctx.forward(torch.tensor([6, 8, 9]), torch.zeros(3, 16))  # the first pass
    assert ctx.step(hidden, WINDOW, window=8, embed=None).fed.tolist() == [8, 9]
    ctx.drafted(lambda: torch.tensor([11, 12]))
    ctx.forward(torch.tensor([11, 12]), torch.zeros(2, 16))  # the continuation pass, as vLLM feeds it
    assert ctx.step(hidden, WINDOW, window=8, embed=None).fed.tolist() == [11, 12]
    ctx.drafted(lambda: torch.tensor([13, 14]))  # no pass seen (a drafter captured as a CUDA graph): the greedy tokens
    assert ctx.step(hidden, WINDOW, window=8, embed=None).fed.tolist() == [13, 14]


def test_async_placeholders_are_filled_from_the_tokens_the_hook_saw():
    """Under async scheduling the runner's record holds -1 where earlier steps' sampled tokens go; the windows and
    lookups hold the real tokens, which the hook announced at those steps."""
    ctx = EngineContext(engine_config(torch.device("cpu")))
    hidden = torch.empty(1, 16)
    begin(ctx, {"a": [5, 6, 7]}, sampled=[[8, 9]])
    ctx.step(hidden, WINDOW, window=8, embed=None)
    begin(ctx, {"a": [5, 6, 7, -1, -1]}, sampled=[[10]])  # the record as async scheduling leaves it
    step = ctx.step(hidden, WINDOW, window=8, embed=None)
    assert sorted(set(step.windows[0].tolist())) == [5, 6, 7, 8, 9, 10] and step.fed.tolist() == [10]
    assert ctx.misses.total == 0
    fresh = EngineContext(engine_config(torch.device("cpu")))  # never saw the earlier step: counted, not guessed
    begin(fresh, {"a": [5, 6, 7, -1, -1]}, sampled=[[10]])
    step = fresh.step(hidden, WINDOW, window=8, embed=None)
    assert fresh.misses.total == 1 and step.requests == ("a",)
    assert set(step.windows[0].tolist()) == {0}  # the empty window: shared sets only


def test_a_batch_unlike_the_announced_one_is_counted_and_frees_no_window():
    ctx = EngineContext(engine_config(DEVICE))
    begin(ctx, {"a": [5, 6], "b": [7]})
    ctx.step(torch.empty(2, 16, device=DEVICE), WINDOW, window=8, embed=None)
    begin(ctx, {"a": [5, 6], "b": [7]})
    step = ctx.step(torch.empty(3, 16, device=DEVICE), WINDOW, window=8, embed=None)
    assert step.windows.device == DEVICE and step.windows.shape[0] == 3 and step.requests is None
    assert ctx.misses.total == 3 and ctx.held() == 2


def test_windows_are_held_only_for_the_announced_requests():
    ctx = EngineContext(engine_config(torch.device("cpu")))
    hidden = torch.empty(2, 16)
    begin(ctx, {"a": [5], "b": [6]})
    ctx.step(hidden, WINDOW, window=8, embed=None)
    begin(ctx, {"c": [7]})
    ctx.step(hidden[:1], WINDOW, window=8, embed=None)
    assert ctx.held() == 1 and "c" in ctx.windows.keys() and not {"a", "b"} & ctx.windows.keys()


def test_request_tokens_fill_placeholders_and_forget_requests_that_left():
    known = RequestTokens()
    tokens, counts = record([[1, 2], [3]])
    assert [t.tolist() for t in known.through_step(("a", "b"), tokens, counts, [[4], [5, 6]])] == [[1, 2, 4], [3, 5, 6]]
    tokens, counts = record([[1, 2, -1, 7]])
    assert known.through_step(("a",), tokens, counts, [[]])[0].tolist() == [1, 2, 4, 7] and len(known) == 1
    tokens, counts = record([[3, -1, -1]])
    assert known.through_step(("b",), tokens, counts, [[8]]) == [None]  # b left the batch: its tokens are gone


def test_sampled_tokens_stop_at_the_first_rejected_one_and_skip_discarded_rows():
    sampled = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [9, 9, 9, 9]])
    assert sampled_lists(sampled, 3, np.array([False, False, True])) == [[5, 6], [7], []]
    assert sampled_lists([[5], [6]], 2) == [[], []]  # after the bookkeeping: the record has them already


def test_a_lookup_reads_the_announced_tokens_and_drafts_one_position_at_a_time():
    ctx = EngineContext(engine_config(torch.device("cpu")))
    begin(ctx, {"a": [5, 6, 7, 5], "b": [1, 2, 3, 1]}, sampled=[[6], [2]])
    ctx.lookups = []
    hidden = torch.empty(2, 16)
    steps = []
    for _ in range(3):
        at = ctx.advance(hidden)
        looked = ctx.looked_up(hidden, at, NgramLookup(longest=4, shortest=2))
        steps.append((looked.tokens.tolist(), looked.covered.tolist(), looked.every))
    assert ctx.lookups[0] == {"request": "a", "tokens": [5, 6, 7, 5, 6], "drafts": [7, 5, 6]}
    # a: [5, 6, 7, 5, 6] -> 7, 5, 6; b: [1, 2, 3, 1, 2] -> 3, 1, 2 (a repeating pattern repeats)
    assert steps == [([7, 3], [True, True], True), ([5, 1], [True, True], True), ([6, 2], [True, True], True)]
    top = torch.tensor([0, 0])
    assert looked.over(top).tolist() == [6, 2]
    rows = looked.rows(torch.zeros(2, 10), 10, torch.float32)
    assert rows.argmax(dim=1).tolist() == [6, 2] and torch.isinf(rows).sum().item() == 18


def test_misses_are_logged_rate_limited_and_written_for_the_servers_collector(tmp_path, monkeypatch):
    from dynvocab.serving.vllm import without_context

    said = []
    monkeypatch.setattr(without_context.logger, "warning", lambda line, *args: said.append(line % args))
    monkeypatch.setenv(without_context.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(without_context, "_PROCESS", {"total": 0})
    misses = without_context.Misses("microspec")
    for _ in range(3):
        misses.count(2, "a head call no proposal announced")
    assert misses.total == 6 and len(said) == 1 and "microspec" in said[0] and "\n" not in said[0]
    assert without_context.exported_total(tmp_path) == 6
    without_context.Misses("hybrid").count(1, "a batch of 3 rows against 2 announced requests")  # a second draft
    assert without_context.exported_total(tmp_path) == 7  # one file per process, every draft's rows in it


@pytest.mark.vllm  # prometheus_client comes with vLLM (CI's second stage)
def test_the_collector_sums_the_workers_counts(tmp_path):
    pytest.importorskip("prometheus_client")
    from dynvocab.serving.vllm import without_context

    (tmp_path / "11.json").write_text('{"total": 4}')
    (tmp_path / "12.json").write_text('{"total": 3}')
    collected = list(without_context._Collector(str(tmp_path)).collect())
    assert collected[0].name == without_context.METRIC and collected[0].samples[0].value == 7


def test_the_runner_announces_its_batch_to_a_draft_that_follows_requests():
    """:func:`proposal.announce` as the wrapped ``propose_draft_token_ids`` calls it: the runner's rows (its
    ``num_reqs``, not its record's capacity), this step's valid sampled tokens, k from the scheduler's output."""
    ctx = EngineContext(engine_config(torch.device("cpu")))
    tokens, counts = record([[5, 6], [7], [1]])
    batch = SimpleNamespace(req_ids=["a", "b", "c"], token_ids_cpu=tokens, num_tokens_no_spec=counts, num_reqs=2)
    model = SimpleNamespace(dynvocab_context=ctx, dynvocab=SimpleNamespace(follows_requests=True))
    runner = SimpleNamespace(input_batch=batch, drafter=SimpleNamespace(model=model),
                             discard_request_mask=SimpleNamespace(np=np.array([False, True, False])))
    proposal.announce(runner, SimpleNamespace(num_spec_tokens_to_schedule=2), torch.tensor([[8, -1], [9, 9]]))
    assert ctx._proposal.requests == ("a", "b") and ctx._proposal.k == 2
    assert [t.tolist() for t in ctx._proposal.tokens] == [[5, 6, 8], [7]]  # b's row is a prompt chunk: discarded
    model.dynvocab.follows_requests = False
    proposal.announce(runner, SimpleNamespace(num_spec_tokens_to_schedule=3), torch.tensor([[8, -1], [9, 9]]))
    assert ctx._proposal.k == 2  # a context-free strategy: nothing read, nothing announced


def test_greedy_tokens_handed_as_a_call_are_computed_only_where_no_pass_was_seen():
    ctx = EngineContext(engine_config(torch.device("cpu")))
    begin(ctx, {"a": [5, 6], "b": [7]}, sampled=[[8], [9]])
    hidden = torch.empty(2, 16)
    ctx.step(hidden, WINDOW, window=8, embed=None)
    calls = []
    ctx.drafted(lambda: calls.append(1) or torch.tensor([11, 12]))
    ctx.forward(torch.tensor([21, 22]), torch.zeros(2, 16))  # the pass records the fed ids: the call is not made
    assert ctx.step(hidden, WINDOW, window=8, embed=None).fed.tolist() == [21, 22] and calls == []
    ctx.drafted(lambda: calls.append(1) or torch.tensor([13, 14]))
    assert ctx.step(hidden, WINDOW, window=8, embed=None).fed.tolist() == [13, 14] and calls == [1]
