"""``--tree auto``'s decisions without models, on a deterministic clock: both modes tried, then the faster drafted
and the other looked at again in every generation of a run (counted across them, in a :class:`TreeMemory`), rates
that age so a mode left behind can win the lead back, a switch only past the hysteresis margin, sampled cycles whose
depth and N are fixed before their draws, and the clock of a CUDA target."""

from __future__ import annotations

import functools
import math
import time

import pytest
import torch

from dynvocab.runtime.trees.budget import TreeBudget
from dynvocab.runtime.trees.growth import Candidates
from dynvocab.runtime.trees.mode import EXPLORE, EXPLORE_MAX, HALF_LIFE, SWITCH, AutoState, TreeMemory, clock_for
from dynvocab.runtime.trees.shape import TreeShape

CURVE = {1: 1.0, 16: 1.2}  # 16 drafted tokens cost 1.2 one-token passes
KEY = ("full", True, False)


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cycle(budget: TreeBudget, clock: Clock, tree_tokens: int, chain_tokens: int) -> bool:
    """One cycle of the mode ``budget`` wants, one second long, emitting ``tree_tokens`` or ``chain_tokens``;
    whether it drafted a tree."""
    tree = budget.wants_tree()
    budget.start()
    clock.now += 1.0
    emitted = tree_tokens if tree else chain_tokens
    budget.finish(tree, emitted, emitted - 1)
    return tree


def generations(memory: TreeMemory, count: int, cycles: int, tree_tokens: int, chain_tokens: int) -> list[TreeBudget]:
    """``count`` generations of ``cycles`` cycles each, every one's budget going on from ``memory``."""
    budgets = []
    for _ in range(count):
        budget = TreeBudget(CURVE, state=memory.state(KEY), clock=memory.clock)
        for _ in range(cycles):
            cycle(budget, memory.clock, tree_tokens, chain_tokens)
        budgets.append(budget)
    return budgets


def test_auto_tries_both_then_drafts_the_faster_and_looks_back_less_and_less():
    clock = Clock()
    budget = TreeBudget(CURVE, clock=clock)
    picks = [cycle(budget, clock, 4, 1) for _ in range(4 * EXPLORE)]
    assert picks[:2] == [True, False]  # the tree, then the chain, each tried once
    assert picks.count(False) == 3 and picks.index(False, 2) == 9  # then the chain after 8 cycles, 16 more, …
    assert budget.state.tree_mode and budget.state.explore_every == 4 * EXPLORE
    assert budget.shape.topk == 4  # 16 tokens cost 1.2 passes: flat enough for 4 children a node


@pytest.mark.parametrize("tree_tokens, chain_tokens", [(4, 2), (2, 4)])
def test_the_other_mode_is_looked_at_in_every_generation(tree_tokens, chain_tokens):
    """Three generations of 40 cycles: each drafts the faster mode and looks at the other at least once (the cycles
    between looks run on across generations, at most EXPLORE_MAX), none tries both modes afresh."""
    memory = TreeMemory(clock=Clock())
    budgets = generations(memory, 3, 40, tree_tokens, chain_tokens)
    tree_leads = tree_tokens > chain_tokens
    for budget in budgets:
        ahead, behind = (budget.trees, budget.chains) if tree_leads else (budget.chains, budget.trees)
        assert 1 <= behind <= 3 and ahead == 40 - behind
    assert memory.state(KEY).tree_mode == tree_leads and memory.state(KEY).explore_every == EXPLORE_MAX
    assert list(memory.states) == [KEY]


def test_a_rate_ages_with_its_half_life():
    """After HALF_LIFE cycles at a new rate, a long-steady mode's rate is halfway between its old one and the new."""
    clock = Clock()
    budget = TreeBudget(CURVE, clock=clock)
    for tokens in [1] * 200 + [3] * HALF_LIFE:
        budget.start()
        clock.now += 1.0
        budget.finish(False, tokens, tokens - 1)
    assert budget.rate("chain") == pytest.approx(2.0)


def test_a_mode_left_behind_wins_the_lead_back_when_it_is_faster_again():
    """Trees run slower than the chain for a generation, then twice as fast: the looks at them in the following
    generations bring their aged rate up and auto switches to them, at the second look."""
    memory = TreeMemory(clock=Clock())
    first = generations(memory, 1, 40, 1, 2)[0]
    assert not memory.state(KEY).tree_mode and first.trees == 3  # tried, then looked at after 8 and 16 cycles
    later = generations(memory, 3, 40, 4, 2)
    assert later[0].trees == 1 and later[0].chains == 39  # one look: the aged rate not yet 3% ahead
    assert memory.state(KEY).tree_mode and later[1].trees > later[1].chains  # the second look switched
    assert later[2].trees >= 38 and later[2].chains >= 1  # trees, the chain looked at


@pytest.mark.parametrize("tree_mode, tree_rate, chain_rate, switches", [
    (False, 1.029, 1.0, False), (False, 1.031, 1.0, True),  # from the chain: trees must be 3% faster
    (True, 1.0, 1.029, False), (True, 1.0, 1.031, True),  # and back
    (True, 0.99, 1.0, False),  # a near tie keeps the mode drafted, whichever is ahead
])
def test_a_switch_needs_the_other_mode_ahead_by_the_margin(tree_mode, tree_rate, chain_rate, switches):
    """Hysteresis: after a cycle of the current mode at its own rate, the mode switches only where the other's rate
    beats it by SWITCH; a switch resets the looks at the one left behind."""
    clock = Clock()
    state = AutoState(totals={"tree": (tree_rate, 1.0), "chain": (chain_rate, 1.0)}, tree_mode=tree_mode,
                      explore_every=4 * EXPLORE, since_look=3)
    budget = TreeBudget(CURVE, state=state, clock=clock)
    budget.start()
    clock.now += 1.0
    budget.finish(tree_mode, tree_rate if tree_mode else chain_rate, 0)
    assert SWITCH == pytest.approx(1.03)
    assert state.tree_mode == (tree_mode != switches)
    assert (state.explore_every, state.since_look) == ((EXPLORE, 0) if switches else (4 * EXPLORE, 3))


class Ticks:
    """A clock that moves on by a different amount at each read: growth times that vary from cycle to cycle."""

    def __init__(self, seed: int):
        self.gen, self.now = torch.Generator().manual_seed(seed), 0.0

    def __call__(self) -> float:
        self.now += float(torch.rand(1, generator=self.gen))
        return self.now


@pytest.mark.parametrize("depth_s, depth", [(None, 6), (0.01, 6), (5.0, 1)])
def test_a_sampled_cycle_fixes_its_depth_and_tokens_before_its_draws(depth_s, depth):
    """Sampling: ``plan`` fixes the cycle's depth and N from the state as earlier cycles left it (a depth that costs
    more than it adds is not grown); the growth then goes that deep, whatever its frontier and however long it
    takes, and verifies that N. Two budgets of equal states plan alike, whatever their clocks read."""
    shape = TreeShape(6, 4, 40)
    plans = []
    for seed in range(2):
        state = AutoState(depth_s=depth_s, cycle_s=None if depth_s is None else 2.0, per_cycle=2.0)
        budget = TreeBudget(CURVE, greedy=False, state=state, clock=Ticks(seed))
        budget.start()
        plan = budget.plan(shape)
        assert plan.topk == 4 and plan.depth == depth and 1 <= plan.tokens <= min(40, plan.candidates)
        frontier = torch.full((4,), -math.inf)  # a frontier the draws made hopeless: the depth is grown anyway
        assert all(budget.keep_growing(frontier) for _ in range(plan.depth - 1))
        assert budget.tokens(None) == plan.tokens and budget.depths == [plan.depth]
        plans.append(plan)
    assert plans[0] == plans[1]


def test_greedy_cycles_keep_the_shape_and_stop_where_a_depth_does_not_pay():
    """Greedy: ``plan`` leaves the shape as it is; growth stops where the frontier's calibrated mass adds tokens
    more slowly than tree cycles make them, from this cycle's own scores and times."""
    clock = Clock()
    state = AutoState(depth_s=1.0, cycle_s=2.0, per_cycle=2.0)
    budget = TreeBudget(CURVE, state=state, clock=clock)
    budget.start()
    assert budget.plan(TreeShape(6, 4, 40)) == TreeShape(6, 4, 40)
    clock.now += 1.0
    assert budget.keep_growing(torch.tensor([0.5, 0.5, 0.3, 0.2]).log())  # mass 1.5 in 1 s of a 2-s cycle: pays
    clock.now += 1.0
    assert not budget.keep_growing(torch.tensor([0.1] * 4).log())  # mass 0.4, where cycles make 2 tokens: stops
    assert budget.tokens(Candidates(4, [1, 2], [-1, -1], [-0.1, -3.0], [])) in (1, 2) and budget.depths == [2]


def test_the_clock_waits_for_a_cuda_device():
    """On a CUDA target auto's marks are read after a synchronize (its launches are not waited for otherwise); on
    a CPU, plain ``perf_counter``."""
    assert clock_for("cpu") is time.perf_counter
    cuda = clock_for("cuda:0")
    assert isinstance(cuda, functools.partial) and cuda.args == (torch.device("cuda", 0),)
    assert cuda.func.__name__ == "_synced_clock"
