"""The loop's request window (rebuilt from the stream's last W entries where it grew, the same tensor while its set is
unchanged) gives exactly the sets, and head columns, of the obvious model: a deque of the last W entries."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from dynvocab.artifacts import GraphTable
from dynvocab.bench.micro.scripted import ScriptedCycle, ScriptedDraft, run_script
from dynvocab.runtime.drafts.draft import DraftInfo
from dynvocab.runtime.heads.head import DraftHead
from dynvocab.runtime.selection.base import CycleReport
from dynvocab.runtime.selection.context.hybrid import HybridConfig, HybridPolicy
from dynvocab.runtime.selection.context.window import MicroSpecConfig, MicroSpecPolicy

VOCAB, DIM, GAMMA = 600, 8, 4


class DequeWindow:
    """The window by the obvious model: a deque of the last W stream entries, its set sorted anew at every push."""

    def push(self, entries):
        if not hasattr(self, "stream"):
            self.stream = deque(maxlen=self.cfg.window)
        self.stream.extend(entries.tolist())
        self.window = torch.tensor(sorted(set(self.stream)), dtype=torch.long)[None]


class DequeMicroSpec(DequeWindow, MicroSpecPolicy):
    pass


class DequeHybrid(DequeWindow, HybridPolicy):
    pass


def graph(seed: int) -> GraphTable:
    g = torch.Generator().manual_seed(seed)
    fanout = 6
    return GraphTable(
        torch.arange(0, (VOCAB + 1) * fanout, fanout),
        torch.randint(VOCAB, (VOCAB * fanout,), generator=g, dtype=torch.int32),
        torch.full((VOCAB * fanout,), 1 / fanout),
    )


def script(seed: int, cycles: int = 60) -> list[ScriptedCycle]:
    """Cycles whose drafts mostly repeat a small pool (sets change a little) and sometimes jump (they change a lot)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for c in range(cycles):
        pool = 40 if c % 17 else VOCAB
        tokens = torch.randint(pool, (GAMMA + 1,), generator=g).tolist()
        k = int(torch.randint(GAMMA + 1, (1,), generator=g))
        logits = torch.randn(GAMMA + 1, VOCAB, generator=g)
        tops = [torch.randint(VOCAB, (2,), generator=g) for _ in range(GAMMA)]
        hidden = torch.randn(GAMMA, 1, DIM, generator=g)
        out.append(ScriptedCycle(tokens[:GAMMA], k, tokens[k], logits, torch.randn(GAMMA + 1, DIM), hidden, tops))
    return out


def run(policy, cycles: list[ScriptedCycle], head: DraftHead) -> list:
    """Per draft step, driven by the loop's own cycle: the active segments' ids and the head's column ids."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    policy.prefill(prompt, torch.randn(7, VOCAB, generator=g), None)
    draft = ScriptedDraft(DraftInfo("scripted draft", VOCAB, DIM, torch.device("cpu"), torch.zeros(VOCAB, DIM)), head)
    results = run_script(policy, cycles, prompt.tolist(), draft)
    sets = [active for r in results for active in r.draft.sets]
    assert len(sets) == len(draft.columns) == GAMMA * len(cycles)
    return [([s.tolist() for s in a.id_segments()], cols.tolist()) for a, cols in zip(sets, draft.columns)]


@pytest.mark.parametrize("window", [16, 64, 3072])
def test_microspec_window_matches_the_deque(window):
    cfg = MicroSpecConfig(k_pre=2, k_ver=2, window=window, draft_alternatives=2)
    weight = torch.randn(VOCAB, DIM)
    pinned = torch.tensor([599, 7])
    new = run(MicroSpecPolicy(cfg, VOCAB, "cpu", pinned=pinned), script(0), DraftHead(weight))
    old = run(DequeMicroSpec(cfg, VOCAB, "cpu", pinned=pinned), script(0), DraftHead(weight))
    assert new == old


@pytest.mark.parametrize("pa_core", [False, True])
def test_hybrid_window_matches_the_deque(pa_core):
    cfg = HybridConfig(core_size=30, window=48, pa_core=pa_core, step_successors=3, successors=2, max_insert=6)
    weight = torch.randn(VOCAB, DIM)
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))

    def make(kind):
        return kind(cfg, VOCAB, "cpu", ranking, pinned=torch.tensor([599]), graph=graph(3))

    new_policy, old_policy = make(HybridPolicy), make(DequeHybrid)
    assert run(new_policy, script(4), DraftHead(weight)) == run(old_policy, script(4), DraftHead(weight))
    assert new_policy.misses == old_policy.misses > 0


def test_an_unchanged_window_returns_the_same_tensor():
    policy = MicroSpecPolicy(MicroSpecConfig(k_pre=1, k_ver=1, window=50, draft_alternatives=0), VOCAB, "cpu")
    policy.prefill(torch.tensor([5, 6]), None, None)
    logits = torch.full((2, VOCAB), -1.0)
    logits[:, 5] = 1.0
    before = policy.active_ids(0)
    policy.observe(CycleReport(2, [6], [], 1, [6, 5], logits, torch.zeros(2, DIM)))  # only ids already in the window
    assert policy.active_ids(0) is before


def test_dynaspec_ranges_match_the_host_merge():
    from dynvocab.artifacts import ClusterTable
    from dynvocab.artifacts.router import RouterMLP, RouterTable
    from dynvocab.runtime.heads.active_set import merge_ranges
    from dynvocab.runtime.selection.dynaspec import DynaSpecConfig, router_selector

    g = torch.Generator().manual_seed(5)
    m = 24
    assign = torch.randint(m // 2, (VOCAB,), generator=g) * 2  # odd clusters are empty: picked, they touch both sides
    clusters = ClusterTable(assign, torch.randn(m, DIM))
    config = {"hidden_dim": DIM, "embed_dim": DIM, "width": 16, "num_clusters": m}
    router = RouterTable.from_module(RouterMLP(DIM, DIM, 16, m), config)
    embedding = torch.randn(VOCAB, DIM)
    selector = router_selector(clusters, router, DynaSpecConfig(k_max=8), VOCAB, torch.tensor([5]))
    sizes = torch.bincount(assign, minlength=m)
    ends = sizes.cumsum(0)
    starts = ends - sizes
    for _ in range(200):
        scores = torch.randn(m, generator=g)
        k = int(torch.randint(1, m + 1, (1,), generator=g))
        chosen = scores.topk(k).indices.tolist()
        ranges, eos = selector.groups.select(torch.tensor(chosen))
        want = merge_ranges([int(starts[c]) for c in chosen], [int(ends[c]) for c in chosen])
        assert (ranges.starts, ranges.ends) == want
        assert eos.tolist() == ([] if int(assign[5]) in chosen else [5])
