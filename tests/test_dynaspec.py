"""DynaSpec's selector in the loop: the position-aware cluster budget, the union of routed clusters, losslessness."""

from __future__ import annotations

import pytest
import torch

from dynvocab.artifacts import ClusterTable
from dynvocab.artifacts.router import RouterMLP, RouterTable
from dynvocab.errors import DynvocabError
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.heads.active_set import RowRanges
from dynvocab.runtime.selection import SelectorPolicy
from dynvocab.runtime.selection.dynaspec import DynaSpecConfig, router_selector
from dynvocab.runtime.strategies import PolicyContext, StrategyOptions, make_policy

VOCAB = 96


def dynaspec(cfg: DynaSpecConfig, clusters: ClusterTable, router: RouterTable, embedding: torch.Tensor, vocab: int,
             eos: torch.Tensor | None = None) -> SelectorPolicy:
    """DynaSpec in the loop: its one selector over ``clusters``, the draft's ``embedding`` read for the fed token."""
    eos = torch.empty(0, dtype=torch.long) if eos is None else eos
    return SelectorPolicy(router_selector(clusters, router, cfg, vocab, eos), embedding)


def flat(active) -> torch.Tensor:
    """All ids of an active set, in segment order."""
    return active.ids()


def fixed_router(scores: list[float], dim: int = 4) -> RouterTable:
    """A router whose logits ignore the input: ``scores`` [M] at every step."""
    mlp = RouterMLP(dim, dim, 3, len(scores))
    with torch.no_grad():
        for p in mlp.parameters():
            p.zero_()
        mlp.fc2.bias.copy_(torch.tensor(scores))
    return RouterTable.from_module(mlp, {"top_l": 1})


def random_router(dim: int, clusters: int, seed: int) -> RouterTable:
    torch.manual_seed(seed)
    return RouterTable.from_module(RouterMLP(dim, dim, 16, clusters), {"top_l": 1})


def test_budget_follows_dynaspec():
    assert [DynaSpecConfig(k_max=64).budget(t) for t in range(5)] == [64, 64, 10, 8, 6]
    assert [DynaSpecConfig(k_max=3).budget(t) for t in range(4)] == [3, 3, 1, 1]
    assert [DynaSpecConfig(k_max=64, position_aware=False).budget(t) for t in range(4)] == [64] * 4


def test_union_of_top_clusters_plus_eos():
    # 20 ids in 5 clusters; ids 18, 19 lie past the draftable vocabulary (padding rows).
    assign = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 0, 0, 1, 2, 3, 3, 3, 4, 2])
    table = ClusterTable(assign, torch.eye(5, 4))
    scores = [0.5, 3.0, -1.0, 2.0, 1.0]  # cluster order by score: 1, 3, 4, 0, 2
    eos = torch.tensor([2, 11, 19])  # id 2 in cluster 2, id 11 in cluster 0, id 19 not draftable
    policy = dynaspec(DynaSpecConfig(k_max=3), table, fixed_router(scores), torch.randn(20, 4), 18, eos)
    h = torch.randn(1, 4)

    def expected(clusters):
        ids = table.members(torch.tensor(clusters))
        return sorted(set(ids[ids < 18].tolist()) | {2, 11})

    for step, clusters in ((0, [1, 3, 4]), (1, [1, 3, 4]), (2, [1]), (5, [1])):
        active = policy.active_ids(step, h, token=torch.tensor([7]))
        ranges = active.segments[0]
        assert isinstance(ranges, RowRanges) and ranges.order is policy.selector.order  # packed once, sliced after
        assert len(ranges.starts) <= len(clusters)
        ids = flat(active)
        assert ids.dtype == torch.long
        assert ids.numel() == len(set(ids.tolist())), "ids must be distinct for the packed head"
        assert sorted(ids.tolist()) == expected(clusters)
    # EOS inside a chosen cluster is not repeated.
    wide = dynaspec(DynaSpecConfig(k_max=5), table, fixed_router(scores), torch.randn(20, 4), 18, eos)
    active = wide.active_ids(0, h, torch.tensor([3]))
    assert sorted(flat(active).tolist()) == list(range(18))
    assert len(active.segments[0].starts) == 1  # all five clusters: adjacent ranges merge into one matmul
    assert wide.selector.calls == 1


def test_routing_depends_on_hidden_state_and_token():
    table = ClusterTable(torch.arange(8) % 4, torch.eye(4, 2))
    router = random_router(2, 4, seed=1)
    embedding = torch.randn(8, 2)
    policy = dynaspec(DynaSpecConfig(k_max=1), table, router, embedding, 8)
    mlp = router.module()
    for token in range(8):
        h = torch.randn(1, 2)
        want = int(mlp(h, embedding[token : token + 1]).argmax())
        assert sorted(flat(policy.active_ids(0, h, torch.tensor([token]))).tolist()) == [want, want + 4]
    with pytest.raises(DynvocabError, match="routes on the draft hidden state"):
        policy.active_ids(0)


def test_mismatched_router_is_refused():
    table = ClusterTable(torch.arange(8) % 4, torch.eye(4, 2))
    with pytest.raises(DynvocabError, match="retrain"):
        dynaspec(DynaSpecConfig(), table, random_router(2, 5, seed=0), torch.randn(8, 2), 8)


NEEDS_BUNDLE = (
    "strategy 'dynaspec' needs --bundle B with stages clusters, router; build one with "
    "`dynvocab build-index --stages clusters --out B` and `dynvocab train-router --selector router --bundle B`"
)


def test_make_policy_needs_the_stages():
    ctx = PolicyContext(vocab_size=VOCAB, eos_ids=set())
    with pytest.raises(DynvocabError) as err:
        make_policy("dynaspec", StrategyOptions(), ctx)
    assert str(err.value) == NEEDS_BUNDLE


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair
    return CausalLM(target), DraftModel(draft)


@pytest.mark.parametrize(("seed", "position_aware"), [(0, True), (1, True), (2, True), (3, False)])
def test_greedy_is_lossless(pair, seed, position_aware):
    target, draft = pair
    gen = torch.Generator().manual_seed(seed)
    table = ClusterTable(torch.randint(0, 12, (VOCAB,), generator=gen), torch.eye(12, 32))
    embedding = draft.model.get_input_embeddings().weight.detach()
    eos = {int(torch.randint(0, VOCAB, (1,), generator=gen))} if seed % 2 else set()
    cfg = DynaSpecConfig(k_max=4, position_aware=position_aware)
    policy = dynaspec(cfg, table, random_router(32, 12, seed), embedding, VOCAB, torch.tensor(sorted(eos)))
    prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
    decode = DecodeConfig(gamma=1 + seed % 5, max_new_tokens=24)
    ar = speculative_generate(target, prompt, decode, eos)
    spec = speculative_generate(target, prompt, decode, eos, draft, policy)
    assert spec.token_ids == ar.token_ids
    assert spec.metrics.mean_active_vocab < VOCAB  # the head really was restricted
    assert policy.selector.calls == spec.metrics.draft_steps
