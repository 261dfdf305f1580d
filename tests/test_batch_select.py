"""One selector per strategy for every host: a selector's one-row set for dynvocab's loop (``row_set``) is the set its
batched form gives that row; a tree depth's nodes each get the set they get alone; each row of a batch gets its own
set; a selected head computes the full head's logits over the set; a vocab-parallel head's shards score each id once;
the refusals are one line."""

from __future__ import annotations

import pytest
import torch

from dynvocab.artifacts import FreqTable, ModelFingerprint, Stage, load_bundle, write_bundle
from dynvocab.artifacts.random_stages import random_context_stages
from dynvocab.artifacts.selectors import SelectorTable, random_selectors
from dynvocab.builders.hnsw import head_stage
from dynvocab.errors import DynvocabError
from dynvocab.runtime.batched import SelectorSpec, asked_budget, batch_strategies, build_selector, refusal
from dynvocab.models.int8 import INT8_GATHERED
from dynvocab.runtime.selection import SelectorPolicy
from dynvocab.runtime.selection.batch_select import StepContext, top_ids, top_ids_batched
from dynvocab.runtime.selection.centroids import CentroidConfig, CentroidSelector, centroid_selector
from dynvocab.runtime.selection.dynaspec import DynaSpecConfig
from dynvocab.runtime.selection.frequency import PositionAwareConfig, StaticSelector
from dynvocab.runtime.selection.context.hybrid import HybridConfig
from dynvocab.runtime.selection.lowrank import BATCHED_RANK, LowRankConfig, LowRankSelector, lowrank_selector
from dynvocab.runtime.heads.selected_head import SelectedHead, scatter_logits
from dynvocab.runtime.selection.context.window import MicroSpecConfig
from dynvocab.runtime.registry import StrategyOptions

V, D = 1000, 32
EOS = torch.tensor([7])
HEAD = torch.randn(V, D, generator=torch.Generator().manual_seed(9))  # the target's head rows the hnsw stage indexes


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 500, (V,), generator=g)
    rest = torch.argsort(counts, descending=True, stable=True)
    freq = FreqTable(counts=counts, ranking=torch.cat([EOS, rest[rest != EOS[0]]]), eos_ids=EOS)
    low, cen = random_selectors(V, D, g, rank=8, candidates=64, block=50, blocks=3)
    fp = ModelFingerprint(V, "0" * 64, V, D)
    stages = [Stage("freq", freq.to_tensors(), {}, {}), *(Stage(t.kind, t.tensors, t.config, {}) for t in (low, cen))]
    stages.append(head_stage("hnsw", HEAD, "target"))  # evospec's retrieval over the target's head rows
    path = write_bundle(tmp_path_factory.mktemp("b") / "b.safetensors", stages + random_context_stages(g, V, D), fp, fp)
    with load_bundle(path) as b:
        yield b


def step_context(rows: int, step: int = 0, seed: int = 5, window: int = 40) -> StepContext:
    """A draft step's context for ``rows`` rows: fed tokens, windows of distinct ids, the embedding of a random
    [V, D] table."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(V, D, generator=g)
    windows = torch.stack([torch.randperm(V, generator=g)[:window] for _ in range(rows)])
    return StepContext(step, torch.randint(0, V, (rows,), generator=g), windows, lambda ids: table[ids], HEAD,
                       tuple(f"req-{i}" for i in range(rows)), torch.randn(rows, D, generator=g))


def ids_of(active) -> set[int]:
    return set(active.ids().tolist())


def test_lowrank_at_one_row_is_the_loop_policys_set(bundle):
    """Both score with the same rows (fbgemm int8 where the CPU runs it, else float32)."""
    table = SelectorTable.from_bundle(bundle, "lowrank")
    policy = SelectorPolicy(lowrank_selector(table, V, EOS, "cpu", 64))
    selector = build_selector(bundle, SelectorSpec("lowrank"), V, D)
    hidden = torch.randn(5, D, generator=torch.Generator().manual_seed(1))
    batch = selector(hidden)  # [5, 64]
    assert batch.shape == (5, 64)
    for i in range(5):
        one = selector(hidden[i : i + 1])[0]
        assert set(one.tolist()) == set(batch[i].tolist())  # a row's set does not depend on its batch
        assert set(one.tolist()) == ids_of(policy.active_ids(0, hidden[i : i + 1]))
        assert 7 in set(one.tolist())  # EOS pinned
    assert len({tuple(sorted(r.tolist())) for r in batch}) == 5  # each row its own set


def test_lowrank_at_the_batched_kernels_rank_gives_each_row_its_own_set_alone_or_batched():
    """From :data:`BATCHED_RANK` int8 rows score a batch in one call where the CPU allows: a row's set is the one it
    gets alone (the bits are, tests/test_int8_draft.py)."""
    g = torch.Generator().manual_seed(2)
    r = BATCHED_RANK
    selector = LowRankSelector(torch.randn(r, D, generator=g), torch.randn(V, r, generator=g) / 16,
                               torch.randn(V, generator=g), 64)
    assert selector.per_row == (selector.int8 and not INT8_GATHERED)
    hidden = torch.randn(5, D, generator=g)
    batch = selector(hidden)
    for i in range(5):
        assert torch.equal(torch.sort(selector(hidden[i : i + 1])[0]).values, torch.sort(batch[i]).values)


def is_top_k(ids: torch.Tensor, row: torch.Tensor, k: int) -> bool:
    """Whether ``ids`` are k distinct ids of ``row`` none scored below an id left out (a top-k set, ties at the k-th
    score taken in any order)."""
    chosen = torch.zeros(row.numel(), dtype=torch.bool)
    chosen[ids] = True
    return ids.numel() == k == int(chosen.sum()) and bool(row[chosen].min() >= row[~chosen].max())


@pytest.mark.parametrize("rows", [2, 5])
def test_batched_top_ids_give_each_row_the_set_top_ids_gives_it_alone(rows):
    g = torch.Generator().manual_seed(rows)
    n, k = 20_000, 256
    scores = torch.randn(rows, n, generator=g)
    scores[1] = torch.randint(0, 40, (n,), generator=g).float()  # ~500 ids tie at the top score, k-th among them
    got = top_ids_batched(scores, k)
    assert got.shape == (rows, k)
    for i in range(rows):
        assert is_top_k(got[i], scores[i], k)
        if i != 1:  # no ties: exactly top_ids' set, whatever rows sit beside it
            assert set(got[i].tolist()) == set(top_ids(scores[i], k).tolist())
    assert torch.equal(torch.sort(top_ids_batched(scores[:1], k)[0]).values, torch.sort(got[0]).values)


def test_batched_top_ids_fall_back_to_topk_where_a_row_has_too_few_candidates():
    g = torch.Generator().manual_seed(3)
    n, k = 20_000, 256
    scores = torch.randn(3, n, generator=g)
    scores[1] *= 0.01
    scores[1, ::16] += 10  # only the sampled scores pass the threshold: fewer than k candidates
    scores[2] = float("-inf")
    scores[2, 1::16][: k // 2] = torch.randn(k // 2, generator=g)  # k/2 finite, none sampled: threshold -inf
    got = top_ids_batched(scores, k)
    for i in range(3):
        assert is_top_k(got[i], scores[i], k)
        assert bool((got[i] >= 0).all() and (got[i] < n).all())
    assert set(got[0].tolist()) == set(top_ids(scores[0], k).tolist())
    assert torch.equal(top_ids_batched(scores[:, :100], k), torch.arange(100).expand(3, 100))  # k >= n: every id


def test_lowrank_from_the_batched_top_k_rows_gives_each_row_its_set_alone():
    g = torch.Generator().manual_seed(4)
    selector = LowRankSelector(torch.randn(16, D, generator=g), torch.randn(20_000, 16, generator=g),
                               torch.randn(20_000, generator=g), 256, int8=False)
    hidden = torch.randn(5, D, generator=g)
    batch = selector(hidden)
    for i in range(hidden.shape[0]):
        assert set(batch[i].tolist()) == set(selector(hidden[i : i + 1])[0].tolist())


def test_centroids_at_one_row_is_the_loop_policys_set(bundle):
    table = SelectorTable.from_bundle(bundle, "centroids")
    policy = SelectorPolicy(centroid_selector(table, V, EOS, "cpu", 3))
    selector = build_selector(bundle, SelectorSpec("centroids"), V, D)
    assert isinstance(selector, CentroidSelector) and selector.k == 3 * 50 + 1
    hidden = torch.randn(4, D, generator=torch.Generator().manual_seed(2))
    batch = selector(hidden)
    for i in range(4):
        assert set(batch[i].tolist()) == ids_of(policy.active_ids(0, hidden[i : i + 1]))


def test_a_batch_of_centroid_sets_is_the_union_of_its_distinct_blocks(bundle):
    """A batched head gathers each block any row picked once: ``union[where]`` is every row's own set, in order."""
    selector = build_selector(bundle, SelectorSpec("centroids"), V, D)
    hidden = torch.randn(6, D, generator=torch.Generator().manual_seed(4))
    ids, union, where = selector.select_union(hidden)
    assert torch.equal(ids, selector(hidden)) and torch.equal(union[where], ids)
    eos = 1
    assert (union.numel() - eos) % 50 == 0  # whole blocks, plus EOS
    assert union.numel() < 6 * selector.k  # the rows share blocks (18 picks of 20 blocks), each gathered once


def test_fr_is_the_rankings_prefix_for_every_row(bundle):
    selector = build_selector(bundle, SelectorSpec("fr", 100), V, D)
    assert isinstance(selector, StaticSelector)
    ranking = FreqTable.from_bundle(bundle).ranking
    rows = selector(torch.randn(3, D))
    assert all(set(r.tolist()) == set(ranking[:100].tolist()) for r in rows)
    assert SelectorPolicy(selector).active_ids(0).ids().tolist() == ranking[:100].tolist()
    assert build_selector(bundle, SelectorSpec("fr"), V, D).k == V  # default: FR-Spec's 32k, at most the vocabulary


@pytest.mark.parametrize("strategy", batch_strategies())
def test_selected_head_is_the_full_head_over_each_rows_set_and_shards_score_each_id_once(bundle, strategy):
    g = torch.Generator().manual_seed(3)
    weight, hidden = torch.randn(V, D, generator=g), torch.randn(6, D, generator=g)
    spec = SelectorSpec(strategy, {"fr": 100, "fr-pa": 100, "microspec": 40, "hybrid": 50, "evospec": 60}.get(strategy))
    head = SelectedHead(build_selector(bundle, spec, V, D))
    ctx = step_context(6)
    logits, ids = head.select_and_score(hidden, weight, ctx=ctx)
    full = hidden @ weight.T
    torch.testing.assert_close(logits, full.gather(1, ids))
    per_row, per_row_ids = SelectedHead(head.selector, union=False).select_and_score(hidden, weight, ctx=ctx)
    assert torch.equal(per_row_ids, ids)  # row by row (the CUDA path, a graph can capture it) = over the union
    torch.testing.assert_close(per_row, logits)
    rows = scatter_logits(logits, ids, V)
    assert torch.equal(torch.isfinite(rows).sum(1), torch.tensor([len(set(r.tolist())) for r in ids]))
    # two shards of the rows, as vLLM's ParallelLMHead splits them: each scores only its own ids, the max over
    # shards is the unsharded logits
    cut = 512
    parts = [SelectedHead(head.selector).select_and_score(hidden, weight[a:b], a, b, ctx) for a, b in ((0, cut), (cut, V))]
    assert all(torch.equal(p[1], ids) for p in parts)
    torch.testing.assert_close(torch.maximum(parts[0][0], parts[1][0]), logits)
    for (shard_logits, _), (a, b) in zip(parts, ((0, cut), (cut, V))):
        assert torch.equal(torch.isfinite(shard_logits), (ids >= a) & (ids < b))
    for i in range(2):  # one row at a time: the GEMV path
        one = step_context(1, seed=i)
        (lo, ids_one), (hi, _) = (SelectedHead(head.selector).select_and_score(hidden[i : i + 1], weight[a:b], a, b, one)
                                  for a, b in ((0, cut), (cut, V)))
        torch.testing.assert_close(torch.maximum(lo, hi), full[i : i + 1].gather(1, ids_one))


def test_changing_sets_go_row_by_row_off_a_cpu_until_they_hold_twice_the_heads_rows():
    """The rule measured on an H200 (docs/measurements/2026-11-27-gpu-batch-heads-h200.md): a CPU scores a batch's
    changing sets over their union; another device row by row (a CUDA graph captures it) up to PER_ROW_LIMIT times
    the head's rows, over the union past it."""
    from dynvocab.runtime.heads.selected_head import PER_ROW_LIMIT

    head, meta = SelectedHead(StaticSelector(torch.arange(3))), torch.empty(1, device="meta")
    assert head._union(torch.empty(1), 10, 100)
    assert not head._union(meta, PER_ROW_LIMIT * 100, 100) and head._union(meta, PER_ROW_LIMIT * 100 + 1, 100)
    assert not SelectedHead(head.selector, union=False)._union(torch.empty(1), 10**9, 100)
    assert SelectedHead(head.selector, union=True)._union(meta, 1, 100)


@pytest.mark.parametrize("window,whole", [(40, False), (400, True)], ids=["few-ids", "past-the-share"])
def test_changing_sets_past_the_share_are_scored_by_the_hosts_whole_head(bundle, window, whole):
    """A batch's changing sets whose distinct ids pass WHOLE_SHARE of the head are scored by the host's own full
    head (vLLM's packed GEMM in the plugin) and gathered; fewer, over their gathered rows. The logits are the full
    head's either way."""
    from dynvocab.runtime.heads.selected_head import WHOLE_SHARE

    g = torch.Generator().manual_seed(4)
    weight, hidden = torch.randn(V, D, generator=g), torch.randn(3, D, generator=g)
    calls = []

    def full_head(x):
        calls.append(x.shape)
        return x @ weight.T

    head = SelectedHead(build_selector(bundle, SelectorSpec("microspec", window), V, D), whole=full_head)
    ctx = step_context(3, window=window)
    logits, ids = head.select_and_score(hidden, weight, ctx=ctx)
    torch.testing.assert_close(logits, (hidden @ weight.T).gather(1, ids))
    assert (len(set(ctx.windows.flatten().tolist())) > WHOLE_SHARE * V) == whole
    assert calls == ([(3, D)] if whole else [])
    changing = V if whole else len(set(ctx.windows.flatten().tolist()))  # every row, or the distinct ids
    assert head.scored[0] == EOS.numel() + changing  # the shared EOS, then the changing part


def test_dynaspecs_router_is_float32_when_built_under_an_engines_default_dtype(bundle):
    """vLLM builds the draft, and the folder's selector with it, under the model's default dtype."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        selector = build_selector(bundle, SelectorSpec("dynaspec", 2), V, D)
    finally:
        torch.set_default_dtype(previous)
    assert all(p.dtype == torch.float32 for p in selector.router.parameters())
    hidden = torch.randn(2, D, dtype=torch.bfloat16)
    assert selector.select(hidden, step_context(2)).ids(2).shape[0] == 2


def test_what_cannot_run_batched_is_refused_in_one_line(bundle):
    for strategy in ("full", "nope"):
        why = refusal(strategy)
        assert why and "\n" not in why and strategy in why
        with pytest.raises(DynvocabError, match="cannot run inside vLLM"):
            build_selector(bundle, SelectorSpec(strategy), V, D)
    with pytest.raises(DynvocabError, match="hidden size"):
        build_selector(bundle, SelectorSpec("lowrank"), V, D + 1)
    with pytest.raises(DynvocabError, match="at least 1"):
        LowRankSelector(torch.zeros(2, D), torch.zeros(V, 2), torch.zeros(V), 0)


def test_each_strategys_own_flags_set_its_batched_budget_and_others_are_refused():
    """``bench --vllm --k-max 32`` serves ``dynaspec`` 32 clusters, as the loop's ``--k-max 32`` does; a flag the
    plugin does not read is one line, not silently dropped."""
    def asked(strategy, *configs, fr_size=None):
        return asked_budget(strategy, StrategyOptions(fr_size=fr_size, configs=configs))

    assert asked("dynaspec", DynaSpecConfig(k_max=32)) == 32
    assert asked("lowrank") is None and asked("lowrank", LowRankConfig(candidates=64)) == 64
    assert asked("centroids", CentroidConfig(blocks=3)) == 3
    assert asked("fr", fr_size=100) == 100 and asked("fr") is None
    assert asked("fr-pa", fr_size=100) == 100 and asked("fr-pa", PositionAwareConfig(k_max=50), fr_size=100) == 50
    assert asked("microspec", MicroSpecConfig(window=256)) == 256
    assert asked("hybrid", HybridConfig(core_size=512)) == 512
    assert asked("lowrank", DynaSpecConfig(k_max=32)) is None  # another strategy's flag: not this row's
    for strategy, config, flag in (("hybrid", HybridConfig(window=64), "--hybrid-window"),
                                   ("microspec", MicroSpecConfig(k_pre=5), "--k-pre")):
        with pytest.raises(DynvocabError, match=f"^{flag} does not reach {strategy} inside vLLM") as err:
            asked(strategy, config)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("strategy", ["fr-pa", "dynaspec", "microspec", "hybrid"])
def test_a_context_selectors_draft_step_reads_nothing_back_from_the_device(bundle, strategy):
    """The plugin's head at every draft position of a batch: no tensor is read to the host (what tests/
    test_host_reads.py forbids in the loop); the context comes as device tensors and the position as a number."""
    from dynvocab.runtime.host import HostReads

    g = torch.Generator().manual_seed(4)
    weight, hidden = torch.randn(V, D, generator=g), torch.randn(4, D, generator=g)
    head = SelectedHead(build_selector(bundle, SelectorSpec(strategy, {"microspec": 40, "hybrid": 50}.get(strategy)), V, D))
    contexts = [step_context(4, step=t) for t in range(4)]
    with HostReads() as reads:
        for ctx in contexts:
            head.select_and_score(hidden, weight, ctx=ctx)
    assert not reads.elsewhere and not reads.helper, (dict(reads.elsewhere), dict(reads.helper))


def test_context_selectors_follow_their_context(bundle):
    """fr-pa's set is the ranking's prefix for the position; dynaspec's depends on the fed token; the window
    strategies hold each row's window, hybrid also the core and the graph successors of the fed token; the loop's
    DynaSpec policy routes one row exactly as the batched selector routes it."""
    from dynvocab.artifacts import ClusterTable, GraphTable
    from dynvocab.artifacts.router import RouterTable
    from dynvocab.runtime.selection.dynaspec import router_selector
    from dynvocab.budget import pa_budget

    hidden = torch.randn(3, D, generator=torch.Generator().manual_seed(6))
    pa = build_selector(bundle, SelectorSpec("fr-pa", 300), V, D)
    ranking = FreqTable.from_bundle(bundle).ranking
    for t in range(5):
        shared = pa.select(hidden, step_context(3, step=t)).shared
        assert torch.equal(shared, ranking[: pa_budget(300, t)])
    ctx = step_context(3)
    window = build_selector(bundle, SelectorSpec("microspec", 40), V, D).select(hidden, ctx)
    assert torch.equal(window.rows, ctx.windows) and window.shared.tolist() == EOS.tolist()
    hybrid = build_selector(bundle, SelectorSpec("hybrid", 50), V, D).select(hidden, ctx)
    graph = GraphTable.from_bundle(bundle)
    for r in range(3):
        successors = set(graph.successors(int(ctx.fed[r]), 8)[0].tolist())  # padded with a window id
        assert set(hybrid.ids(3)[r].tolist()) == set(ranking[:50].tolist()) | set(ctx.windows[r].tolist()) | successors
    router = build_selector(bundle, SelectorSpec("dynaspec", 2), V, D)
    sets = router.select(hidden, ctx).ids(3)
    other = router.select(hidden, StepContext(0, (ctx.fed + 1) % V, ctx.windows, ctx.embed)).ids(3)
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(sets, other))  # the fed token routes
    table = torch.randn(V, D, generator=torch.Generator().manual_seed(5))
    loop = SelectorPolicy(router_selector(ClusterTable.from_bundle(bundle), RouterTable.from_bundle(bundle),
                                          DynaSpecConfig(k_max=2), V, EOS), table)
    for r in range(3):
        for t in (0, 2):
            one = router.select(hidden[r : r + 1], StepContext(t, ctx.fed[r : r + 1], None, ctx.embed)).ids(1)[0]
            assert set(one.tolist()) == set(loop.active_ids(t, hidden[r : r + 1], ctx.fed[r : r + 1]).ids().tolist())


def test_hybrids_per_step_search_adds_each_rows_nearest_head_rows(bundle, tmp_path):
    """With a ``draft_hnsw`` stage over the head, hybrid's set also holds each row's 16 hits of the search dynvocab's
    own loop runs at every draft step (``mips_search`` over the stage laid on the head, at the engine's ef); a head
    of another shape (a rank's shard) or none gets no search."""
    from dynvocab.artifacts import StoredIndex, mips_search
    from dynvocab.builders.hnsw import HnswConfig, head_stage
    from dynvocab.runtime.selection.context.hybrid import HybridSelector
    from dynvocab.runtime.selection.head_search import ENGINE_EF, HeadSearch

    g = torch.Generator().manual_seed(8)
    weight = torch.randn(V, D, generator=g) * (torch.rand(V, 1, generator=g) * 4 + 0.5)  # varied row norms
    stages = [Stage(s, {n: bundle.tensor(f"{s}.{n}") for n in bundle.tensor_names(s)}, {}, {}) for s in ("freq", "graph")]
    stages.append(head_stage("draft_hnsw", weight, "draft", HnswConfig(m=8, ef_construction=64, num_threads=1)))
    fp = ModelFingerprint(V, "0" * 64, V, D)
    with load_bundle(write_bundle(tmp_path / "h.safetensors", stages, fp, fp)) as indexed:
        selector = build_selector(indexed, SelectorSpec("hybrid", 1), V, D)
        loop_index = StoredIndex.read(indexed, "draft_hnsw").over(weight)
    loop_index.set_ef(ENGINE_EF)
    assert isinstance(selector.search, HeadSearch) and "head" in selector.reads
    hidden = torch.randn(16, D, generator=g)
    ctx = step_context(16, window=4)
    sets = selector.select(hidden, StepContext(ctx.step, ctx.fed, ctx.windows, ctx.embed, weight))
    assert sets.rows.shape == (16, 4 + 8 + 16)  # window, successors, search
    assert torch.equal(sets.rows[:, -16:], mips_search(loop_index, hidden, 16))
    exact = (hidden @ weight.T).topk(16).indices
    assert sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(sets.rows[:, -16:], exact)) > 0
    for head in (None, weight[: V // 2]):
        rows = selector.select(hidden, StepContext(ctx.step, ctx.fed, ctx.windows, ctx.embed, head)).rows
        assert rows.shape == (16, 4 + 8)
    plain = HybridSelector(selector.core, selector.window, selector.graph, 8)
    assert plain.reads == {"fed", "window"} and selector.k == plain.k + 16
    assert torch.equal(plain.select(hidden, ctx).rows, sets.rows[:, :-16])


@pytest.mark.parametrize("strategy,budget", [("lowrank", 64), ("centroids", 2), ("dynaspec", 3)])
def test_each_node_of_a_tree_depth_gets_the_set_it_gets_alone(bundle, strategy, budget):
    """A tree depth is a batch of its frontier nodes: each node's own set (the columns ``own`` marks in the union the
    head multiplies once) is the set the selector gives that node alone, as a chain's step; its masked logits are the
    head's over that set, ``-inf`` elsewhere (so each node is normalised over its own set)."""
    from dynvocab.runtime.heads.head import DraftHead

    embedding = torch.randn(V, D, generator=torch.Generator().manual_seed(5))
    policy = SelectorPolicy(build_selector(bundle, SelectorSpec(strategy, budget), V, D), embedding)
    g = torch.Generator().manual_seed(8)
    hidden, fed = torch.randn(4, D, generator=g), torch.randint(0, V, (4,), generator=g)
    nodes = policy.node_sets(2, hidden, fed)
    logits, cols = DraftHead(HEAD).logits(hidden, nodes.active)
    masked = nodes.mask(logits, cols)
    assert cols.unique().numel() == cols.numel()  # the union: each id multiplied once
    for r in range(4):
        alone = policy.active_ids(2, hidden[r : r + 1], fed[r : r + 1])
        own = nodes.own[r]
        assert sorted(cols[own].tolist()) == sorted(alone.ids().tolist())
        ref_logits, ref_cols = DraftHead(HEAD).logits(hidden[r : r + 1], alone)
        ref = dict(zip(ref_cols.tolist(), ref_logits[0].tolist()))
        torch.testing.assert_close(masked[r, own], torch.tensor([ref[i] for i in cols[own].tolist()]))
        assert torch.isinf(masked[r, ~own]).all()
    assert nodes.active.size < 4 * alone.size or strategy == "lowrank"  # shared blocks and clusters: gathered once


def test_a_set_the_same_for_every_node_is_asked_once_per_depth(bundle):
    """``fr``'s and ``fr-pa``'s rows share one set: a tree depth asks it once, for its best node."""
    for strategy in ("fr", "fr-pa"):
        policy = SelectorPolicy(build_selector(bundle, SelectorSpec(strategy, 100), V, D))
        assert policy.node_sets(1, torch.randn(4, D), torch.arange(4)) is None


def test_a_node_whose_own_ids_the_head_lacks_keeps_the_union():
    """A mapped head (EAGLE-3's own vocabulary) returns only the columns it has: each row is masked to its own ids
    among them, and a row none of whose ids it has keeps them all (never a row of -inf)."""
    from dynvocab.runtime.heads.active_set import NodeSets

    nodes = NodeSets.of(torch.tensor([[1, 2, 3], [3, 4, 5], [6, 7, 8]]))
    cols = torch.tensor([5, 2, 3])  # the head has ids 2, 3, 5 only, in its own order
    masked = nodes.mask(torch.zeros(3, 3), cols)
    assert torch.isinf(masked).tolist() == [[True, False, False], [False, True, False], [False, False, False]]
