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

from dynvocab.runtime.decoding.ngram import NgramLookup
from dynvocab.runtime.selection.context.window import WindowSelector
from dynvocab.serving.vllm import proposal
from dynvocab.serving.vllm.context import EngineContext
from dynvocab.serving.vllm.proposal import RequestTokens, RunnerRecord, sampled_lists

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


def runner_record(rows: list[list[int]], lagging: bool = False, prompts: list[int] | None = None,
                  computed: list[int] | None = None) -> RunnerRecord:
    """The runner's record of ``rows`` (each row's ``num_tokens_no_spec`` its length); ``prompts`` and ``computed``
    default to a decode step's: the whole row a prompt, all but its last token in the cache."""
    tokens, counts = record(rows)
    return RunnerRecord(tokens, counts[: len(rows)], np.array(prompts or [len(r) for r in rows]),
                        np.array(computed or [max(len(r) - 1, 0) for r in rows]), lagging)


def on_device(sampled: list[list[int]]) -> torch.Tensor:
    """The step's sampled tokens as the runner hands them before its bookkeeping: [B, k + 1], -1 after a rejection."""
    width = max(len(s) for s in sampled)
    return torch.tensor([s + [-1] * (width - len(s)) for s in sampled])


def begin(ctx: EngineContext, requests: dict[str, list[int]], sampled: list[list[int]] | None = None, k: int = 3,
          **record_kw):
    ctx.begin(tuple(requests), runner_record(list(requests.values()), **record_kw),
              on_device(sampled) if sampled else [], None, k)


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
    async_record = dict(lagging=True, prompts=[3], computed=[4])  # 3 prompt tokens, 2 outputs: 4 in the cache
    begin(ctx, {"a": [5, 6, 7, -1, -1]}, sampled=[[10]], **async_record)  # the record as async scheduling leaves it
    step = ctx.step(hidden, WINDOW, window=8, embed=None)
    assert sorted(set(step.windows[0].tolist())) == [5, 6, 7, 8, 9, 10] and step.fed.tolist() == [10]
    assert ctx.misses.total == 0
    fresh = EngineContext(engine_config(torch.device("cpu")))  # never saw the earlier step: counted, not guessed
    begin(fresh, {"a": [5, 6, 7, -1, -1]}, sampled=[[10]], **async_record)
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


def test_a_synchronous_record_is_the_history_and_requests_that_left_are_forgotten():
    known = RequestTokens()
    before, why = known.before_step(("a", "b"), runner_record([[1, 2], [3]]))
    tokens, late = known.through_step(("a", "b"), before, [[4], [5, 6]])
    assert [t.tolist() for t in tokens] == [[1, 2, 4], [3, 5, 6]] and why == late == [None, None] and len(known) == 2
    before, why = known.before_step(("a",), runner_record([[1, 2, 4, 7]]))
    assert known.through_step(("a",), before, [[]])[0][0].tolist() == [1, 2, 4, 7] and len(known) == 1
    assert known.before_step(("b",), runner_record([[3, -1]])) == ([None], [proposal.PLACEHOLDERS])


def async_step(known: RequestTokens, rows: list[list[int]], computed: list[int], sampled, prompts=(4,)):
    """One proposal under async scheduling of requests with 4 prompt tokens: (tokens through the step, each row's
    reason)."""
    requests = tuple("abcd"[: len(rows)])
    before, why = known.before_step(requests, runner_record(rows, True, list(prompts), computed))
    tokens, late = known.through_step(requests, before, sampled)
    return [None if t is None else t.tolist() for t in tokens], [a or b for a, b in zip(why, late)]


def test_under_async_scheduling_the_history_continues_from_what_the_plugin_announced():
    """The record as vllm 0.32.0's async bookkeeping leaves it (seen on vLLM-CPU run with async scheduling, tests/
    vllm_async_engine.py): one -1 a row per step whatever the step accepted, a count that runs ahead of the verified
    tokens (the optimistic drafts) over positions never written (0 here), and ``num_computed_tokens`` + 1 verified
    tokens before the step."""
    known = RequestTokens()
    assert async_step(known, [[5, 6, 7, 8]], [0], [[93]]) == ([[5, 6, 7, 8, 93]], [None])  # the prompt's step
    assert async_step(known, [[5, 6, 7, 8, -1]], [4], [[75, 75, 281]]) == ([[5, 6, 7, 8, 93, 75, 75, 281]], [None])
    # 8 verified, 7 in the cache; the count (10) ran past them over a -1 and a position never written
    tokens, why = async_step(known, [[5, 6, 7, 8, -1, -1, -1, -1, -1, 0]], [7], [[1]])
    assert tokens == [[5, 6, 7, 8, 93, 75, 75, 281, 1]] and why == [None]
    # the runner verified two tokens at a step this plugin never saw: counted, not truncated
    assert async_step(known, [[5, 6, 7, 8, -1, -1]], [10], [[2]]) == ([None], [proposal.UNPROPOSED])
    assert len(known) == 0  # and forgotten: the request's later steps are counted too
    assert async_step(known, [[5, 6, 7, 8, -1]], [11], [[2]]) == ([None], [proposal.UNANNOUNCED])
    fresh = RequestTokens()
    async_step(fresh, [[5, 6, 7, 8]], [0], [[93]])
    assert async_step(fresh, [[5, 9, 7, 8, -1]], [4], [[1]]) == ([None], [proposal.DISAGREES])
    async_step(fresh, [[5, 6, 7, 8]], [0], [[93]])
    assert async_step(fresh, [[5, 6, 7, 8, -1]], [4], None) == ([None], [proposal.UNSAMPLED])  # tokens not on the host
    async_step(fresh, [[5, 6, 7, 8]], [0], [[93]])
    assert async_step(fresh, [[5, 6, 7, 8, -1]], [2], [[1]]) == ([None], [proposal.DROPPED])


def test_sampled_tokens_stop_at_the_first_rejected_one_and_skip_discarded_rows():
    sampled = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [9, 9, 9, 9]])
    assert sampled_lists(sampled, 3, np.array([False, False, True])) == [[5, 6], [7], []]
    assert sampled_lists([[5], [6]], 2) == [[], []]  # after the bookkeeping: the record has them already
    assert proposal.HostSampled([[5], [6]], 2, lagging=True).lists() is None  # async: nowhere on the host


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


def test_the_runner_announces_its_batch_to_a_draft_that_follows_requests():
    """:func:`proposal.announce` as the wrapped ``propose_draft_token_ids`` calls it: the runner's rows (its
    ``num_reqs``, not its record's capacity), this step's valid sampled tokens, k from the scheduler's output."""
    ctx = EngineContext(engine_config(torch.device("cpu")))
    tokens, counts = record([[5, 6], [7], [1]])
    batch = SimpleNamespace(req_ids=["a", "b", "c"], token_ids_cpu=tokens, num_tokens_no_spec=counts, num_reqs=2,
                            num_prompt_tokens=counts, num_computed_tokens_cpu=np.zeros(3, dtype=np.int64))
    model = SimpleNamespace(dynvocab_context=ctx, dynvocab=SimpleNamespace(follows_requests=True))
    runner = SimpleNamespace(input_batch=batch, drafter=SimpleNamespace(model=model),
                             discard_request_mask=SimpleNamespace(np=np.array([False, True, False])))
    proposal.announce(runner, SimpleNamespace(num_spec_tokens_to_schedule=2), torch.tensor([[8, -1], [9, 9]]))
    announced = ctx._settle()
    assert announced.requests == ("a", "b") and announced.k == 2
    assert [t.tolist() for t in announced.tokens] == [[5, 6, 8], [7]]  # b's row is a prompt chunk: discarded
    model.dynvocab.follows_requests = False
    proposal.announce(runner, SimpleNamespace(num_spec_tokens_to_schedule=3), torch.tensor([[8, -1], [9, 9]]))
    assert ctx._settle().k == 2  # a context-free strategy: nothing read, nothing announced


def test_without_its_passes_a_drafter_that_samples_leaves_the_fed_ids_and_target_states_unknown_and_counted():
    """A drafter captured whole runs no Python forward: under ``draft_sample_method="probabilistic"`` the greedy
    tokens are not what a continuation pass is fed, and an EAGLE-1 head's target states were never seen."""
    from dynvocab.serving.vllm.context import UNFED, UNSEEN_TARGET

    config = engine_config(torch.device("cpu"))
    config.speculative_config.draft_sample_method = "probabilistic"
    ctx = EngineContext(config, target_states=True)
    begin(ctx, {"a": [5, 6], "b": [7]}, sampled=[[8], [9]])
    hidden = torch.empty(2, 16)
    first = ctx.step(hidden, WINDOW | {"target"}, window=8, embed=None)
    assert first.fed.tolist() == [8, 9] and first.target is None and ctx.misses.by_reason == {UNSEEN_TARGET: 2}
    ctx.drafted(lambda: torch.tensor([11, 12]))
    assert ctx.step(hidden, WINDOW, window=8, embed=None).fed is None and ctx.misses.by_reason[UNFED] == 2


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
