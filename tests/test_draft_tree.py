"""EAGLE-2 draft trees (``--tree``): the shape's refusals, growth against a hand-worked example, an n-gram branch
through the tree's own nodes, the draft's tree attention against plain chains, greedy = ``ar`` for every strategy
and both head layouts, exact recursive rejection sampling one and two deep (a sibling accepted at each; ``auto``
too), ``auto`` going on across generations, and the caches after a cycle holding exactly the accepted path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from test_eagle_cli import heads  # noqa: F401  (fixture: EAGLE heads saved for the tiny target)
from test_eagle_loop import eagle1, setup, target_model  # noqa: F401  (fixtures: the target, both head layouts)
from sampling_checks import first_pairs_follow_the_target, pooled_chi_square
from test_loop import VOCAB, greedy_case, make_policy
from test_tree_budget import Ticks
from dynvocab.errors import DynvocabError
from dynvocab.runtime.decoding.cycle import CycleSetup, TargetVerifier, run_cycle
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.decoding.timing import SectionTimer
from dynvocab.runtime.drafts.draft import DraftInfo
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.eagle_draft import Eagle1Draft
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.selection import FullPolicy
from dynvocab.runtime.trees.growth import Candidates, Growth, grow_tree, rank_scores, tree_of
from dynvocab.runtime.trees.mode import TreeMemory
from dynvocab.runtime.trees.shape import TreeShape, parse_tree, split_tree
from dynvocab.runtime.trees.tree import DraftTree
from dynvocab.runtime.trees.verify import SamplingConfig, verify

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.transformers_api]  # CI: again at the lower bound


@pytest.mark.parametrize("text, why", [
    ("4x0x8", "1 or more"), ("abc", "DEPTHxTOPKxTOKENS"), ("2x2x7", "grows 6 candidate tokens"), ("3x2", "DEPTHx"),
])
def test_bad_tree_values_are_refused_in_one_line(text, why):
    with pytest.raises(DynvocabError, match=why) as caught:
        parse_tree(text)
    assert "\n" not in str(caught.value)
    with pytest.raises(DynvocabError):
        DecodeConfig(tree=text)


def test_tree_values_and_row_names():
    assert parse_tree("off") is None and parse_tree("AUTO") == "auto"
    assert parse_tree("5x8x60") == TreeShape(5, 8, 60) and TreeShape(5, 8, 60).candidates == 8 + 4 * 64
    assert DecodeConfig(tree="5X8X60").tree == "5x8x60"
    assert split_tree("fr+ngram@tree") == ("fr+ngram", "tree") and split_tree("fr") == ("fr", None)
    assert split_tree("full@4x2x6") == ("full", "4x2x6") and split_tree("full@auto") == ("full", "auto")
    with pytest.raises(DynvocabError, match="DEPTHxTOPKxTOKENS"):
        split_tree("full@wide")
    assert TreeShape(5, 2, 10).within(2) == TreeShape(2, 2, 6)


class Transitions:
    """A scripted tree proposer over 6 ids: the head's logits after token t are row t of ``table``; its hidden
    state is the last token's one-hot. It records each branch call."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.length = 0
        self.calls = []
        self.info = DraftInfo("scripted", 6, 6, torch.device("cpu"), torch.eye(6))

    def step(self, ids):
        self.length += ids.numel()
        return torch.eye(6)[ids]

    def tree_root(self):
        return torch.zeros(1, 6)

    def branch(self, ids, feats, depth, ancestors):
        self.calls.append((ids.tolist(), depth, ancestors.int().tolist()))
        self.length += ids.numel()
        return torch.eye(6)[ids], torch.eye(6)[ids]

    def head_logits(self, hidden, active):
        return hidden @ self.table, None


def setup_for(proposer, sampling=SamplingConfig()):
    timer = SectionTimer(torch.device("cpu"), False)
    return CycleSetup(proposer, None, FullPolicy(6), sampling, torch.Generator().manual_seed(0), timer)


def test_growth_against_a_hand_worked_example():
    """Depth 3, top-2, 4 tokens. After token 0 the head prefers 1 (p .6) then 2 (.3); after 1: 3 (.5), 4 (.4);
    after 2: 5 (.9), 3; after 3: 4 (.7), 5 (.2); after 4: 0, 1; after 5: 2, 0."""
    p = torch.full((6, 6), 1e-3)
    for t, (a, pa, b, pb) in enumerate([(1, .6, 2, .3), (3, .5, 4, .4), (5, .9, 3, .05), (4, .7, 5, .2),
                                        (0, .5, 1, .4), (2, .6, 0, .3)]):
        p[t, a], p[t, b] = pa, pb
    proposer = Transitions(p.log())
    grown, cands = grow_tree(setup_for(proposer), [0], TreeShape(3, 2, 4))
    lp = torch.log_softmax(p.log(), dim=-1)
    # depth 1: 1, 2 under the root; depth 2: the children of both (both are the frontier), scored cumulatively
    assert cands.tokens[:6] == [1, 2, 3, 4, 5, 3] and cands.parents[:6] == [-1, -1, 0, 0, 1, 1]
    assert cands.scores[2] == pytest.approx(float(lp[0, 1] + lp[1, 3]))
    # the depth-3 frontier: the 2 best of the 4 depth-2 nodes: 2->5 (.3*.9=.27) and 1->3 (.6*.5=.30)
    assert proposer.calls[0] == ([1, 2], 1, [[], []])
    assert sorted(proposer.calls[1][0]) == [3, 5] and proposer.calls[1][1] == 2
    assert cands.expanded == [[0, 1], [2, 4]] or cands.expanded == [[0, 1], [4, 2]]
    # rows of the depth-2 batch see their own parent's slot of depth 1
    for ids, seen in zip(proposer.calls[1][0], proposer.calls[1][2]):
        assert seen == ([1, 0] if ids == 3 else [0, 1])
    # the 4 best of all: 1 (.6), 1->3 (.30), 2 (.3), 2->5 (.27); 1->3->4 is .21
    tree = tree_of(grown, cands, 4).tree
    assert tree.tokens.tolist() == [1, 2, 3, 5] and tree.parents == (-1, 0, 0, 1, 2)
    assert tree.depths == (0, 1, 1, 2, 2) and tree.main == (1, 3)
    assert tree.positions(7, "cpu").tolist() == [[7, 8, 8, 9, 9]]
    seen = tree.attention_mask(0, torch.float32, "cpu")[0, 0] == 0
    assert seen.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]
    five = tree_of(grown, cands, 5).tree  # then 1->4 (.24), before 1->3->4 (.21); the pass keeps growth order
    assert five.tokens.tolist() == [1, 2, 3, 4, 5] and five.parents == (-1, 0, 0, 1, 1, 2)


def test_choose_keeps_parents_and_earlier_siblings():
    cands = Candidates(2, [1, 2, 3, 4], [-1, -1, 0, 0], [-1.0, -3.0, -1.5, -1.2], [[0, 1]])
    assert cands.choose(2) == [0]  # the second best (3) is the child of rank 1 whose rank-0 sibling (2) is out
    assert cands.choose(3) == [0, 2, 3]


def test_greedy_walk_accepts_a_sibling():
    tree = DraftTree.of((-1, 0, 0, 1, 2), (5, 6, 7, 8), main=(1, 3))
    logits = torch.zeros(5, 10)
    logits[0, 6] = logits[2, 8] = logits[4, 9] = 5.0  # the target takes 6 (the second child), then 8, then 9
    verdict = verify(tree, logits, SamplingConfig(), torch.Generator())
    assert verdict.path == [6, 8] and verdict.next_token == 9 and verdict.rows == [0, 2, 4]
    assert verdict.tokens == (-1, 5, 6, 7, 8) and verdict.on_main == 0  # read back with the verdict


def test_recursive_rejection_sampling_is_exact_and_accepts_siblings():
    """A root with two children drawn without replacement from q; the first token emitted follows p."""
    torch.manual_seed(0)
    vocab, draws = 6, 20000
    p_logits = torch.tensor([2.0, 0.5, 1.5, 0.0, -1.0, 1.0])
    q = torch.softmax(torch.tensor([0.5, 2.0, 1.0, 1.5, 0.0, -2.0]), dim=0)
    gen = torch.Generator().manual_seed(1)
    counts, second = torch.zeros(vocab), 0
    cfg = SamplingConfig(temperature=1.0)
    for _ in range(draws):
        keys = q.log() - (-torch.rand(vocab, generator=gen).log()).log()
        a, b = keys.topk(2).indices.tolist()
        tree = DraftTree.of((-1, 0, 0), (a, b), main=(1,))
        verdict = verify(tree, torch.stack([p_logits] * 3), cfg, gen, lambda row: (q, None))
        first = verdict.path[0] if verdict.path else verdict.next_token
        counts[first] += 1
        second += verdict.rows[1:2] == [2]
    expected = torch.softmax(p_logits, 0) * draws  # every bin well above 5
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < 20.5, (stat, counts)  # 5 degrees of freedom: p ≈ 0.001
    assert second > draws // 20


def test_recursive_rejection_sampling_two_deep_is_exact_and_accepts_a_sibling_there():
    """A root with two children and each of them with two, every row's drawn without replacement from the draft's q
    there; the first two tokens emitted follow p (the second after the first: a rejected first cycle's next one is
    drawn from p after its token, as the next cycle would), and second children are accepted at depth 2."""
    vocab, draws = 5, 20000
    gen = torch.Generator().manual_seed(2)
    p_root = torch.tensor([1.5, 0.5, 1.0, 0.0, -0.5])
    p_after = torch.tensor([[1.0, 0.0, 1.5, -1.0, 0.5], [0.0, 1.0, 0.0, 1.0, -0.5], [1.5, -0.5, 0.0, 1.0, 0.0],
                            [0.5, 0.5, 0.5, 0.5, 0.5], [-1.0, 1.0, 0.0, 1.5, 0.0]])
    q_root = torch.softmax(torch.tensor([0.0, 1.5, 1.0, 0.5, -1.0]), dim=0)
    q_after = torch.softmax(torch.tensor([[0.0, 1.0, 0.5, 1.5, -1.0], [1.5, 0.0, 0.0, -1.0, 1.0],
                                          [0.0, 1.0, 1.5, 0.0, 0.5], [1.0, 0.0, -1.0, 0.5, 1.5],
                                          [0.5, 0.5, 1.5, 0.0, 0.0]]), dim=1)
    cfg = SamplingConfig(temperature=1.0)

    def two_drawn(q):
        return (q.log() - (-torch.rand(vocab, generator=gen).log()).log()).topk(2).indices.tolist()

    counts, sibling_two_deep = torch.zeros(vocab, vocab), 0
    for _ in range(draws):
        a, b = two_drawn(q_root)
        below = (*two_drawn(q_after[a]), *two_drawn(q_after[b]))  # rows 3, 4 under a; 5, 6 under b
        tree = DraftTree.of((-1, 0, 0, 1, 1, 2, 2), (a, b, *below), main=(1, 3))
        logits = torch.cat([torch.stack([p_root, p_after[a], p_after[b]]), torch.zeros(4, vocab)])
        proposals = {0: (q_root, None), 1: (q_after[a], None), 2: (q_after[b], None)}
        verdict = verify(tree, logits, cfg, gen, proposals.__getitem__)
        first, *rest = verdict.path + [verdict.next_token]
        second = rest[0] if rest else int(torch.multinomial(torch.softmax(p_after[first], 0), 1, generator=gen))
        counts[first, second] += 1
        sibling_two_deep += verdict.rows[2:3] in ([4], [6])
    expected = torch.softmax(p_root, 0)[:, None] * torch.softmax(p_after, 1)
    chi2, dof = pooled_chi_square(counts.flatten(), expected.flatten(), draws)
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof, counts)
    assert sibling_two_deep > draws // 50


def test_an_ngram_branch_runs_through_the_tree_s_own_nodes():
    """A lookup's continuation whose first tokens the tree already holds goes on below those nodes (a second child
    with the same token would never be reached: the walk takes the first child that matches), and is accepted."""
    cands = Candidates(2, [1, 2, 3, 4], [-1, -1, 0, 0], [-0.5, -1.2, -0.9, -1.0], [[0, 1]])
    growth = Growth([], [], [])
    assert tree_of(growth, cands, 4).tree.tokens.tolist() == [1, 2, 3, 4]
    tree = tree_of(growth, cands, 4, [1, 4, 5]).tree  # 1, then its second child 4, then a new node 5 under it
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5] and tree.parents == (-1, 0, 0, 1, 1, 4) and tree.main == (1, 3)
    logits = torch.zeros(6, 8)
    logits[0, 1] = logits[1, 4] = logits[4, 5] = logits[5, 7] = 5.0  # the target takes 1, 4, 5, then 7
    verdict = verify(tree, logits, SamplingConfig(), torch.Generator())
    assert verdict.path == [1, 4, 5] and verdict.next_token == 7
    fresh = tree_of(growth, cands, 4, [6, 1]).tree  # no child holds 6: the branch starts under the root
    assert fresh.tokens.tolist() == [1, 2, 3, 4, 6, 1] and fresh.parents == (-1, 0, 0, 1, 1, 0, 5)


def test_sampled_growth_scores_its_candidates_by_rank_as_planned():
    """The scores a sampled growth gives its candidates are the ones ``rank_scores`` knows before any draw (what
    ``--tree auto`` plans a sampled cycle from)."""
    proposer = Transitions(torch.randn(6, 6, generator=torch.Generator().manual_seed(0)))
    shape = TreeShape(3, 2, 10)
    _, cands = grow_tree(setup_for(proposer, SamplingConfig(temperature=1.0)), [0], shape)
    grown = [sorted(cands.scores[:2]), sorted(cands.scores[2:6]), sorted(cands.scores[6:])]
    for mine, planned in zip(grown, rank_scores(shape), strict=True):
        assert mine == pytest.approx(sorted(planned))


@pytest.mark.parametrize("kind", ["full", "fr", "fr-pa", "random", "microspec", "hybrid"])
@pytest.mark.parametrize("tree", ["3x2x5", "5x4x30"])
def test_greedy_trees_equal_ar(setup, kind, tree):
    target, draft = setup
    for seed in range(2):
        prompt, cfg = greedy_case(seed)
        ar = speculative_generate(target, prompt, cfg, set())
        spec = speculative_generate(target, prompt, replace(cfg, tree=tree), set(), draft, make_policy(kind, seed))
        assert spec.token_ids == ar.token_ids
        assert spec.metrics.tree_cycles >= spec.metrics.cycles - 1 and spec.metrics.head_calls > 0  # the last: 1 token


def test_greedy_tree_with_an_ngram_branch_equals_ar(setup):
    target, draft = setup
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    cfg = DecodeConfig(max_new_tokens=30, ngram=True, tree="4x2x6")
    ar = speculative_generate(target, prompt, DecodeConfig(max_new_tokens=30), set())
    assert speculative_generate(target, prompt, cfg, set(), draft, FullPolicy(VOCAB)).token_ids == ar.token_ids


def test_the_tree_accepts_more_than_the_chain(target_model):
    """The EAGLE-1 head initialised from the target is often right: a wide tree accepts more per pass."""
    target = CausalLM(target_model)
    draft = Eagle1Draft(eagle1(target_model), target)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    chain = speculative_generate(target, prompt, DecodeConfig(gamma=4, max_new_tokens=60), set(), draft,
                                 FullPolicy(VOCAB))
    tree = speculative_generate(target, prompt, DecodeConfig(max_new_tokens=60, tree="4x4x24"), set(), draft,
                                FullPolicy(VOCAB))
    assert tree.token_ids == chain.token_ids
    assert tree.metrics.mean_accepted_length > chain.metrics.mean_accepted_length
    assert tree.metrics.off_main > 0  # some accepted tokens came from a sibling of the main path


def test_the_drafts_tree_attention_equals_plain_chains(target_model):
    """A node fed in a tree batch gets the head output a plain chain along its path gets."""
    target = CausalLM(target_model)
    model = eagle1(target_model)
    with torch.no_grad():  # weights that make every input count
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            if "embed" not in name and "norm" not in name:
                p.add_(0.3 * torch.randn_like(p))
    draft = Eagle1Draft(model, target)
    prompt = torch.tensor([3, 14, 15, 92, 65, 35])
    target.reset()
    hidden = target.step(prompt[:-1])
    draft.reset()
    draft.observe(0, hidden, None)
    draft.step(prompt)
    root = draft.tree_root()
    out1, _ = draft.branch(torch.tensor([7, 8]), root.expand(2, -1), 1, torch.zeros(2, 0, dtype=torch.bool))
    ancestors = torch.tensor([[False, True], [True, False]])  # node 9 under 8, node 10 under 7
    _, head2 = draft.branch(torch.tensor([9, 10]), out1[[1, 0]], 2, ancestors)
    assert (head2[0] - head2[1]).abs().max() > 1e-2
    for parent, child, row in ((8, 9, 0), (7, 10, 1)):
        draft.rollback(prompt.numel() - 1)
        draft.step(prompt[-1:])  # the root's own feature again, then the path as a chain
        draft.step(torch.tensor([parent]))
        chain = draft.step(torch.tensor([child]))
        torch.testing.assert_close(head2[row : row + 1], chain, atol=1e-5, rtol=1e-5)


def test_a_cycle_leaves_both_caches_holding_exactly_the_accepted_path(target_model):
    target = CausalLM(target_model)
    draft = Eagle1Draft(eagle1(target_model), target)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    tokens = list(prompt)
    target.reset()
    hidden = target.step(torch.tensor(prompt[:-1]))
    draft.reset()
    draft.observe(0, hidden, None)
    draft.step(torch.tensor(prompt[:-1]))
    timer = SectionTimer(torch.device("cpu"), False)
    gen = torch.Generator().manual_seed(0)
    setup = CycleSetup(draft, TargetVerifier(target, SamplingConfig(), gen), FullPolicy(VOCAB), SamplingConfig(), gen,
                       timer, tree=TreeShape(4, 4, 24))
    accepted = 0
    for _ in range(40):
        result = run_cycle(setup, tokens, 6, 100)
        accepted += result.verdict.accepted
        tokens += result.emitted
        assert target.length == len(tokens) - 1 and draft.length <= len(tokens)
        fresh = CausalLM(target_model)
        fresh.reset()
        fresh.step(torch.tensor(tokens[:-1]))
        for mine, ref in zip(target.cache.layers, fresh.cache.layers):
            torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-4)
    assert accepted > 0


def test_a_draft_model_refuses_trees(tiny_pair):
    target_model, draft_model = tiny_pair
    with pytest.raises(DynvocabError, match="--tree needs an EAGLE head") as caught:
        speculative_generate(CausalLM(target_model), [1, 2, 3], DecodeConfig(tree="3x2x4"), set(),
                             DraftModel(draft_model), FullPolicy(VOCAB))
    assert "\n" not in str(caught.value)


def test_auto_measures_the_curve_once_and_stays_exact(setup, tmp_path, monkeypatch):
    from dynvocab.runtime.trees.curve import curve_key, curve_path, load_curve

    monkeypatch.setenv("DYNVOCAB_CACHE", str(tmp_path))
    target, draft = setup
    prompt, cfg = greedy_case(3)
    ar = speculative_generate(target, prompt, cfg, set())
    spec = speculative_generate(target, prompt, replace(cfg, tree="auto"), set(), draft, FullPolicy(VOCAB))
    assert spec.token_ids == ar.token_ids
    auto = spec.metrics.tree_auto
    assert spec.metrics.tree == "auto" and auto["why"].startswith("tree auto: grow up to 6x")
    assert auto["tree_cycles"] >= 1 and auto["chain_cycles"] >= 1  # both tried
    saved = curve_path(curve_key(target))
    assert saved.parent == tmp_path / "verify-cost" and [p.name for p in saved.parent.iterdir()] == [saved.name]
    curve, measured = load_curve(target)
    assert not measured and sorted(curve) == [1, 2, 4, 8, 16, 32, 64] and min(curve.values()) > 0


@pytest.mark.parametrize("tree", ["3x3x8", "auto"])
def test_sampled_trees_follow_the_target_distribution(setup, tree, tmp_path, monkeypatch):
    """The first two sampled tokens over many seeds, drafted as a tree over a subset whose first cycle grows three
    deep (recursive rejection sampling at the root's children, then at theirs), vs the target's p (chi-square: the
    first token, and the second after each first); siblings off the main path are accepted too, and paths two deep.
    ``auto`` goes on over the generations in one memory whose clock moves irregularly, and fixes each sampled
    cycle's depth and N before its draws: depths, N and modes vary (a head that is seldom right grows shallow)."""
    from dynvocab.runtime.selection import SelectorPolicy
    from dynvocab.runtime.selection.frequency import StaticSelector

    monkeypatch.setenv("DYNVOCAB_CACHE", str(tmp_path))  # auto's curve
    target, draft = setup
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:50]
    cfg = DecodeConfig(max_new_tokens=4, temperature=0.5, tree=tree)
    memory = TreeMemory(clock=Ticks(0))
    # the target's likeliest first token (p .3) is in the set: the draft's depth 2 decides many second tokens
    runs = first_pairs_follow_the_target(target, [3, 1, 4, 1, 5], cfg, draft,
                                         lambda: SelectorPolicy(StaticSelector(ranking)), 600, memory=memory)
    assert sum(g.metrics.off_main for g in runs) > 0
    if tree == "auto":
        autos = [g.metrics.tree_auto for g in runs]
        assert sum(a["tree_cycles"] for a in autos) > 0 and sum(a["chain_cycles"] for a in autos) > 0
        assert len({a["median_depth"] for a in autos} - {None}) > 1
        assert len({a["median_tokens"] for a in autos} - {None}) > 1
    else:
        assert sum(g.cycle_lengths[0] >= 3 for g in runs) > 0  # two drafted tokens accepted, or more


def test_sampled_trees_over_each_nodes_own_set_follow_the_target_distribution(setup):
    """As above, over a ``lowrank`` selector (random scores, 40 of the 64 ids a node): each node of a depth drafts
    from its own set (one head call over the depth's union, each node's q normalised over its own set) and recursive
    rejection sampling stays exact, at the root's children and two deep."""
    from dynvocab.artifacts.selectors import random_lowrank
    from dynvocab.runtime.selection import SelectorPolicy
    from dynvocab.runtime.selection.lowrank import lowrank_selector

    target, draft = setup
    table = random_lowrank(VOCAB, draft.info.hidden_size, torch.Generator().manual_seed(1), rank=8, candidates=40)
    selector = lowrank_selector(table, VOCAB, torch.empty(0, dtype=torch.long), "cpu", 40)
    cfg = DecodeConfig(max_new_tokens=4, temperature=0.5, tree="3x3x8", tree_sets="node")
    runs = first_pairs_follow_the_target(target, [3, 1, 4, 1, 5], cfg, draft, lambda: SelectorPolicy(selector), 600)
    assert sum(g.metrics.off_main for g in runs) > 0
    assert sum(g.cycle_lengths[0] >= 3 for g in runs) > 0


def test_auto_goes_on_from_a_memory_across_generations_and_stays_exact(setup, tmp_path, monkeypatch):
    """Greedy ``--tree auto`` over three prompts with one memory (a deterministic clock): each generation = ``ar``,
    and the later ones draft both modes without trying them afresh."""
    monkeypatch.setenv("DYNVOCAB_CACHE", str(tmp_path))
    target, draft = setup
    memory = TreeMemory(clock=Ticks(1))
    autos = []
    for seed in range(3):
        prompt, cfg = greedy_case(seed, max_new_tokens=60)
        ar = speculative_generate(target, prompt, cfg, set())
        spec = speculative_generate(target, prompt, replace(cfg, tree="auto"), set(), draft, FullPolicy(VOCAB),
                                    memory=memory)
        assert spec.token_ids == ar.token_ids
        autos.append(spec.metrics.tree_auto)
    assert list(memory.states) == [("full", True, False)]
    assert sum(a["tree_cycles"] for a in autos) > 0 and sum(a["chain_cycles"] for a in autos) > 0


def test_a_session_keeps_auto_s_memory_across_its_generations(tiny_dirs, heads, tmp_path, monkeypatch):  # noqa: F811
    """A :class:`Session` owns ``--tree auto``'s memory: its ``X@auto`` generations go on from one state, which
    holds both modes' rates (each generation = ``ar``)."""
    from dynvocab.runtime.session import ModelConfig, Session

    monkeypatch.setenv("DYNVOCAB_CACHE", str(tmp_path))
    session = Session(ModelConfig(str(tiny_dirs["target"]), str(heads["eagle"]), "cpu", "float32"))
    cfg = DecodeConfig(max_new_tokens=24)
    for prompt in ([5, 6, 7, 8, 9], [9, 10, 11]):
        ar = session.generate(prompt, "ar", cfg)
        assert session.generate(prompt, "full@auto", cfg).token_ids == ar.token_ids
    state = session.tree_memory.state(("full", True, False))
    assert list(session.tree_memory.states) == [("full", True, False)] and set(state.totals) == {"tree", "chain"}


@pytest.mark.parametrize(("tree", "sets"), [("3x3x8", "depth"), ("3x3x8", "node"), ("auto", "node")])
def test_every_strategy_drafts_trees_equal_to_ar(target_model, tmp_path, monkeypatch, tree, sets):
    """Every registered strategy (each over a tiny bundle with every stage), an EAGLE-1 head, greedy, each depth's
    nodes over one set or each over its own: = ar."""
    from test_host_reads import OPTIONS, PROMPT, tiny_bundle
    from dynvocab.runtime.strategies import PolicyContext, make_policy, strategy_names

    monkeypatch.setenv("DYNVOCAB_CACHE", str(tmp_path))
    target = CausalLM(target_model)
    draft = Eagle1Draft(eagle1(target_model), target)
    bundle = tiny_bundle(tmp_path / "tiny.safetensors", target, _IndexRows(draft))
    ctx = PolicyContext(VOCAB, {VOCAB - 1}, "cpu", bundle, draft.info, target)
    cfg = DecodeConfig(max_new_tokens=16, tree=tree, tree_sets=sets)
    ar = speculative_generate(target, PROMPT, cfg, set())
    for name in strategy_names():
        if name == "ar":
            continue
        spec = speculative_generate(target, PROMPT, cfg, set(), draft, make_policy(name, OPTIONS, ctx))
        assert spec.token_ids == ar.token_ids, name
        assert spec.metrics.tree_cycles > 0 or tree == "auto", name


def test_hybrids_tree_nodes_each_search_their_own_candidates(target_model, tmp_path, monkeypatch):
    """With its per-step search on, the hybrid gives each node of a depth the set it gives that node alone: the window,
    the core prefix and the node's own draft-head neighbours and graph successors."""
    from test_host_reads import OPTIONS, tiny_bundle
    from dynvocab.runtime.strategies import PolicyContext, make_policy

    monkeypatch.setenv("DYNVOCAB_CACHE", str(tmp_path))
    target = CausalLM(target_model)
    draft = Eagle1Draft(eagle1(target_model), target)
    bundle = tiny_bundle(tmp_path / "tiny.safetensors", target, _IndexRows(draft))
    policy = make_policy("hybrid", OPTIONS, PolicyContext(VOCAB, {VOCAB - 1}, "cpu", bundle, draft.info, target))
    policy.prefill(torch.tensor([3, 1, 4, 1, 5]), None, None)
    g = torch.Generator().manual_seed(0)
    hidden, tokens = torch.randn(4, draft.info.hidden_size, generator=g), torch.randint(0, VOCAB, (4,), generator=g)
    nodes = policy.node_sets(2, hidden, tokens)
    ids = nodes.active.ids()
    assert ids.unique().numel() == ids.numel()
    for r in range(4):
        alone = policy.active_ids(2, hidden[r : r + 1], tokens[r : r + 1])
        assert sorted(ids[nodes.own[r]].tolist()) == sorted(alone.ids().tolist())
    assert not nodes.own.all()  # the nodes' searches found different candidates


class _IndexRows:
    """What ``tiny_bundle`` reads of a draft: its hidden size and the rows a draft HNSW index covers (here the
    target's head rows, which an EAGLE-1 head predicts through)."""

    def __init__(self, draft):
        self.hidden_size = draft.info.hidden_size
        self.info = type("Info", (), {"index_rows": draft.step_rows[0]})()
