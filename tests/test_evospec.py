"""EvoSpec: candidate assembly, the policy's OOV events and cache updates, bundle checks, losslessness."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dynvocab.artifacts import FreqTable, GraphTable, ModelFingerprint, Stage, load_bundle, write_bundle
from dynvocab.builders import hnsw as hnsw_builder
from dynvocab.errors import DynvocabError
from dynvocab.runtime import strategies
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.selection.base import CycleReport
from dynvocab.runtime.selection.evospec.evospec import (
    EvoSpecConfig,
    EvoSpecPolicy,
    EvoSpecSelector,
    OOVEvent,
    retrieve,
    semantic,
)
from dynvocab.runtime.selection.candidates import assemble_candidates
from dynvocab.runtime.strategies import PolicyContext, StrategyOptions

VOCAB = 96
pytestmark = pytest.mark.usefixtures("one_thread")


def random_graph(vocab: int = VOCAB, max_degree: int = 6, seed: int = 0) -> GraphTable:
    """CSR successors: each id gets 0..max_degree distinct successors with descending probabilities."""
    g = torch.Generator().manual_seed(seed)
    indptr, indices, probs = [0], [], []
    for _ in range(vocab):
        n = int(torch.randint(0, max_degree + 1, (1,), generator=g))
        succ = torch.randperm(vocab, generator=g)[:n]
        p = torch.rand(n, generator=g).sort(descending=True).values
        indices += succ.tolist()
        probs += (p / max(float(p.sum()), 1.0)).tolist()
        indptr.append(len(indices))
    return GraphTable(
        torch.tensor(indptr, dtype=torch.int64), torch.tensor(indices, dtype=torch.int32), torch.tensor(probs)
    )


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair
    return CausalLM(target), DraftModel(draft)


@pytest.fixture(scope="module")
def tables(pair):
    """A tiny bundle's worth of EvoSpec tables for the tiny target: ranking, HNSW index + params, graph."""
    target, _ = pair
    cfg = hnsw_builder.HnswConfig(m=8, ef_construction=64, ef_search=64, num_threads=1)
    index = hnsw_builder.build_index(cfg, target.weight)  # MipsIndex; no preconditioning without sample queries
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    return ranking, index, index.params, random_graph()


def make_policy(tables, core_size=30, **kw) -> EvoSpecPolicy:
    ranking, index, _, graph = tables
    cfg = EvoSpecConfig(static_size=core_size, **{"dynamic_size": 16, "max_insert": 6, "min_residency": 2, **kw})
    return EvoSpecPolicy(cfg, ranking[:core_size], index, graph, VOCAB)


def test_candidates_are_seeds_then_graph_successors_round_robin_without_core_ids():
    indptr = np.array([0, 3, 5, 5, 6, 6, 6, 6, 6, 6, 6])  # 10 ids
    indices = np.array([4, 5, 6, 7, 8, 9])  # 0 -> 4,5,6 ; 1 -> 7,8 ; 3 -> 9
    in_core = np.zeros(10, dtype=bool)
    in_core[[2, 5]] = True
    out = assemble_candidates(0, [0, 1, 2], [3, 1, 42], indptr, indices, fanout=2, in_core=in_core)
    # seeds 0, 1, 2 (core: dropped from the output but still expanded), 3, 42 (outside the vocabulary);
    # successors round-robin: first ranks 4 (of 0), 7 (of 1), 9 (of 3); then 5 (core), 8; fan-out 2 drops 6.
    assert out == [0, 1, 3, 4, 7, 9, 8]


def test_retrieval_finds_the_exact_mips_neighbours_on_a_tiny_index(tables, pair):
    target, _ = pair
    _, index, _, graph = tables
    cfg = EvoSpecConfig()
    queries = torch.randn(20, target.weight.shape[1], generator=torch.Generator().manual_seed(3))
    exact = hnsw_builder.exact_mips(target.weight, queries, 10)
    hits = sum(len(set(semantic(index, q, cfg)) & set(exact[i].tolist())) for i, q in enumerate(queries))
    assert hits / 200 >= 0.95
    core = next(t for t in range(VOCAB) if t not in {7, 8, *exact[0].tolist()})  # a core id no seed is
    selector = EvoSpecSelector(torch.tensor([core]), VOCAB, graph, cfg)
    event = OOVEvent(7, (7, 8), queries[0])
    start = time.perf_counter()
    cands, seconds = retrieve(selector, index, event)
    around = time.perf_counter() - start
    assert cands[:2] == [7, 8] and set(exact[0].tolist()) <= set(cands)
    assert 0 < seconds <= around  # the time of this one retrieval (search, expansion, assembly), on the same clock
    assert len(cands) == len(set(cands)) and core not in cands


def report(policy, emitted, logits=None, hidden=None, accepted=None, gamma=3):
    gen = torch.Generator().manual_seed(sum(emitted))
    n = len(emitted)
    logits = torch.randn(gamma + 1, VOCAB, generator=gen) if logits is None else logits
    hidden = torch.randn(gamma + 1, 32, generator=gen) if hidden is None else hidden
    drafted = emitted[:-1] + [0] * (gamma - n + 1)
    return CycleReport(0, drafted, [], n - 1 if accepted is None else accepted, emitted, logits, hidden)


def test_an_oov_token_triggers_retrieval_and_joins_the_dynamic_segment(tables):
    policy = make_policy(tables, synchronous=True)
    core, dyn = policy.active_ids(0).id_segments()
    assert core is policy.selector.core and dyn.numel() == 0
    oov = int(tables[0][50])  # far outside the 30-id core
    logits = torch.zeros(4, VOCAB)
    logits[1, oov] = 5.0
    policy.observe(report(policy, [int(core[0]), oov], logits=logits))
    assert policy.stats.oov_events == 1
    assert policy.active_ids(1).id_segments()[1].numel() == 0  # updates wait for the next cycle
    core2, dyn2 = policy.active_ids(0).id_segments()
    assert core2 is core  # the static core is one tensor object for the whole generation
    assert oov in dyn2.tolist() and 0 < dyn2.numel() <= 6
    assert not torch.isin(dyn2, core).any()
    assert policy.active_ids(0).id_segments()[1] is dyn2  # unchanged: the same object, so the head copies nothing
    # The token is active now: emitting it again raises no event, and counts as a hit in the cache.
    policy.observe(report(policy, [oov]))
    assert policy.stats.oov_events == 1 and oov in policy.cache.t2


def test_the_dynamic_segment_respects_its_budget_over_many_events(tables):
    policy = make_policy(tables, synchronous=True, min_residency=1)
    gen = torch.Generator().manual_seed(5)
    for _ in range(60):
        policy.active_ids(0)
        tok = int(torch.randint(0, VOCAB, (1,), generator=gen))
        policy.observe(report(policy, [tok], logits=torch.randn(4, VOCAB, generator=gen)))
        _, dyn = policy.active_ids(0).id_segments()
        assert dyn.numel() <= 16 and dyn.unique().numel() == dyn.numel()
        assert not torch.isin(dyn, policy.selector.core).any()
        expected = policy.selector.in_core.copy()  # the active set is core ∪ dynamic
        expected[dyn.numpy()] = True
        assert (policy.active_ids(0).mask(VOCAB).numpy() == expected).all()
    assert policy.stats.oov_events > 10 and policy.cache.stats.evicted > 0
    s = policy.summary()
    assert s["oov_events"] == policy.stats.oov_events and s["dynamic_size"] <= 16


def test_async_retrieval_gives_the_synchronous_result_once_flushed(tables):
    sync, background = make_policy(tables, synchronous=True), make_policy(tables)
    gen = torch.Generator().manual_seed(9)
    try:
        for _ in range(25):
            tok = int(torch.randint(0, VOCAB, (1,), generator=gen))
            cycle = report(sync, [tok], logits=torch.randn(4, VOCAB, generator=gen))
            for p in (sync, background):
                p.active_ids(0)
                p.observe(cycle)
            background.apply_ready(wait=True)
            sync.apply_ready()
            assert torch.equal(sync.active_ids(1).id_segments()[1], background.active_ids(1).id_segments()[1])
        assert all(t.is_alive() for t in background._pool._threads)
    finally:
        background.close()
    assert background._pool._threads and not any(t.is_alive() for t in background._pool._threads)
    background.close()  # idempotent


def bundle_for(tmp_path, pair, tables, stages=("freq", "hnsw", "graph")):
    from dataclasses import replace

    from dynvocab.artifacts.hnsw import graph_tensors

    target, _ = pair
    ranking, index, params, graph = tables
    links, layout = graph_tensors(index.index)
    made = {
        "freq": Stage("freq", FreqTable(torch.ones(VOCAB, dtype=torch.long), ranking, torch.tensor([95])).to_tensors(),
                      {}),
        "hnsw": Stage(
            "hnsw", {**links, "row_map": index.row_map, "query_map": index.query_map}, {},
            {"index": replace(params, layout=layout).as_dict()},
        ),
        "graph": Stage("graph", graph.to_tensors(), {}),
    }
    fp = ModelFingerprint(VOCAB, "0" * 64, VOCAB, target.weight.shape[1])
    path = write_bundle(tmp_path / "evo.safetensors", [made[s] for s in stages], fp, None)
    return load_bundle(path)


def test_from_context_reads_the_bundle_and_keeps_eos_in_the_core(tmp_path, pair, tables):
    target, draft = pair
    bundle = bundle_for(tmp_path, pair, tables)
    ctx = PolicyContext(VOCAB, {95}, "cpu", bundle, draft.info, target)
    policy = EvoSpecPolicy.from_context(EvoSpecConfig(static_size=20, synchronous=True), ctx)
    core, _ = policy.active_ids(0).id_segments()
    ranking = tables[0][tables[0] != 95]
    assert core.tolist() == [95, *ranking[:19].tolist()]  # the EOS ids, then the most frequent: 20 ids, as in vLLM
    again = EvoSpecPolicy.from_context(EvoSpecConfig(static_size=20), ctx)
    assert again.index is policy.index  # loaded once per bundle


def test_make_policy_names_what_is_missing(tmp_path, pair, tables):
    target, draft = pair
    with pytest.raises(DynvocabError, match="needs --bundle"):
        strategies.make_policy("evospec", StrategyOptions(),
                               PolicyContext(VOCAB, {95}, "cpu", None, draft.info, target))
    bundle = bundle_for(tmp_path, pair, tables, stages=("freq", "graph"))
    with pytest.raises(DynvocabError, match="lacks hnsw") as err:
        strategies.make_policy("evospec", StrategyOptions(),
                               PolicyContext(VOCAB, {95}, "cpu", bundle, draft.info, target))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("synchronous", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_is_lossless(pair, tables, synchronous, seed):
    target, draft = pair
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
    cfg = DecodeConfig(gamma=1 + seed % 4, max_new_tokens=30)
    eos = {int(torch.randint(0, VOCAB, (1,), generator=gen))} if seed % 2 else set()
    ar = speculative_generate(target, prompt, cfg, eos)
    with make_policy(tables, core_size=25 + 5 * seed, synchronous=synchronous) as policy:
        spec = speculative_generate(target, prompt, cfg, eos, draft, policy)
    assert spec.token_ids == ar.token_ids
    assert policy.stats.oov_events > 0  # a 25–40-id core on a 96-id vocabulary misses often
    if synchronous:  # the last cycles' events were never due: no cycle followed them
        policy.apply_ready()
        assert policy.stats.retrievals == policy.stats.oov_events


def test_the_dynamic_buffer_raises_coverage_over_the_core_alone(pair, tables):
    """With retrieval the draft proposes from more of the right tokens than the bare static core."""
    from dynvocab.runtime.selection import SelectorPolicy
    from dynvocab.runtime.selection.frequency import StaticSelector

    target, draft = pair
    cfg = DecodeConfig(gamma=3, max_new_tokens=60)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    core = tables[0][:30]
    fr = speculative_generate(target, prompt, cfg, set(), draft, SelectorPolicy(StaticSelector(core)))
    with make_policy(tables, core_size=30, synchronous=True, dynamic_size=32) as policy:
        evo = speculative_generate(target, prompt, cfg, set(), draft, policy)
    assert evo.token_ids == fr.token_ids
    assert evo.metrics.active_hit_rate > fr.metrics.active_hit_rate
    assert evo.metrics.mean_active_vocab > 30


def test_a_failing_retrieval_is_counted_and_costs_only_coverage(pair, tables):
    target, draft = pair
    ranking, _, _, graph = tables
    cfg = DecodeConfig(gamma=3, max_new_tokens=20)
    ar = speculative_generate(target, [2, 7, 1], cfg, set())
    with EvoSpecPolicy(EvoSpecConfig(static_size=30), ranking[:30], None, graph, VOCAB) as policy:  # no index
        spec = speculative_generate(target, [2, 7, 1], cfg, set(), draft, policy)
        policy.apply_ready(wait=True)
    assert spec.token_ids == ar.token_ids
    assert policy.stats.oov_events > 0 and policy.stats.failed == policy.stats.oov_events
    assert policy.summary()["failed"] == policy.stats.failed and len(policy.cache) == 0
