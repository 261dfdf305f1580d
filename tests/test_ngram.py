"""N-gram lookup drafting (``+ngram``): what the lookup finds, and that every strategy with it, a draft model or
an EAGLE head behind it or none at all, stays lossless (greedy, float32) and exact (sampling)."""

from __future__ import annotations

import pytest
import torch

from test_eagle_loop import LAYERS, eagle1, eagle3
from sampling_checks import first_tokens_follow_the_target
from test_loop import VOCAB, greedy_case, make_policy, pair  # noqa: F401  (pair is a fixture)
from test_verify import step_of, verify_chain
from conftest import tiny_qwen2
from dynvocab.errors import DynvocabError
from dynvocab.models.eagle import LayerTap
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.decoding.ngram import NgramLookup, split_ngram
from dynvocab.runtime.drafts.eagle_draft import Eagle1Draft, Eagle3Draft
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.strategies import check_strategy, lookup
from dynvocab.runtime.trees.verify import SamplingConfig


def test_the_longest_suffix_wins_and_the_latest_occurrence_of_it():
    look = NgramLookup(longest=3, shortest=1)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 7, 9, 1, 2, 8, 4, 1, 2]
    assert look.continuation(tokens, 2) == [8, 4]  # "1 2" at 5–6 is the latest; "4 1 2" never occurred before
    tokens = [4, 1, 2, 7, 9, 1, 2, 8, 4, 1, 2]
    assert look.continuation(tokens, 3) == [7, 9, 1]  # "4 1 2" at 0–2 is longer than the later "1 2"


def test_nothing_shorter_than_the_shortest_counts():
    look = NgramLookup(longest=4, shortest=2)
    assert look.continuation([3, 1, 4, 1, 5, 9, 2, 6, 5], 4) == []  # only "5" repeats
    assert look.continuation([3, 1, 4, 1], 4) == []
    assert look.continuation([1], 4) == [] and look.continuation([], 4) == []
    assert look.continuation([1, 2, 1, 2], 0) == []


def test_a_continuation_that_reaches_the_end_repeats_the_pattern():
    look = NgramLookup(longest=2, shortest=2)
    assert look.continuation([7, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert look.continuation([3, 3, 3], 4) == [3, 3, 3, 3]


def test_sizes_out_of_order_are_refused():
    with pytest.raises(ValueError):
        NgramLookup(longest=2, shortest=3)
    with pytest.raises(ValueError):
        DecodeConfig(ngram=True, ngram_max=1, ngram_min=2)
    with pytest.raises(ValueError):
        NgramLookup(longest=2, shortest=0)


def test_the_suffix_names_the_strategy_it_extends():
    assert split_ngram("microspec+ngram") == ("microspec", True)
    assert split_ngram("microspec") == ("microspec", False)
    assert split_ngram("+ngram") == ("+ngram", False)
    assert lookup("hybrid+ngram") is lookup("hybrid")
    assert not lookup("ar+ngram").drafts
    with pytest.raises(DynvocabError, match="unknown strategy 'nope'"):
        check_strategy("nope+ngram")


def repetitive_case(seed: int) -> tuple[list[int], DecodeConfig]:
    """A random prompt with a repeated stretch in it, so the lookup finds something from the first cycle on."""
    prompt, cfg = greedy_case(seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    stretch = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    return stretch + prompt + stretch + stretch[:2], cfg


@pytest.mark.parametrize("kind", [None, "full", "fr", "microspec", "hybrid", "random"])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_with_lookup_is_lossless_with_a_draft_model_or_none(pair, kind, seed):  # noqa: F811
    target, draft = pair
    prompt, cfg = repetitive_case(seed)
    ar = speculative_generate(target, prompt, cfg, set())
    looked = DecodeConfig(**{**cfg.__dict__, "ngram": True})
    if kind is None:
        spec = speculative_generate(target, prompt, looked, set())
    else:
        spec = speculative_generate(target, prompt, looked, set(), draft, make_policy(kind, seed))
    assert spec.token_ids == ar.token_ids
    m = spec.metrics
    assert m.lookup_cycles > 0 and 0 <= m.lookup_accepted <= m.lookup_drafted
    assert m.new_tokens == len(ar.token_ids) and m.cycles <= ar.metrics.cycles
    if kind is None:  # the lookup alone: cycles without a continuation are plain steps
        assert m.draft_steps == 0 and m.mean_active_vocab is None


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_with_lookup_is_lossless_with_an_eagle_head(arch, seed):
    """Cycles drafted by lookup leave the head behind; it catches up on the target's features at its next step."""
    target_model = tiny_qwen2(layers=LAYERS, seed=0)
    target = CausalLM(target_model)
    tap = None
    if arch == "eagle1":
        draft = Eagle1Draft(eagle1(target_model), target)
    else:
        model = eagle3(target_model)
        tap = LayerTap(target_model, model.config.target_layers(LAYERS))
        draft = Eagle3Draft(model, target, tap)
    try:
        prompt, cfg = repetitive_case(seed)
        ar = speculative_generate(target, prompt, cfg, set())
        looked = DecodeConfig(**{**cfg.__dict__, "ngram": True, "ngram_max": 3})
        spec = speculative_generate(target, prompt, looked, set(), draft, make_policy("microspec", seed))
        assert spec.token_ids == ar.token_ids
        assert spec.metrics.lookup_cycles > 0 and spec.metrics.draft_steps > 0
    finally:
        if tap is not None:
            tap.remove()


def test_a_looked_up_token_is_accepted_with_the_target_probability():
    """The continuation's one-hot q: the first emitted token still follows p (chi-square, 11 degrees of freedom),
    and the test can fail (the lookup's token itself is far from p)."""
    vocab, draws, x = 12, 6000, 4
    gen = torch.Generator().manual_seed(7)
    p_logits = torch.randn(2, vocab, generator=gen) * 1.5
    counts = torch.zeros(vocab)
    for _ in range(draws):
        verdict = verify_chain([step_of(x, torch.tensor([x]), torch.ones(1))], p_logits,
                               SamplingConfig(temperature=1.0), gen)
        counts[x if verdict.accepted else verdict.next_token] += 1
    p = torch.softmax(p_logits[0], dim=0)
    freq = counts / draws
    assert float(((freq - p) ** 2 / p).sum() * draws) < 31.3
    one_hot = torch.zeros(vocab).index_fill_(0, torch.tensor([x]), 1.0)
    assert float(((one_hot - p) ** 2 / p).sum() * draws) > 31.3


def test_sampling_with_lookup_runs_and_repeats_with_a_seed(pair):  # noqa: F811
    target, draft = pair
    prompt, _ = repetitive_case(1)
    cfg = DecodeConfig(gamma=3, max_new_tokens=16, temperature=0.8, seed=5, ngram=True)
    a = speculative_generate(target, prompt, cfg, set(), draft, make_policy("microspec", 1))
    b = speculative_generate(target, prompt, cfg, set(), draft, make_policy("microspec", 1))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16


def test_sampling_with_lookup_follows_the_target_distribution(pair):  # noqa: F811
    """The loop's first sampled token over many seeds, drafted by the lookup (the prompt's suffix "5 9" occurred
    before it), against the target's p (chi-square)."""
    target, _ = pair
    cfg = DecodeConfig(gamma=3, max_new_tokens=2, temperature=1.5, ngram=True)
    runs = first_tokens_follow_the_target(target, [5, 9, 13, 5, 9], cfg)
    assert sum(g.metrics.lookup_cycles for g in runs) >= len(runs)


def test_vllm_takes_a_lookup_row_on_eagle_heads_and_refuses_the_rest_in_one_line():
    """The plugin looks up through an EAGLE proposer's passes (tests/test_vllm_eagle.py runs it); on a draft model
    it cannot, and a lookup with no head is vLLM's own ``ngram``."""
    from dynvocab.runtime.batched import SelectorSpec, batched, refusal

    assert refusal("microspec+ngram") is None and refusal("microspec+ngram", "eagle1") is None
    assert batched("microspec+ngram") is batched("microspec")
    assert SelectorSpec("fr+ngram", ngram_max=5, ngram_min=3).lookup == NgramLookup(5, 3)
    assert SelectorSpec("fr").lookup is None
    why = refusal("microspec+ngram", "draft-model")
    assert "EAGLE head" in why and "'ngram' method" in why and "\n" not in why
    assert "'ngram' method" in refusal("ar+ngram")
    with pytest.raises(DynvocabError, match="'ngram' method"):
        batched("ar+ngram")
