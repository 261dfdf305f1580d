"""EvoSpec in a batched host (:class:`EvoSpecSelector`): one request's buffer evolves cycle by cycle as the own
loop's policy's does (same events, same candidates, same ARC cache), each request keeps its own buffer and gives it
back when it leaves the batch, positions past the first draft from the cycle's set, and a draft model is refused."""

from __future__ import annotations

import pytest
import test_evospec
import torch
from test_evospec import VOCAB, report

from dynvocab.artifacts.hnsw import mips_search
from dynvocab.runtime.batched import refusal
from dynvocab.runtime.selection.batch_select import StepContext
from dynvocab.runtime.selection.evospec.evospec import EvoSpecConfig, EvoSpecPolicy, EvoSpecSelector

pytestmark = pytest.mark.usefixtures("one_thread")
pair, tables = test_evospec.pair, test_evospec.tables  # the fixtures, for pytest
CORE = 30


class IndexSearch:
    """The host-side search the selector calls (:class:`~dynvocab.runtime.selection.head_search.HeadSearch`'s
    interface) over an index built in memory."""

    def __init__(self, index, k: int):
        self.index, self.neighbours, self.calls = index, k, 0

    def prepare(self, head):
        return self.index

    def __call__(self, hidden, head):
        self.calls += hidden.shape[0]
        return mips_search(self.index, hidden, self.neighbours)


def config(**kw) -> EvoSpecConfig:
    """The paper's rules at a size a tiny vocabulary exercises (evictions within a few dozen cycles); no target
    top-k seeds, which a batched host does not have."""
    return EvoSpecConfig(static_size=CORE, **{"dynamic_size": 12, "max_insert": 5, "min_residency": 1,
                                              "warmup_events": 3, "target_topk": 0, "synchronous": True, **kw})


def selector(tables, cfg: EvoSpecConfig, search=True) -> EvoSpecSelector:
    ranking, index, _, graph = tables
    return EvoSpecSelector(ranking[:CORE], VOCAB, graph, cfg, IndexSearch(index, cfg.hnsw_topk) if search else None)


def step(sel: EvoSpecSelector, fed: list[int], keys: tuple, target: torch.Tensor | None, at: int = 0):
    """One head call of ``len(fed)`` rows at draft position ``at``: each row's set beyond the core."""
    head = torch.zeros(VOCAB, 1)  # the host's whole head (the in-memory index holds its own rows)
    ctx = StepContext(at, torch.tensor(fed), None, None, head, keys, target)
    sets = sel.select(torch.zeros(len(fed), 4), ctx)
    assert torch.equal(sets.shared, sel.core)
    return [set(row.tolist()) - set(sel.core.tolist()) for row in sets.rows]


def test_one_request_keeps_the_own_loops_buffer_cycle_by_cycle(tables):
    """The same emitted tokens and target states into the own loop's policy (its cycle reports) and the batched
    selector (the fed token and target state at draft position 0): the same dynamic ids after every cycle, through
    admissions, hits and evictions."""
    cfg = config()
    ranking, index, _, graph = tables
    loop = EvoSpecPolicy(cfg, ranking[:CORE], index, graph, VOCAB)
    sel = selector(tables, cfg)
    g = torch.Generator().manual_seed(11)
    seen = []
    for cycle in range(60):
        token = int(torch.randint(0, VOCAB, (1,), generator=g))
        hidden = torch.randn(1, 32, generator=g)
        loop.observe(report(loop, [token], hidden=hidden.expand(4, -1)))
        dynamic = set(loop.active_ids(0).id_segments()[1].tolist())
        assert step(sel, [token], ("r",), hidden)[0] == dynamic, cycle
        seen.append(len(dynamic))
    assert sel.stats.oov_events == loop.stats.oov_events > 10 and loop.cache.stats.evicted > 0
    assert sel.stats.searched == sel.stats.oov_events and max(seen) == cfg.dynamic_size
    loop.close()


def test_each_request_keeps_its_own_buffer_and_gives_it_back_when_it_leaves(tables):
    sel = selector(tables, config())
    outside = [int(t) for t in tables[0][CORE:]]  # ids past the core: each one an OOV event
    states = torch.randn(2, 32, generator=torch.Generator().manual_seed(2))
    a, b = step(sel, outside[:2], ("a", "b"), states)
    assert outside[0] in a and outside[1] in b and outside[1] not in a and outside[0] not in b
    a2, c = step(sel, [outside[0], outside[5]], ("a", "c"), states)  # b left the batch; c is new
    assert a2 == a and sel.caches.keys() == {"a", "c"} and outside[5] in c
    (b2,) = step(sel, [int(sel.core[0])], ("b",), states[:1])  # b comes back with nothing: a new buffer
    assert b2 == set() and sel.held() == 1


def test_positions_past_the_first_draft_from_the_cycles_set(tables):
    sel = selector(tables, config())
    outside = [int(t) for t in tables[0][CORE:]]
    states = torch.randn(1, 32)
    (first,) = step(sel, [outside[0]], ("r",), states)
    (later,) = step(sel, [outside[9]], ("r",), None, at=1)  # a fed draft token: no event, no tick
    assert later == first and sel.stats.oov_events == 1 and sel.caches["r"].now == 1


def test_the_loops_chain_set_is_the_requests_row_kept_until_its_buffer_changes(tables):
    """``row_set`` (the loop's chain) names the buffer ``select`` pads into the request's row, as one ActiveSet object
    while the buffer holds the same ids (the packed head keys a segment by its tensor)."""
    sel = selector(tables, config())
    outside = [int(t) for t in tables[0][CORE:]]
    (row,) = step(sel, [outside[0]], ("r",), torch.randn(1, 32))
    ctx = StepContext(1, requests=("r",))
    chain = sel.row_set(None, ctx)
    core, dynamic = chain.id_segments()
    assert core is sel.core and set(dynamic.tolist()) == row and sel.row_set(None, ctx) is chain
    step(sel, [next(t for t in outside if t not in row)], ("r",), torch.randn(1, 32))  # an event: new ids
    assert sel.row_set(None, ctx) is not chain and sel.node_sets(torch.zeros(3, 4), ctx) is None


def test_without_the_targets_state_the_token_and_its_successors_are_the_candidates(tables):
    """An EAGLE-3 head or a tensor-parallel rank: no search, the token and its graph successors still join."""
    ranking, index, _, graph = tables
    no_state, no_index = selector(tables, config()), selector(tables, config(), search=False)
    token = next(int(t) for t in ranking[CORE:] if graph.indptr[int(t) + 1] > graph.indptr[int(t)])
    (a,) = step(no_state, [token], ("r",), None)
    (b,) = step(no_index, [token], ("r",), torch.randn(1, 32))
    successors = set(graph.successors(token)[0].tolist()) - set(ranking[:CORE].tolist())
    assert a == b and token in a and a - {token} <= successors and len(a) > 1
    assert no_state.stats.searched == 0 and no_state.search.calls == 0


def test_a_draft_model_is_refused_in_one_line():
    why = refusal("evospec", "draft-model")
    assert why and "\n" not in why and "EAGLE" in why and "target's hidden states" in why
    assert refusal("evospec", "eagle1") is None and refusal("evospec") is None
    assert refusal("microspec", "draft-model") is None
