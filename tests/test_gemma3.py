"""A Gemma-3-shaped target (sliding-window and global layers mixed, scaled input embeddings, tied head) in the one
loop: every draft kind is lossless at temperature 0 with tree leaves, where the sequence runs well past the
sliding window, so the caches' rollback (a sliding layer keeps only its last positions) is exercised."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_gemma3
from test_loop import VOCAB, greedy_case, make_policy
from dynvocab.builders.draft.init import init_eagle1_from_target, init_eagle3_from_target
from dynvocab.models.eagle import EAGLE1, EAGLE3, EagleModel, LayerTap, config_like
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.eagle_draft import Eagle1Draft, Eagle3Draft
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.trees.tree import DraftTree

pytestmark = pytest.mark.transformers_api  # CI runs it again at transformers' lower bound

WINDOW = 8  # far shorter than prompt + 40 new tokens


@pytest.fixture(scope="module")
def target_model():
    return tiny_gemma3(seed=0, window=WINDOW)


def perturbed(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.std())
    return model


@pytest.fixture(scope="module", params=["model", EAGLE1, EAGLE3])
def setup(request, target_model):
    """(target CausalLM, draft) for one draft kind over the Gemma-3-shaped target."""
    target = CausalLM(target_model)
    if request.param == "model":
        yield target, DraftModel(perturbed(tiny_gemma3(seed=0, window=WINDOW), 1))
        return
    cfg = config_like(target_model.config, request.param)
    if request.param == EAGLE1:
        yield target, Eagle1Draft(init_eagle1_from_target(EagleModel(cfg).eval(), target_model), target)
        return
    head = EagleModel(cfg).eval()
    init_eagle3_from_target(head, target_model, torch.arange(VOCAB))
    tap = LayerTap(target_model, head.config.target_layers(target_model.config.num_hidden_layers))
    yield target, Eagle3Draft(head, target, tap)
    tap.remove()


@pytest.mark.parametrize("kind", ["full", "fr", "random", "microspec"])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_is_lossless_past_the_window(setup, kind, seed):
    target, draft = setup
    prompt, cfg = greedy_case(seed, max_prompt=20, max_new_tokens=40)
    ar = speculative_generate(target, prompt, cfg, set())
    spec = speculative_generate(target, prompt, cfg, set(), draft, make_policy(kind, seed))
    assert spec.token_ids == ar.token_ids


def test_ar_equals_a_pass_without_cache(target_model):
    """The reference itself: one-token decoding through the sliding caches = full recomputation each token."""
    target = CausalLM(target_model)
    prompt = [5, 17, 3, 9, 40, 2, 11, 60, 7, 1, 33, 8]
    ar = speculative_generate(target, prompt, DecodeConfig(max_new_tokens=30), set())
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(30):
            ids.append(int(target_model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ar.token_ids == ids[len(prompt):]


def test_a_tree_pass_past_the_window_scores_each_row_as_its_own_sequence(target_model):
    """Root, chain and leaves in one pass over sliding layers: each row's logits are those of a pass over exactly
    its own sequence (the prefix, its ancestors, itself), and rollback keeping a leaf leaves the cache as a pass
    over the accepted sequence would."""
    lm = CausalLM(target_model)
    prefix = list(range(3, 3 + 2 * WINDOW))
    chain, leaves = [20, 21, 22], {1: 30, 2: 31}
    tree = DraftTree.of_chain(chain, leaves)
    leaf_row = {1: 4, 2: 5}  # after the root and the chain, in depth order
    lm.reset()
    lm.step(torch.tensor(prefix[:-1]))
    hidden = lm.step(tree.inputs(torch.tensor(prefix[-1:])), tree)
    logits = lm.logits(hidden)  # [1 + 3 + 2, V]
    with torch.no_grad():
        def last(seq):
            return target_model(torch.tensor([seq])).logits[0, -1]

        torch.testing.assert_close(logits[2], last(prefix + chain[:2]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[leaf_row[1]], last(prefix + chain[:1] + [30]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[leaf_row[2]], last(prefix + chain[:2] + [31]), atol=1e-4, rtol=1e-4)
    n = len(prefix)
    lm.rollback(n + 1, keep=[n - 1 + leaf_row[1]])  # accepted: d_1, then the leaf at depth 1 (as the loop does)
    nxt = lm.logits(lm.step(torch.tensor([50])))[0]
    with torch.no_grad():
        torch.testing.assert_close(nxt, last(prefix + chain[:1] + [30, 50]), atol=1e-4, rtol=1e-4)


def test_the_head_embeds_tokens_as_the_target_does(target_model):
    head = init_eagle1_from_target(EagleModel(config_like(target_model.config, EAGLE1)), target_model)
    ids = torch.tensor([[4, 8, 15]])
    torch.testing.assert_close(head.embed(ids), target_model.get_input_embeddings()(ids))
    assert head.embed_scale == pytest.approx(target_model.config.hidden_size ** 0.5)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """A tiny Gemma-3 target saved with a real BPE tokenizer, and a small corpus file."""
    from tiny_models import make_tokenizer, sentences

    root = tmp_path_factory.mktemp("gemma3")
    tokenizer = make_tokenizer(root / "tokenizer")
    model = tiny_gemma3(vocab=len(tokenizer), seed=0, window=WINDOW)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    corpus = root / "docs.txt"
    corpus.write_text("\n".join(sentences(40, seed=3)) + "\n")
    return root / "target", corpus


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_train_draft_on_a_gemma3_target_then_draft_losslessly(gemma_dir, tmp_path, arch):
    from cli_helpers import run

    target, corpus = gemma_dir
    out = tmp_path / arch
    common = ("--max-docs", 12, "--max-tokens", 24, "--device", "cpu", "--threads", 1)
    result = run("train-draft", "--target", target, "--corpus", corpus, "--out", out, "--arch", arch,
                 "--draft-vocab", 64, "--epochs", 1, *common)
    assert result.exit_code == 0, result.output

    def generate(strategy):
        result = run("generate", "Def fast draft(x): return the model and the token", "--target", target,
                     "--draft", out, "--no-chat-template", "--quiet", "--dtype", "float32", "--strategy", strategy,
                     "--max-new-tokens", 24, "--json", "--threads", 1)
        assert result.exit_code == 0, result.output
        return json.loads(result.output.strip().splitlines()[-1])["token_ids"]

    ar = generate("ar")
    assert len(ar) == 24
    for strategy in ("full", "microspec"):
        assert generate(strategy) == ar, strategy


def test_speculators_layout_is_refused_for_a_scaled_embedding(gemma_dir, tmp_path):
    from cli_helpers import assert_one_line_error, run

    target, corpus = gemma_dir
    result = run("train-draft", "--target", target, "--corpus", corpus, "--out", tmp_path / "spec", "--format",
                 "speculators", "--draft-vocab", 64, "--max-docs", 4, "--device", "cpu", "--threads", 1)
    assert_one_line_error(result, "scales its input embeddings")
