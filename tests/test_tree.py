"""The draft tree: leaf verification, tree attention against plain chains, cache rollback onto a leaf, and the
loop staying lossless while leaves and early stops change its cycles."""

from __future__ import annotations

import pytest
import torch

from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.selection import FullPolicy
from dynvocab.runtime.trees.tree import DraftTree
from dynvocab.runtime.trees.verify import verify_greedy

VOCAB = 96


def onehot(choices: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


def test_leaf_at_the_stopping_depth_is_accepted_with_its_own_next_token():
    tree = DraftTree.of_chain([1, 2, 3], {1: 5, 2: 6})  # inputs: root, 1, 2, 3, leaf 5 (depth 1), leaf 6 (depth 2)
    assert tree.parents == (-1, 0, 1, 2, 1, 2) and tree.main == (1, 2, 3) and not tree.is_path
    # The target takes 1, then 5 (not 2): the leaf at depth 1 is accepted; its row (index 4) says 7 comes next.
    verdict = verify_greedy(tree, onehot([1, 5, 0, 0, 7, 0]))
    assert verdict.path == [1, 5] and verdict.next_token == 7
    assert verdict.on_main == 1 and verdict.path_rows == (1, 4) and verdict.rows == [0, 1, 4]


def test_leaf_elsewhere_or_wrong_is_not_accepted():
    tree = DraftTree.of_chain([1, 2, 3], {2: 6})
    assert verify_greedy(tree, onehot([1, 4, 0, 0, 6])).path == [1]  # stopped at depth 1: no leaf there
    verdict = verify_greedy(tree, onehot([1, 2, 4, 0, 6]))  # stopped at depth 2, target wants 4, leaf is 6
    assert verdict.path == [1, 2] and verdict.next_token == 4 and verdict.on_main == 2
    full = verify_greedy(tree, onehot([1, 2, 3, 0, 6]))  # the whole chain: bonus from row 3
    assert full.path == [1, 2, 3] and full.next_token == 0


def test_tree_mask_and_positions():
    tree = DraftTree.of_chain([10, 11, 12], {0: 20, 2: 22})
    assert DraftTree.of_chain([10, 11, 12]).is_path
    assert tree.inputs(torch.tensor([9])).tolist() == [9, 10, 11, 12, 20, 22]
    assert tree.positions(5, "cpu").tolist() == [[5, 6, 7, 8, 6, 8]]
    allowed = tree.attention_mask(2, torch.float32, "cpu")[0, 0] == 0
    assert allowed[:, :2].all()  # the cached prefix is visible to every row
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 0, 0, 0, 1, 0],  # leaf at depth 0: the root and itself
            [1, 1, 1, 0, 0, 1],  # leaf at depth 2: the root, chain[:2] and itself
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed[:, 2:], expected)


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair
    return CausalLM(target), DraftModel(draft)


def test_tree_pass_equals_chain_passes_and_rollback_keeps_the_leaf(pair):
    target, _ = pair
    prompt = torch.tensor([3, 14, 15, 92, 65])
    chain, leaf = [35, 89, 79], 32  # leaf at depth 1: an alternative to 89 after 35
    tree = DraftTree.of_chain(chain, {1: leaf})

    target.reset()
    target.step(prompt[:-1])
    hidden = target.step(tree.inputs(prompt[-1:]), tree)  # [5, d]

    target.reset()
    reference = target.step(torch.cat([prompt, torch.tensor(chain)]))
    torch.testing.assert_close(hidden[:4], reference[4:8])  # the root and the chain
    target.reset()
    via_leaf = target.step(torch.cat([prompt, torch.tensor([chain[0], leaf])]))
    torch.testing.assert_close(hidden[4], via_leaf[-1])

    # Accept chain[:1] + leaf: keep the prefix, the root and chain[0], then the leaf's cache entry.
    target.reset()
    target.step(prompt[:-1])
    target.step(tree.inputs(prompt[-1:]), tree)
    start = prompt.numel() - 1
    target.rollback(prompt.numel() + 1, keep=[start + 4])  # the leaf's row: after the root and the chain
    assert target.length == prompt.numel() + 2
    after = target.step(torch.tensor([7]))
    target.reset()
    fresh = target.step(torch.cat([prompt, torch.tensor([chain[0], leaf, 7])]))
    torch.testing.assert_close(after[-1], fresh[-1])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("stop_below, branch_below", [(0.0, 1.0), (0.5, 1.0), (0.9, 0.0)])
def test_leaves_and_early_stops_stay_lossless(pair, seed, stop_below, branch_below):
    target, draft = pair
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
    cfg = DecodeConfig(gamma=5, max_new_tokens=30, stop_below=stop_below, branch_below=branch_below)
    ar = speculative_generate(target, prompt, cfg, set())
    spec = speculative_generate(target, prompt, cfg, set(), draft, FullPolicy(draft.vocab_size))
    assert spec.token_ids == ar.token_ids
    if branch_below >= 1.0:
        assert spec.metrics.leaves == spec.metrics.draft_steps  # a runner-up at every step
    else:
        assert spec.metrics.leaves == 0


def test_leaves_are_hit_and_early_stops_shorten_drafts(pair):
    target, draft = pair
    hits = steps_stop = steps_full = 0
    for seed in range(8):
        prompt = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(seed)).tolist()

        def run(**kw):
            cfg = DecodeConfig(gamma=5, max_new_tokens=30, **kw)
            return speculative_generate(target, prompt, cfg, set(), draft, FullPolicy(draft.vocab_size))

        tree = run(stop_below=0.0, branch_below=1.0)
        chain = run(stop_below=0.0, branch_below=0.0)
        hits += tree.metrics.leaf_hits
        steps_full += chain.metrics.draft_steps / chain.metrics.cycles
        stopped = run(stop_below=0.9, branch_below=0.0)
        steps_stop += stopped.metrics.draft_steps / stopped.metrics.cycles
    assert hits > 0
    assert steps_stop < steps_full


class Recorder(FullPolicy):
    """The full vocabulary, keeping every cycle report."""

    def __init__(self, vocab_size: int):
        super().__init__(vocab_size)
        self.reports = []

    def observe(self, cycle):
        self.reports.append(cycle)


def test_policies_see_the_accepted_path_rows_when_a_leaf_is_accepted(pair):
    target, draft = pair
    hits = 0
    for seed in range(6):
        prompt = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        policy = Recorder(draft.vocab_size)
        cfg = DecodeConfig(gamma=4, max_new_tokens=30, stop_below=0.0, branch_below=1.0)
        run = speculative_generate(target, prompt, cfg, set(), draft, policy)
        hits += run.metrics.leaf_hits
        for report in policy.reports:
            k = report.accepted
            assert report.target_logits.shape[0] == len(report.draft_tokens) + 1 == report.target_hidden.shape[0]
            assert report.draft_tokens[:k] == report.emitted[:k]
            # Rows 0..k lie on the accepted path: row i is the target's choice for emitted token i.
            assert report.target_logits[: k + 1].argmax(-1).tolist() == report.emitted[: k + 1]
    assert hits > 0  # some of those reports had a leaf in their path
