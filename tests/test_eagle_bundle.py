"""Bundle-backed strategies with EAGLE heads on tiny local models: evospec and the hybrid equal ``ar``; the hybrid
searches the draft head per step only for a draft model; dynaspec's router, trained on a draft model's hidden
states, refuses a head of another width in one line; the builders refuse a head as their draft in one line."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import assert_one_line_error, run
from tiny_models import corpus_jsonl, tiny_dirs  # noqa: F401  (fixtures)

from dynvocab.builders.draft.init import init_eagle1_from_target
from dynvocab.models.eagle import EAGLE1, EAGLE3, EagleModel, config_like, save_eagle

PROMPT = "def model(x):\n    return x + 1\nThe draft token head"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tiny_dirs, corpus_jsonl):  # noqa: F811
    out = tmp_path_factory.mktemp("eagle_bundle") / "b.safetensors"
    result = run("build-index", "--target", tiny_dirs[0], "--draft", tiny_dirs[1], "--corpus", corpus_jsonl,
                 "--out", out, "--num-clusters", 8, "--device", "cpu")
    assert result.exit_code == 0, result.output
    result = run("train-router", "--bundle", out, "--draft", tiny_dirs[1], "--target", tiny_dirs[0], "--corpus",
                 corpus_jsonl, "--max-docs", 40, "--max-tokens", 24, "--epochs", 2, "--hidden", 32, "--k-max", 3,
                 "--device", "cpu")
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def heads(tiny_dirs, tmp_path_factory):  # noqa: F811
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_dirs[0], dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("eagle_heads")
    eagle1 = init_eagle1_from_target(EagleModel(config_like(target.config, EAGLE1)).eval(), target)
    torch.manual_seed(0)
    eagle3 = EagleModel(config_like(target.config, EAGLE3, draft_vocab_size=200, aux_hidden_states=(1, 2, 2))).eval()
    with torch.no_grad():
        for name, p in eagle3.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
        eagle3.set_draft_vocab(torch.randperm(target.config.vocab_size)[:200].sort().values)
    return {"eagle": save_eagle(eagle1, root / "eagle"), "eagle3": save_eagle(eagle3, root / "eagle3")}


def generate(tiny_dirs, head, bundle, strategy):  # noqa: F811
    result = run("generate", PROMPT, "--target", tiny_dirs[0], "--draft", head, "--bundle", bundle,
                 "--no-chat-template", "--quiet", "--dtype", "float32", "--strategy", strategy,
                 "--max-new-tokens", 16, "--json")
    return result


@pytest.mark.parametrize("kind", [EAGLE1, EAGLE3])
def test_bundle_strategies_equal_ar(tiny_dirs, heads, bundle, kind):  # noqa: F811
    ar = generate(tiny_dirs, heads[kind], bundle, "ar")
    assert ar.exit_code == 0, ar.output
    want = json.loads(ar.output.strip().splitlines()[-1])["token_ids"]
    for strategy in ("fr", "evospec", "hybrid"):
        result = generate(tiny_dirs, heads[kind], bundle, strategy)
        assert result.exit_code == 0, result.output
        assert json.loads(result.output.strip().splitlines()[-1])["token_ids"] == want, (kind, strategy)


def test_dynaspec_refuses_a_router_of_another_width(tiny_dirs, heads, bundle):  # noqa: F811
    assert_one_line_error(generate(tiny_dirs, heads[EAGLE1], bundle, "dynaspec"), "hidden size 16", "32")


def test_online_align_is_refused(tiny_dirs, heads, bundle):  # noqa: F811
    result = run("generate", PROMPT, "--target", tiny_dirs[0], "--draft", heads[EAGLE1], "--bundle", bundle,
                 "--no-chat-template", "--quiet", "--strategy", "evospec", "--online-align")
    assert_one_line_error(result, "EAGLE", "--online-align")


@pytest.mark.parametrize("share", [0.0, 1e9], ids=["search-costs-too-much", "search-pays"])
def test_hybrid_searches_per_step_where_it_measures_cheaper_than_the_head(tiny_dirs, heads, bundle, share, monkeypatch):  # noqa: F811
    """The hybrid's per-step candidates (draft-head HNSW search, graph successors) run by default where the search
    measures under SEARCH_SHARE of the draft's full head, whatever the draft's kind; asked for, they run anyway,
    and an EAGLE-1 head searches the target's index (its head is the target's)."""
    from dynvocab.runtime.selection import head_search as step_search
    from dynvocab.runtime.selection.context.hybrid import HybridConfig
    from dynvocab.runtime.session import ModelConfig, Session
    from dynvocab.runtime.strategies import StrategyOptions, make_policy

    monkeypatch.setattr(step_search, "SEARCH_SHARE", share)

    def hybrid(draft, cfg=HybridConfig()):
        session = Session(ModelConfig(target=str(tiny_dirs[0]), draft=str(draft), device="cpu", dtype="float32"),
                          bundle=str(bundle))
        return make_policy("hybrid", StrategyOptions(configs=(cfg,)), session.policy_context())

    pays = share > 0
    for draft in (tiny_dirs[1], heads[EAGLE1]):
        policy = hybrid(draft)
        assert (policy.selector.search is not None) == pays
        assert (policy.hcfg.step_neighbours, policy.hcfg.step_successors) == ((16, 8) if pays else (0, 0))
    asked = hybrid(heads[EAGLE1], HybridConfig(step_neighbours=4))
    assert asked.selector.search.prepare(None) is asked.hnsw is not None and asked.hcfg.step_neighbours == 4
    assert asked.hcfg.step_successors == (8 if pays else 0)
    assert step_search._MEASURED and all(v[2] > 0 and v[3] > 0 for v in step_search._MEASURED.values())


@pytest.mark.parametrize("command", ["build-index", "train-router"])
def test_the_builders_refuse_a_head_as_the_draft_and_name_its_target(tiny_dirs, heads, bundle, corpus_jsonl,  # noqa: F811
                                                                     command, tmp_path):
    out = tmp_path / "b.safetensors"
    args = (["--target", tiny_dirs[0]] if command == "build-index" else ["--bundle", bundle]) + ["--out", out]
    result = run(command, *args, "--draft", heads["eagle"], "--corpus", corpus_jsonl, "--device", "cpu")
    assert_one_line_error(result, "is an EAGLE head", "pass the target as --draft")
    assert not out.exists()
