"""Each policy's own logic: FR prefixes, the position-aware budget, MicroSpec's FIFO window."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from dynvocab.budget import pa_budget
from dynvocab.runtime.selection import CycleReport, SelectorPolicy
from dynvocab.runtime.selection.batch_select import eos_first
from dynvocab.runtime.selection.context.window import MicroSpecConfig, MicroSpecPolicy, unique_in_order
from dynvocab.runtime.selection.frequency import PositionSelector, StaticSelector


def test_pa_budget_follows_dynaspec():
    assert [pa_budget(32768, t) for t in range(5)] == [32768, 32768, 10922, 8192, 6553]
    assert [pa_budget(64, t, divisor=2) for t in range(5)] == [64, 64, 10, 8, 6]
    assert pa_budget(3, 10) == 1


def test_fr_pa_prefixes_are_ranges_of_one_order_and_keep_eos():
    ranking = torch.arange(100, 200)
    selector = PositionSelector(eos_first(ranking, torch.tensor([5])), 60)
    policy = SelectorPolicy(selector)
    sets = [policy.active_ids(t) for t in range(4)]
    assert [s.size for s in sets] == [60, 60, 20, 15]
    assert all(s.contains(5) for s in sets)
    assert all(s.segments[0].order is selector.ranking and s.segments[0].starts == (0,) for s in sets)
    assert set(selector.prefixes) >= {60, 20, 15}


def test_fr_returns_the_same_object_each_step():
    policy = SelectorPolicy(StaticSelector(torch.arange(50)[:10]))
    assert policy.active_ids(0) is policy.active_ids(3)
    assert policy.active_ids(0).ids().tolist() == list(range(10))


def test_unique_in_order():
    assert unique_in_order(torch.tensor([5, 3, 5, 1, 3, 9])).tolist() == [5, 3, 1, 9]


def cycle(draft, accepted, logits, top=()):
    return CycleReport(
        position=0, draft_tokens=draft, draft_top=list(top), accepted=accepted, emitted=[],
        target_logits=logits, target_hidden=torch.zeros(len(draft) + 1, 2),
    )


class StreamModel:
    """MicroSpec written the slow, obvious way: a list stream and a set over its last W entries."""

    def __init__(self, window):
        self.stream = deque(maxlen=window)

    def extend(self, ids):
        self.stream.extend(ids)

    def active(self, pinned=()):
        return sorted(set(self.stream) | set(pinned))


def test_microspec_matches_the_obvious_stream_model():
    vocab, window = 50, 12
    cfg = MicroSpecConfig(k_pre=2, k_ver=2, window=window, draft_alternatives=0)
    policy = MicroSpecPolicy(cfg, vocab, "cpu", pinned=torch.tensor([49]))
    model = StreamModel(window)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.tensor([1, 2, 3, 2])
    prefill = torch.randn(3, vocab, generator=gen)
    policy.prefill(prompt, prefill, None)
    model.extend(prompt.tolist())
    model.extend(unique_in_order(prefill.topk(2, dim=-1).indices.flatten()).tolist())
    assert policy.active_ids(0).ids().tolist() == model.active([49])
    for _ in range(20):
        draft = torch.randint(0, vocab, (3,), generator=gen).tolist()
        accepted = int(torch.randint(0, 4, (1,), generator=gen))
        logits = torch.randn(4, vocab, generator=gen)
        policy.observe(cycle(draft, accepted, logits))
        model.extend(list(dict.fromkeys(draft)))
        model.extend(unique_in_order(logits[: accepted + 1].topk(2, dim=-1).indices.flatten()).tolist())
        assert policy.active_ids(0).ids().tolist() == model.active([49])
        assert policy.active_ids(0) is policy.active_ids(2)


def test_microspec_adds_draft_alternatives_and_only_verified_positions():
    vocab = 40
    policy = MicroSpecPolicy(MicroSpecConfig(k_pre=1, k_ver=1, window=100, draft_alternatives=2), vocab, "cpu")
    policy.prefill(torch.tensor([0]), None, None)
    logits = torch.full((3, vocab), -1.0)
    logits[0, 10] = logits[1, 11] = logits[2, 12] = 5.0
    policy.observe(cycle([20, 21], accepted=1, logits=logits, top=[torch.tensor([20, 30]), torch.tensor([21, 31])]))
    active = set(policy.active_ids(0).ids().tolist())
    assert {0, 20, 21, 30, 31, 10, 11} <= active
    assert 12 not in active  # position 2 lies past the first rejection: not verified


@pytest.mark.parametrize("window", [4, 3072])
def test_microspec_window_bounds_the_active_set(window):
    cfg = MicroSpecConfig(window=window)
    prompt = torch.arange(4000)
    logits = torch.randn(3999, 5000, generator=torch.Generator().manual_seed(0))
    policy = MicroSpecPolicy(cfg, 5000, "cpu")
    policy.prefill(prompt, logits, None)
    top = list(dict.fromkeys(logits.topk(cfg.k_pre, dim=-1).indices.flatten().tolist()))  # unique, in order
    stream = prompt.tolist() + top
    active = policy.active_ids(0).ids().tolist()
    assert len(active) <= window
    assert set(active) == set(stream[-window:])  # exactly the last `window` entries, none dropped


def test_hybrid_segments_are_disjoint_and_the_core_shrinks_with_position():
    from dynvocab.runtime.selection.context.hybrid import HybridConfig, HybridPolicy

    vocab = 200
    ranking = torch.arange(100, 200)
    cfg = HybridConfig(core_size=60, window=50, pa_core=True)
    policy = HybridPolicy(cfg, vocab, "cpu", ranking, pinned=torch.tensor([7]))
    policy.prefill(torch.tensor([1, 2, 105, 150]), torch.randn(3, vocab), None)
    sizes = []
    for step in range(4):
        dyn, core, extra = policy.active_ids(step).id_segments()
        assert extra.numel() == 0  # no graph, no draft-head index: no per-step candidates
        assert not set(dyn.tolist()) & set(core.tolist())
        assert 7 in core.tolist() and {1, 2} <= set(dyn.tolist())
        sizes.append(core.numel())
    assert sizes == [60, 60, 20, 15]  # core_size ids in all, the EOS id among them (as in vLLM)
    again = policy.active_ids(3).id_segments()[1]
    assert policy.active_ids(3).id_segments()[1] is again  # cached views: packed once, sliced after


def test_hybrid_pushes_neighbours_of_a_missed_token():
    from dynvocab.artifacts import GraphTable
    from dynvocab.runtime.selection.context.hybrid import HybridConfig, HybridPolicy

    vocab = 50
    # Token 40 is followed by 41 and 42 in the graph.
    indptr = torch.zeros(vocab + 1, dtype=torch.long)
    indptr[41:] = 2
    graph = GraphTable(indptr, torch.tensor([41, 42], dtype=torch.int32), torch.tensor([0.6, 0.4]))
    cfg = HybridConfig(core_size=5, window=100, miss_topk=2, draft_alternatives=0, k_ver=1)
    policy = HybridPolicy(cfg, vocab, "cpu", torch.arange(5), graph=graph)
    policy.prefill(torch.tensor([10]), None, None)
    logits = torch.full((3, vocab), -5.0)
    logits[0, 40] = 5.0
    logits[0, 30] = 4.0
    sets = [policy.active_ids(0), policy.active_ids(1)]
    policy.observe(CycleReport(
        position=1, draft_tokens=[12, 13], draft_top=[], accepted=0, emitted=[40],
        target_logits=logits, target_hidden=torch.zeros(3, 2), active_sets=sets))
    assert policy.misses == 1
    dyn = set(policy.active_ids(0).id_segments()[0].tolist())
    assert {40, 30, 41, 42} <= dyn


def test_hybrid_step_candidates_find_the_draft_argmax_outside_the_active_set():
    from dynvocab.artifacts import GraphTable
    from dynvocab.builders.hnsw import HnswConfig, build_index
    from dynvocab.runtime.selection.context.hybrid import HybridConfig, HybridPolicy

    vocab, dim = 300, 16
    head = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(0))
    index = build_index(HnswConfig(m=16, ef_construction=100, ef_search=100), head)
    indptr = torch.zeros(vocab + 1, dtype=torch.long)
    indptr[11:] = 2  # token 10 is followed by 20 (in the core) and 250
    graph = GraphTable(indptr, torch.tensor([20, 250], dtype=torch.int32), torch.tensor([0.7, 0.3]))
    cfg = HybridConfig(core_size=50, window=20, step_neighbours=5, step_ef=100, step_successors=2)
    policy = HybridPolicy(cfg, vocab, "cpu", torch.arange(50), graph=graph, draft_hnsw=index)
    policy.prefill(torch.tensor([60, 61]), None, None)
    checked = 0
    for seed in range(20):
        hidden = torch.randn(1, dim, generator=torch.Generator().manual_seed(seed))
        best = int((hidden @ head.T).argmax())
        dyn, core, extra = policy.active_ids(0, hidden, torch.tensor([10])).id_segments()
        segments = [set(dyn.tolist()), set(core.tolist()), set(extra.tolist())]
        assert sum(map(len, segments)) == len(set.union(*segments))  # disjoint
        assert 250 in segments[2] and 20 not in segments[2]  # successors join unless already active
        if best >= 50 and best not in segments[0]:
            assert best in segments[2]
            checked += 1
    assert checked > 10


def test_embedded_ranking_only_for_its_tokenizer():
    from dynvocab.runtime.strategies import embedded_ranking

    assert embedded_ranking("0" * 64) is None
    assert embedded_ranking(None) is None


def test_hybrid_searches_per_step_on_cpu_only_by_default():
    from dynvocab.runtime.selection.context.hybrid import HybridConfig

    assert HybridConfig().searches_per_step("cpu")
    assert not HybridConfig().searches_per_step("cuda:0")  # a host sync per step costs more than the head there
    assert HybridConfig(step_search_on_gpu=True).searches_per_step("cuda")
    assert not HybridConfig(step_neighbours=0).searches_per_step("cpu")


# --- device: every policy's ids live where the draft head's weight does ------------------------------------------
# "meta" stands in for an accelerator: a tensor there is not on the CPU, and the head refuses ids on another device.


@pytest.mark.parametrize("name", ["fr", "fr-pa"])
def test_ranking_policies_put_their_ids_on_the_context_device(name, tmp_path):
    from dynvocab.runtime.heads.head import DraftHead
    from dynvocab.runtime.strategies import PolicyContext, StrategyOptions, make_policy

    token_map = tmp_path / "map.pt"
    torch.save(list(range(10, 70)), token_map)
    policy = make_policy(name, StrategyOptions(token_map=str(token_map)), PolicyContext(96, {95}, device="meta"))
    head = DraftHead(torch.empty(96, 8, device="meta"))
    for step in range(4):
        ids = policy.active_ids(step)
        assert ids.device.type == "meta", (name, step, ids.device)
        logits, columns = head.logits(torch.empty(1, 8, device="meta"), ids)
        assert logits.shape == (1, ids.size) and columns.device.type == "meta"


def test_the_draft_head_refuses_ids_on_another_device():
    from dynvocab.runtime.heads.active_set import ActiveSet, RowRanges
    from dynvocab.runtime.heads.head import DraftHead

    head = DraftHead(torch.empty(96, 8, device="meta"))
    hidden = torch.empty(1, 8, device="meta")
    with pytest.raises(ValueError, match="active ids on cpu, the draft head on meta"):
        head.logits(hidden, ActiveSet.of(torch.arange(5)))
    with pytest.raises(ValueError, match="active ids on cpu"):
        head.logits(hidden, ActiveSet.of(torch.arange(5, device="meta"), torch.arange(5, 9)))
    with pytest.raises(ValueError, match="active ids on cpu"):
        head.logits(hidden, ActiveSet.of(RowRanges(torch.arange(10), (0,), (4,))))
