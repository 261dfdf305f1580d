"""The loop's device→host reads, counted on CPU for every registered strategy, greedy and sampled: every read goes
through :func:`dynvocab.runtime.host.to_host` (or ``to_host_tensor``, for the host's HNSW searches and kept tables),
with no ``int()``/``float()``/``.item()``/``.tolist()``/``bool()``/``.cpu()`` of a tensor anywhere else in dynvocab
while a generation runs (on a GPU each would be a wait; ``.cpu()`` is counted on the CPU too), and the drafted tokens
stay on the device: the loop reads once per cycle (the verdict, with the drafted tokens) and once per draft step
only where early stops or runner-up leaves need the step's confidence.

Before (run_cycle's first form): 1 read per draft step whatever the settings (the token, the runner-up and the
confidence), stray ``.tolist()`` per step for dynaspec and centroids, stray ``int()`` per step for the hybrid's graph
successors. Per strategy, before and after: docs/measurements/2026-11-26-host-reads-cpu.md; on CUDA:
docs/measurements/2026-11-26-gpu-loop-device-tokens.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dynvocab.artifacts import ModelFingerprint, Stage, load_bundle, write_bundle
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.host import PACKAGE, HostReads, host_reads
from dynvocab.runtime.selection import FullPolicy
from dynvocab.runtime.selection.evospec.evospec import EvoSpecConfig
from dynvocab.runtime.selection.context.hybrid import HybridConfig
from dynvocab.runtime.selection.context.window import MicroSpecConfig
from dynvocab.runtime.strategies import PolicyContext, StrategyOptions, make_policy, strategy_names

VOCAB = 96
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
CONFIGS = {
    "greedy-ranked": DecodeConfig(max_new_tokens=16),  # the defaults: early stops and runner-up leaves
    "greedy": DecodeConfig(max_new_tokens=16, stop_below=0.0, branch_below=0.0),
    "sampling-ranked": DecodeConfig(max_new_tokens=16, temperature=0.9, seed=3),
    "sampling": DecodeConfig(max_new_tokens=16, temperature=0.9, seed=3, stop_below=0.0),
}
LOOP = {"read_confidence", "verify_greedy", "verify_sampled", "finish"}  # finish: the tally's hits, once
HEAD = {"_counts"}  # the packed head's slot counts, where a changed segment replaces some of its rows
MAPPED = {"build", "mapped_order"}  # EAGLE-3's head mapping an order, prefix or ranges it has not kept
POLICY_READS = {  # where a strategy reads the device itself, through to_host, and why
    "dynaspec": {"_ranges"},  # the routed clusters' row ranges, per step
    "centroids": {"_ranges"},  # the picked blocks' row ranges, per step
    "microspec": {"push"},  # the cycle's stream entries, per cycle: the request window is kept on the host
    "hybrid": {"seen", "contains", "__call__", "push"},  # a missed token and its neighbours, and the stream entries,
    # per cycle; the hidden state for the per-step search, per step (which the hybrid turns off on CUDA)
    "evospec": {"contains", "observe", "semantic", "prefill"},  # OOV events, per cycle; the prompt, once
}
OPTIONS = StrategyOptions(configs=(
    EvoSpecConfig(static_size=40, dynamic_size=16, synchronous=True),
    HybridConfig(core_size=24, window=24, step_neighbours=4, step_successors=4),  # the per-step search runs
    MicroSpecConfig(window=24),
))


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair
    return CausalLM(target), DraftModel(draft, one_token_steps=True)  # the draft steps as a session runs it


def tiny_bundle(path: Path, target: CausalLM, draft: DraftModel):
    """Every stage a built-in strategy reads, small and random: freq, clusters + router, hnsw (target head),
    draft_hnsw (draft head), graph, lowrank, centroids."""
    from dynvocab.artifacts.bundle import tensor_sha256
    from dynvocab.artifacts.router import RouterMLP, RouterTable
    from dynvocab.artifacts.selectors import random_selectors
    from dynvocab.builders.hnsw import HnswConfig, build

    g = torch.Generator().manual_seed(0)
    dim, clusters, fanout = draft.hidden_size, 12, 6
    ranking = torch.randperm(VOCAB, generator=g)
    counts = torch.empty(VOCAB, dtype=torch.long)
    counts[ranking] = torch.arange(VOCAB, 0, -1)
    assign = torch.randint(clusters, (VOCAB,), generator=g)
    torch.manual_seed(0)
    router = RouterTable.from_module(RouterMLP(dim, dim, 16, clusters), {"clusters_sha256": tensor_sha256(assign)})
    hnsw_cfg = HnswConfig(m=8, ef_construction=32)
    hnsw, params, _ = build(hnsw_cfg, target.weight.detach().float())
    draft_hnsw, draft_params, _ = build(hnsw_cfg, draft.info.index_rows.float())
    low, cen = random_selectors(VOCAB, dim, g, rank=8, candidates=24, block=8, blocks=3)
    centroids = torch.nn.functional.normalize(torch.randn(clusters, dim, generator=g), dim=-1)
    stages = [
        Stage("freq", {"counts": counts, "ranking": ranking, "eos_ids": torch.tensor([VOCAB - 1])}, {}),
        Stage("clusters", {"assign": assign, "centroids": centroids}, {}),
        Stage("router", router.to_tensors(), router.config),
        Stage("hnsw", hnsw, hnsw_cfg.as_dict(), {"index": params.as_dict(), "model": "target"}),
        Stage("draft_hnsw", draft_hnsw, hnsw_cfg.as_dict(), {"index": draft_params.as_dict(), "model": "draft"}),
        Stage("graph", {
            "indptr": torch.arange(0, (VOCAB + 1) * fanout, fanout, dtype=torch.long),
            "indices": torch.randint(VOCAB, (VOCAB * fanout,), generator=g, dtype=torch.int32),
            "probs": torch.full((VOCAB * fanout,), 1.0 / fanout),
        }, {}),
        *(Stage(t.kind, t.tensors, t.config) for t in (low, cen)),
    ]
    fingerprint = ModelFingerprint(VOCAB, "synthetic", VOCAB, dim, "synthetic")
    return load_bundle(write_bundle(path, stages, fingerprint, None))


@pytest.fixture(scope="module")
def ctx(pair, tmp_path_factory):
    target, draft = pair
    bundle = tiny_bundle(tmp_path_factory.mktemp("reads") / "tiny.safetensors", target, draft)
    return PolicyContext(VOCAB, {VOCAB - 1}, "cpu", bundle, draft.info, target)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", strategy_names())
def test_every_strategy_reads_through_to_host_and_drafts_on_the_device(pair, ctx, name, config):
    target, draft = pair
    cfg = CONFIGS[config]
    draft = None if name == "ar" else draft
    expected = speculative_generate(target, PROMPT, cfg, set(), draft, make_policy(name, OPTIONS, ctx))
    policy = make_policy(name, OPTIONS, ctx)  # built outside the count: loading a bundle's index is no decoding
    with HostReads() as reads:
        g = speculative_generate(target, PROMPT, cfg, set(), draft, policy)
    m = g.metrics
    assert g.token_ids == expected.token_ids  # counting changed nothing
    assert not reads.elsewhere, dict(reads.elsewhere)
    ranked = cfg.stop_below > 0 or (cfg.temperature == 0 and cfg.branch_below > 0)
    assert reads.helper["read_confidence"] == (m.draft_steps if ranked else 0)  # the step's one read, if any
    assert reads.helper["verify_greedy"] + reads.helper["verify_sampled"] == m.cycles  # with the tokens
    assert reads.helper["finish"] <= 1
    assert set(reads.helper) - LOOP - HEAD <= POLICY_READS.get(name, set()), dict(reads.helper)
    if name != "ar":
        assert m.draft_steps > 0 and m.cycles > 1


def test_autoregressive_decoding_reads_once_per_token(pair):
    target, _ = pair
    with HostReads() as reads:
        g = speculative_generate(target, [3, 1, 4], DecodeConfig(max_new_tokens=12), set())
    assert not reads.elsewhere, dict(reads.elsewhere)
    assert reads.helper == {"verify_greedy": 12} and len(g.token_ids) == 12


def eagle_pair(kind: str):
    """(target, EAGLE head of ``kind``, the EAGLE-3 head's layer tap or None) on a tiny random target."""
    from conftest import tiny_qwen2
    from test_eagle_loop import LAYERS, eagle1, eagle3
    from dynvocab.models.eagle import LayerTap
    from dynvocab.runtime.drafts.eagle_draft import Eagle1Draft, Eagle3Draft

    model = tiny_qwen2(layers=LAYERS, seed=0)
    target = CausalLM(model)
    if kind == "eagle1":
        return target, Eagle1Draft(eagle1(model), target), None
    head = eagle3(model)
    tap = LayerTap(model, head.config.target_layers(LAYERS))
    return target, Eagle3Draft(head, target, tap), tap


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_eagle_heads_draft_on_the_device(kind):
    target, draft, tap = eagle_pair(kind)
    cfg = CONFIGS["greedy"]
    try:
        with HostReads() as reads:
            g = speculative_generate(target, PROMPT, cfg, set(), draft, FullPolicy(VOCAB))
    finally:
        if tap is not None:
            tap.remove()
    assert g.token_ids == speculative_generate(target, PROMPT, cfg, set()).token_ids
    assert not reads.elsewhere, dict(reads.elsewhere)
    assert reads.helper == {"verify_greedy": g.metrics.cycles}  # none per draft step


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("policy", ["full", "microspec"])
def test_eagle_trees_read_nothing_while_they_grow(kind, policy):
    """A tree cycle reads the device twice: once after its growth (the candidates, to choose the pass's nodes) and
    once for the greedy verdict; nothing inside the draft loop."""
    from dynvocab.runtime.selection.context.window import MicroSpecPolicy

    target, draft, tap = eagle_pair(kind)
    cfg = DecodeConfig(max_new_tokens=16, tree="3x3x8")
    made = {"full": lambda: FullPolicy(VOCAB), "microspec": lambda: MicroSpecPolicy(MicroSpecConfig(window=24), VOCAB, "cpu")}
    try:
        with HostReads() as reads:
            g = speculative_generate(target, PROMPT, cfg, set(), draft, made[policy]())
    finally:
        if tap is not None:
            tap.remove()
    assert g.token_ids == speculative_generate(target, PROMPT, cfg, set()).token_ids
    assert not reads.elsewhere, dict(reads.elsewhere)
    trees = g.metrics.tree_cycles
    assert reads.helper["finish"] <= 1  # the tally's hit count, once a generation
    loop = {helper: n for helper, n in reads.helper.items() if helper not in HEAD | MAPPED | {"finish"}}
    expected = {"grow_tree": trees, "verify_greedy": g.metrics.cycles}
    if policy == "microspec":  # the stream's entries, at prefill and after each cycle, into the host's window
        expected["push"] = g.metrics.cycles + 1
    assert loop == {helper: n for helper, n in expected.items() if n}


def test_policies_get_the_fed_token_on_the_device_and_the_counter_sees_a_stray_read(pair):
    """The check can fail: a policy that reads the token with ``int()`` on its step is caught."""
    target, draft = pair
    seen = []

    class Reading(FullPolicy):
        def active_ids(self, step, hidden=None, token=None):
            seen.append((type(token), tuple(token.shape), token.device))
            int(token)
            return super().active_ids(step, hidden, token)

    with HostReads(roots=(PACKAGE, __file__)) as reads:
        g = speculative_generate(target, [3, 1, 4], DecodeConfig(gamma=2, max_new_tokens=6), set(), draft,
                                 Reading(draft.vocab_size))
    assert set(seen) == {(torch.Tensor, (1,), draft.device)}
    (where, count), = reads.elsewhere.items()
    assert where.startswith(f"{Path(__file__).name}:") and where.endswith("__int__")
    assert count == g.metrics.draft_steps


def test_a_stray_cpu_copy_is_caught_on_the_cpu_too(pair):
    """``.cpu()`` of a CPU tensor copies nothing, yet the counter charges it: on a GPU it would be a wait."""
    target, draft = pair

    class Copying(FullPolicy):
        def active_ids(self, step, hidden=None, token=None):
            token.cpu()
            return super().active_ids(step, hidden, token)

    with HostReads(roots=(PACKAGE, __file__)) as reads:
        g = speculative_generate(target, [3, 1, 4], DecodeConfig(gamma=2, max_new_tokens=6), set(), draft,
                                 Copying(draft.vocab_size))
    (where, count), = reads.elsewhere.items()
    assert where.startswith(f"{Path(__file__).name}:") and where.endswith(" cpu")
    assert count == g.metrics.draft_steps


def test_host_reads_are_recorded_where_they_happen():
    """The watch-everything spy (the CUDA-graph step's): a read is charged to its caller, not to torch."""
    x = torch.ones(2)
    with host_reads() as reads:
        (x * 2).sum()
        float(x[0])
        x.tolist()
        x.cpu()
    sites = list(reads.elsewhere)
    assert [s.split()[1] for s in sites] == ["__float__", "tolist", "cpu"]  # the product and the sum read nothing
    assert all(s.startswith(f"{Path(__file__).name}:") for s in sites)  # the caller, not torch
    assert torch.Tensor.item.__name__ == "item" and torch.Tensor.cpu.__name__ == "cpu"  # restored
