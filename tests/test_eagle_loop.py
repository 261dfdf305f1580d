"""EAGLE-1 and EAGLE-3 heads drafting in the one loop on tiny random targets: lossless at temperature 0 with every
policy (and tree leaves), exact sampling, caches that roll back to what a fresh pass computes."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_qwen2
from sampling_checks import first_tokens_follow_the_target
from test_loop import VOCAB, greedy_case, make_policy
from dynvocab.builders.draft.init import init_eagle1_from_target
from dynvocab.models.eagle import EAGLE1, EAGLE3, EagleModel, LayerTap, config_like
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.drafts.eagle_draft import Eagle1Draft, Eagle3Draft
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.heads.active_set import ActiveSet
from dynvocab.runtime.heads.mapped_head import MappedHead
from dynvocab.runtime.selection import FullPolicy, SelectorPolicy
from dynvocab.runtime.selection.frequency import StaticSelector

LAYERS = 6  # EAGLE-3's default taps (2, L//2, L-3) need a few layers
DRAFT_VOCAB = 60


def eagle1(target_model) -> EagleModel:
    model = EagleModel(config_like(target_model.config, EAGLE1)).eval()
    return init_eagle1_from_target(model, target_model)


def eagle3(target_model, seed: int = 0) -> EagleModel:
    torch.manual_seed(seed)
    model = EagleModel(config_like(target_model.config, EAGLE3, draft_vocab_size=DRAFT_VOCAB)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
        model.embed_tokens.weight.copy_(target_model.model.embed_tokens.weight)
        ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB]
        model.set_draft_vocab(ids.sort().values)
    return model


@pytest.fixture(scope="module")
def target_model():
    return tiny_qwen2(layers=LAYERS, seed=0)


@pytest.fixture(scope="module", params=[EAGLE1, EAGLE3])
def setup(request, target_model):
    """(target CausalLM, EagleDraft) for one kind."""
    target = CausalLM(target_model)
    if request.param == EAGLE1:
        yield target, Eagle1Draft(eagle1(target_model), target)
        return
    model = eagle3(target_model)
    tap = LayerTap(target_model, model.config.target_layers(LAYERS))
    yield target, Eagle3Draft(model, target, tap)
    tap.remove()


@pytest.mark.parametrize("kind", ["full", "fr", "fr-pa", "random", "microspec", "hybrid"])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_is_lossless(setup, kind, seed):
    target, draft = setup
    prompt, cfg = greedy_case(seed)
    ar = speculative_generate(target, prompt, cfg, set())
    spec = speculative_generate(target, prompt, cfg, set(), draft, make_policy(kind, seed))
    assert spec.token_ids == ar.token_ids
    assert spec.metrics.new_tokens == len(ar.token_ids)


def test_the_draft_is_sometimes_right(target_model):
    """An EAGLE-1 head initialised from the target's last layer is often right on a tiny target, so the lossless
    tests above cross accepted and rejected drafts."""
    target = CausalLM(target_model)
    draft = Eagle1Draft(eagle1(target_model), target)
    g = speculative_generate(target, [3, 1, 4, 1, 5], DecodeConfig(gamma=4, max_new_tokens=40), set(), draft,
                             FullPolicy(draft.info.vocab_size))
    assert g.metrics.mean_accepted_length > 1.0, g.cycle_lengths
    assert any(n < 5 for n in g.cycle_lengths), g.cycle_lengths


def test_cache_rolls_back_to_a_fresh_pass(setup):
    """After a generation the head's cache holds only entries computed from the target's features, and its next
    step equals a fresh pass over the whole sequence with the target's features."""
    target, draft = setup
    prompt = [7, 8, 9, 10]
    g = speculative_generate(target, prompt, DecodeConfig(gamma=4, max_new_tokens=25), set(), draft, make_policy("random", 3))
    seq = prompt + g.token_ids
    assert draft.length <= len(seq) - 1 and draft.trusted == draft.length
    cached = draft.step(torch.tensor(seq[draft.length:]))[-1]
    with torch.no_grad():
        out = target.model(torch.tensor([seq[:-1]]), output_hidden_states=True)
    if isinstance(draft, Eagle1Draft):
        feats = out.hidden_states[-1][0]  # the final normed hidden states
    else:
        feats = draft.tap.features()  # the pass above ran through the tap
    ids = torch.tensor([seq[1:]])
    fresh = draft.model(ids, feats[None], torch.arange(len(seq) - 1)[None])[1][0, -1]
    torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)


def test_mapped_head_names_target_ids(target_model):
    model = eagle3(target_model, seed=2)
    row_token = model.draft_to_target()
    head = MappedHead(model.lm_head.weight.detach(), row_token, VOCAB)
    h = torch.randn(1, model.config.hidden_size)
    full, cols = head.logits(h, ActiveSet.full(VOCAB))
    assert torch.equal(cols, row_token) and full.shape == (1, DRAFT_VOCAB)
    active = torch.arange(0, VOCAB, 2)  # target ids, some outside the draft vocabulary
    logits, ids = head.logits(h, ActiveSet.of(active))
    inside = active[model.t2d[active]]
    assert sorted(ids.tolist()) == inside.tolist()
    by_id = dict(zip(cols.tolist(), full[0].tolist()))
    assert all(abs(by_id[i] - v) < 1e-4 for i, v in zip(ids.tolist(), logits[0].tolist()))


@pytest.mark.parametrize("kind", [EAGLE1, EAGLE3])
def test_sampling_follows_the_target_distribution(target_model, kind):
    """First sampled token over many seeds, with an EAGLE draft over a subset, vs the target's p (chi-square)."""
    target = CausalLM(target_model)
    if kind == EAGLE1:
        draft = Eagle1Draft(eagle1(target_model), target)
    else:
        model = eagle3(target_model)
        draft = Eagle3Draft(model, target, LayerTap(target_model, model.config.target_layers(LAYERS)))
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:50]
    cfg = DecodeConfig(gamma=3, max_new_tokens=2, temperature=1.5)
    first_tokens_follow_the_target(target, [5, 9, 13], cfg, draft, lambda: SelectorPolicy(StaticSelector(ranking)))
