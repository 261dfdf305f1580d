"""EAGLE-2 draft trees (``--tree``): the shape's refusals, growth against a hand-worked example, the draft's tree
attention against plain chains, greedy = ``ar`` for every strategy and both head layouts, exact recursive
rejection sampling (a sibling accepted too), and the caches after a cycle holding exactly the accepted path."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from test_eagle_loop import eagle1, setup, target_model  # noqa: F401  (fixtures: the target, both head layouts)
from sampling_checks import first_tokens_follow_the_target
from test_loop import VOCAB, greedy_case, make_policy
from dynvocab.errors import DynvocabError
from dynvocab.runtime.cycle import CycleSetup, TargetVerifier, run_cycle
from dynvocab.runtime.draft import DraftInfo
from dynvocab.runtime.draft_model import DraftModel
from dynvocab.runtime.eagle_draft import Eagle1Draft
from dynvocab.runtime.lm import CausalLM
from dynvocab.runtime.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.policies import FullPolicy
from dynvocab.runtime.timing import SectionTimer
from dynvocab.runtime.tree import TokenTree
from dynvocab.runtime.tree_draft import Candidates, grow_tree, tree_of
from dynvocab.runtime.tree_shape import TreeShape, parse_tree, split_tree
from dynvocab.runtime.verify import SamplingConfig, verify_token_tree

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
    assert tree.tokens == (-1, 1, 2, 3, 5) and tree.parents == (-1, 0, 0, 1, 2)
    assert tree.depths == (0, 1, 1, 2, 2) and tree.main == (1, 3)
    assert tree.positions(7, "cpu").tolist() == [[7, 8, 8, 9, 9]]
    seen = tree.attention_mask(0, torch.float32, "cpu")[0, 0] == 0
    assert seen.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]
    five = tree_of(grown, cands, 5).tree  # then 1->4 (.24), before 1->3->4 (.21); the pass keeps growth order
    assert five.tokens == (-1, 1, 2, 3, 4, 5) and five.parents == (-1, 0, 0, 1, 1, 2)


def test_choose_keeps_parents_and_earlier_siblings():
    cands = Candidates(2, [1, 2, 3, 4], [-1, -1, 0, 0], [-1.0, -3.0, -1.5, -1.2], [[0, 1]])
    assert cands.choose(2) == [0]  # the second best (3) is the child of rank 1 whose rank-0 sibling (2) is out
    assert cands.choose(3) == [0, 2, 3]


def test_greedy_walk_accepts_a_sibling():
    tree = TokenTree((-1, 0, 0, 1, 2), (-1, 5, 6, 7, 8), main=(1, 3))
    logits = torch.zeros(5, 10)
    logits[0, 6] = logits[2, 8] = logits[4, 9] = 5.0  # the target takes 6 (the second child), then 8, then 9
    verdict = verify_token_tree(tree, logits, SamplingConfig(), torch.Generator())
    assert verdict.path == [6, 8] and verdict.next_token == 9 and verdict.rows == [0, 2, 4]
    assert verdict.chain == [5, 7]  # the main path, read back with the verdict


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
        tree = TokenTree((-1, 0, 0), (-1, a, b), main=(1,))
        verdict = verify_token_tree(tree, torch.stack([p_logits] * 3), cfg, gen, lambda row: (q, None))
        first = verdict.path[0] if verdict.path else verdict.next_token
        counts[first] += 1
        second += verdict.rows[1:2] == [2]
    expected = torch.softmax(p_logits, 0) * draws  # every bin well above 5
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < 20.5, (stat, counts)  # 5 degrees of freedom: p ≈ 0.001
    assert second > draws // 20


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
    from dynvocab.runtime.tree_budget import curve_key, curve_path, load_curve

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


def test_auto_drafts_the_faster_mode_and_retries_the_other():
    from dynvocab.runtime.tree_budget import EXPLORE, TreeBudget

    budget = TreeBudget({1: 1.0, 16: 1.2})
    picks = []
    for cycle in range(3 * EXPLORE):
        tree = budget.wants_tree()
        picks.append(tree)
        budget._marks = [0.0]  # a cycle of ~now seconds: the tree makes 4 tokens, the chain 1
        budget.finish(tree, 4 if tree else 1, 3 if tree else 0)
    assert picks[:2] == [True, False]  # each tried once
    assert picks.count(False) <= 3  # then the chain only to re-check it, less and less often
    assert budget.explore_every > EXPLORE
    assert budget.shape.topk == 4  # 16 tokens cost 1.2 passes: flat enough for 4 children a node


def test_sampled_trees_follow_the_target_distribution(setup):
    """First sampled token over many seeds, drafted as a tree over a subset (recursive rejection sampling over the
    root's children), vs the target's p (chi-square); siblings off the main path are accepted too."""
    from dynvocab.runtime.policies import FrequencyPolicy

    target, draft = setup
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:50]
    cfg = DecodeConfig(max_new_tokens=2, temperature=1.5, tree="3x3x8")
    runs = first_tokens_follow_the_target(target, [5, 9, 13], cfg, draft, lambda: FrequencyPolicy(ranking))
    assert sum(g.metrics.off_main for g in runs) > 0


@pytest.mark.parametrize("tree", ["3x3x8", "auto"])
def test_every_strategy_drafts_trees_equal_to_ar(target_model, tmp_path, monkeypatch, tree):
    """Every registered strategy (each over a tiny bundle with every stage), an EAGLE-1 head, greedy: = ar."""
    from test_host_reads import OPTIONS, PROMPT, tiny_bundle
    from dynvocab.runtime.strategies import PolicyContext, make_policy, strategy_names

    monkeypatch.setenv("DYNVOCAB_CACHE", str(tmp_path))
    target = CausalLM(target_model)
    draft = Eagle1Draft(eagle1(target_model), target)
    bundle = tiny_bundle(tmp_path / "tiny.safetensors", target, _IndexRows(draft))
    ctx = PolicyContext(VOCAB, {VOCAB - 1}, "cpu", bundle, draft.info, target)
    cfg = DecodeConfig(max_new_tokens=16, tree=tree)
    ar = speculative_generate(target, PROMPT, cfg, set())
    for name in strategy_names():
        if name == "ar":
            continue
        spec = speculative_generate(target, PROMPT, cfg, set(), draft, make_policy(name, OPTIONS, ctx))
        assert spec.token_ids == ar.token_ids, name
        assert spec.metrics.tree_cycles > 0 or tree == "auto", name


class _IndexRows:
    """What ``tiny_bundle`` reads of a draft: its hidden size and the rows a draft HNSW index covers (here the
    target's head rows, which an EAGLE-1 head predicts through)."""

    def __init__(self, draft):
        self.hidden_size = draft.info.hidden_size
        self.info = type("Info", (), {"index_rows": draft.step_rows[0]})()
