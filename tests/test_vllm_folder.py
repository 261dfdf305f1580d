"""``dynvocab export --format vllm``: the draft folder vLLM loads (config section, architectures, links, the policy
file), its selector against one built from the source bundle, a demo draft's target folder, a toy strategy that runs
batched from its registry entry alone, and every refusal as one line with nothing left behind. No vLLM import: the
folder is what the plugin's ``head.load_policy`` reads. The format itself comes from the serving room through an
entry point, and nothing below that room imports it."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
from cli_helpers import assert_one_line_error, run
from test_router_cli import build
from tiny_models import corpus_jsonl, tiny_dirs  # noqa: F401  (fixtures)

import dynvocab
from dynvocab.artifacts import FreqTable, Stage, load_bundle, write_bundle
from dynvocab.artifacts.selectors import random_selectors
from dynvocab.models.eagle import EAGLE1, EAGLE3, EagleModel, config_like, save_eagle
from dynvocab.runtime.batched import SelectorSpec, batch_strategies, build_selector, refusal
from dynvocab.runtime.selection.frequency import StaticSelector
from dynvocab.runtime.strategies import Batched, Strategy, register, unregister
from dynvocab.serving.vllm import names
from dynvocab.models.demo import demo_target
from dynvocab.serving.vllm.folder import EXPORT_FORMAT, write_draft_folder
from dynvocab.serving.vllm.kinds import KINDS

pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)


@pytest.fixture(scope="module")
def bundles(tiny_dirs, corpus_jsonl, tmp_path_factory):  # noqa: F811
    """(freq only, freq + random lowrank and centroids selectors for the draft)."""
    root = tmp_path_factory.mktemp("vllm_bundles")
    freq = build(tiny_dirs, corpus_jsonl, root / "freq.safetensors", "freq")
    with load_bundle(freq) as b:
        stages = [b.load_stage("freq")]
        fps = (b.fingerprints["target"], b.fingerprints["draft"])
    low, cen = random_selectors(fps[1].head_rows, fps[1].hidden_size, torch.Generator().manual_seed(0), rank=4,
                                candidates=24, block=16, blocks=3)
    stages += [Stage(t.kind, t.tensors, t.config, {"note": "random"}) for t in (low, cen)]
    return freq, write_bundle(root / "selectors.safetensors", stages, *fps)


@pytest.fixture(scope="module")
def heads(tiny_dirs, tmp_path_factory):  # noqa: F811
    """EAGLE heads for the tiny target: Llama EAGLE-1, Qwen2 EAGLE-1 (what a Qwen2 target trains; with an fc bias, and
    with an activation the plugin has no kernel for), EAGLE-3 over the target's vocabulary (and with an fc bias, which
    vLLM's eagle3 class cannot load), EAGLE-3 with a 200-id d2t vocabulary, and the speculators layout."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_dirs[0])
    root = tmp_path_factory.mktemp("vllm_heads")
    torch.manual_seed(0)
    e3_d2t = EagleModel(config_like(config, EAGLE3, draft_vocab_size=200)).eval()
    e3_d2t.set_draft_vocab(torch.randperm(config.vocab_size)[:200].sort().values)
    e3 = EagleModel(config_like(config, EAGLE3)).eval()
    return {
        "eagle1": save_eagle(EagleModel(replace(config_like(config, EAGLE1, fc_bias=False), arch="llama")).eval(),
                             root / "e1"),
        "eagle1-qwen2": save_eagle(EagleModel(config_like(config, EAGLE1, fc_bias=False)).eval(), root / "e1q"),
        "eagle1-bias": save_eagle(EagleModel(config_like(config, EAGLE1)).eval(), root / "e1b"),  # the plugin's fc has one
        "eagle1-relu": save_eagle(EagleModel(replace(config_like(config, EAGLE1), hidden_act="relu")).eval(), root / "e1r"),
        "eagle3-bias": save_eagle(EagleModel(config_like(config, EAGLE3, fc_bias=True)).eval(), root / "e3b"),
        "eagle3": save_eagle(e3, root / "e3"),
        "eagle3-d2t": save_eagle(e3_d2t, root / "e3d2t"),
        "speculators": save_eagle(e3, root / "spec", layout="speculators", target_name=str(tiny_dirs[0])),
    }


def export(bundle, draft, out, strategy, *extra):
    if strategy == "fr" and "--budget" not in extra:
        extra = (*extra, "--budget", 32)  # fr's default (FR-Spec's 32,768) exceeds the tiny vocabulary
    return run("export", bundle, "--format", "vllm", "--strategy", strategy, "--draft", draft, "--out", out, *extra)


def config_of(folder):
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("strategy", ["fr", "lowrank", "centroids"])
def test_folder_for_a_draft_model(bundles, tiny_dirs, tmp_path, strategy):  # noqa: F811
    out = tmp_path / f"draft-{strategy}"
    result = export(bundles[1], tiny_dirs[1], out, strategy)
    assert result.exit_code == 0, result.output
    line, spec = result.output.strip().splitlines()
    assert line.startswith(f"wrote {out} (vllm, {strategy}, ") and line.endswith(" ids, DynvocabQwen2ForCausalLM)"), line
    assert spec == (f'vLLM: speculative_config={{"method": "draft_model", "model": "{out}", '
                    '"use_local_argmax_reduction": true}')
    with load_bundle(bundles[1]) as src:
        eos = FreqTable.from_bundle(src).eos_ids.numel()
    assert f", {dict(fr=32, lowrank=24, centroids=3 * 16 + eos)[strategy]} ids," in line  # centroids: + the EOS ids
    cfg, own = config_of(out), config_of(tiny_dirs[1])
    assert cfg["architectures"] == [names.registered_name("draft-model", "Qwen2ForCausalLM")]
    assert {k: v for k, v in cfg.items() if k not in ("architectures", names.CONFIG_KEY)} == {
        k: v for k, v in own.items() if k != "architectures"}
    section = cfg[names.CONFIG_KEY]
    with load_bundle(bundles[1]) as src:
        assert section == {
            "format": names.FOLDER_FORMAT, "strategy": strategy, "budget": 32 if strategy == "fr" else None, "policy_file": names.POLICY_FILE,
            "kind": "draft-model", "method": "draft_model", "base_architecture": "Qwen2ForCausalLM",
            "bundle": {"path": str(bundles[1].resolve()),
                       "fingerprint": {r: fp.as_dict() for r, fp in src.fingerprints.items()},
                       "stages": {s: src.stage_checksum(s) for s in dict.fromkeys(
                           {"fr": ["freq"]}.get(strategy, [strategy, "freq"]))}},
            "dynvocab_version": dynvocab.__version__,
        }
    for item in tiny_dirs[1].iterdir():  # weights, tokenizer, generation config: linked by absolute path
        if item.name != "config.json":
            assert (out / item.name).is_symlink() and os.readlink(out / item.name) == str(item.resolve())
    with load_bundle(out / names.POLICY_FILE, verify=True) as policy, load_bundle(bundles[1]) as src:
        assert policy.stages == sorted({"freq", strategy} - {"fr"}, key=["freq", strategy].index)
        assert policy.fingerprints == src.fingerprints
        for stage in policy.stages:
            assert policy.config(stage) == src.config(stage) and policy.stage_checksum(stage) == src.stage_checksum(stage)


@pytest.mark.parametrize("strategy, budget", [("fr", 40), ("lowrank", None), ("lowrank", 7), ("centroids", 2)])
def test_policy_file_selects_what_the_bundle_selects(bundles, tiny_dirs, tmp_path, strategy, budget):  # noqa: F811
    folder = write_draft_folder(bundles[1], str(tiny_dirs[1]), strategy, tmp_path / "f", budget)
    cfg = config_of(folder.path)
    assert cfg[names.CONFIG_KEY]["budget"] == budget
    spec, hidden = SelectorSpec(strategy, budget), torch.randn(5, cfg["hidden_size"], generator=torch.Generator().manual_seed(1))
    with load_bundle(folder.path / names.POLICY_FILE) as policy, load_bundle(bundles[1]) as src:
        mine = build_selector(policy, spec, cfg["vocab_size"], cfg["hidden_size"])
        theirs = build_selector(src, spec, cfg["vocab_size"], cfg["hidden_size"])
        assert mine.k == theirs.k == folder.ids
        assert torch.equal(mine(hidden).sort(dim=-1).values, theirs(hidden).sort(dim=-1).values)


def test_copy_and_the_python_api(bundles, tiny_dirs, tmp_path):  # noqa: F811
    out = dynvocab.export(bundles[0], tmp_path / "copied", format="vllm", strategy="fr", draft=str(tiny_dirs[1]),
                          budget=16, copy=True)
    assert out == tmp_path / "copied"
    weights = out / "model.safetensors"
    assert weights.is_file() and not weights.is_symlink()
    assert weights.read_bytes() == (tiny_dirs[1] / "model.safetensors").read_bytes()


def test_an_empty_out_folder_is_used(bundles, tiny_dirs, tmp_path):  # noqa: F811
    (tmp_path / "empty").mkdir()
    assert export(bundles[0], tiny_dirs[1], tmp_path / "empty", "fr").exit_code == 0
    assert (tmp_path / "empty" / "config.json").is_file()


@pytest.mark.parametrize("head, kind, arch", [
    ("eagle1", "eagle1", "EagleDynvocabLlamaForCausalLM"),
    ("eagle1-qwen2", "eagle1", "EagleDynvocabQwen2ForCausalLM"),
    ("eagle1-bias", "eagle1", "EagleDynvocabQwen2ForCausalLM"),  # the plugin's EAGLE-1 class loads fc's bias
    ("eagle3", "eagle3", "Eagle3DynvocabLlamaForCausalLM"),
])
def test_folder_for_an_eagle_head(bundles, heads, tmp_path, head, kind, arch):
    out = tmp_path / head
    result = export(bundles[0], heads[head], out, "fr")
    assert result.exit_code == 0, result.output
    assert arch in result.output
    cfg = config_of(out)
    assert cfg["architectures"] == [arch]
    assert cfg[names.CONFIG_KEY]["kind"] == kind and cfg[names.CONFIG_KEY]["method"] == KINDS[kind].method
    assert cfg[names.CONFIG_KEY]["base_architecture"] == config_of(heads[head])["architectures"][0]
    assert (out / "model.safetensors").is_symlink()
    if head == "eagle1-qwen2":  # vLLM has no EagleQwen2ForCausalLM: a llama layer with q/k/v biases
        assert (cfg["model_type"], cfg["qkv_bias"], cfg["attention_bias"]) == ("llama", True, False)
    if kind == "eagle1":  # the EAGLE repo's "bias" is fc's; vLLM's llama layer would put it on q/k/v/o
        assert "bias" not in cfg and cfg["attention_bias"] is False


def assert_refused(result, out, *words):
    assert_one_line_error(result, *words)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]


def test_refusals(bundles, tiny_dirs, heads, tmp_path):  # noqa: F811
    freq, selectors = bundles
    out = tmp_path / "out"
    draft = tiny_dirs[1]
    assert_refused(export(selectors, draft, out, "evospec"), out, "cannot run inside vLLM on a draft model",
                   "EAGLE head", "hybrid")
    assert_refused(export(selectors, draft, out, "full"), out, "cannot run inside vLLM", "lowrank", "hybrid")
    assert_refused(export(selectors, draft, out, "dynaspec"), out, "no 'clusters' stage", "build-index")
    (tmp_path / "bare").mkdir()
    assert_refused(export(selectors, tmp_path / "bare", out, "fr"), out, "no config.json")
    assert_refused(export(selectors, "someone/some-model", out, "fr"), out, "not a local model folder")
    mistral = tmp_path / "mistral"
    shutil.copytree(draft, mistral)
    (mistral / "config.json").write_text(json.dumps({**config_of(draft), "architectures": ["MistralForCausalLM"]}))
    assert_refused(export(selectors, mistral, out, "fr"), out, "MistralForCausalLM", "supports", "Qwen2ForCausalLM")
    assert_refused(export(selectors, heads["eagle3-bias"], out, "fr"), out, "fc has a bias", "eagle3")
    assert_refused(export(selectors, heads["eagle1-relu"], out, "fr"), out, "activation relu", "gelu_pytorch_tanh")
    assert_refused(export(selectors, tiny_dirs[0], out, "fr"), out, "built for another draft", "hidden_size")
    assert_refused(export(freq, draft, out, "lowrank"), out, "no 'lowrank' stage")
    assert_refused(export(selectors, heads["eagle3-d2t"], out, "fr"), out, "static set", "d2t")
    assert_refused(export(selectors, heads["eagle3-d2t"], out, "lowrank"), out, "draft vocabulary", "d2t")
    assert_refused(export(selectors, heads["eagle3"], out, "lowrank"), out, "hidden size")  # selector: 16, head: 32
    assert_refused(export(selectors, heads["speculators"], out, "fr"), out, "speculators", "--format eagle")
    assert_refused(export(selectors, draft, out, "fr", "--size", 8), out, "--size", "vllm")
    assert_refused(run("export", selectors, "--format", "vllm", "--strategy", "fr", "--out", out), out, "--draft")
    assert_refused(export(selectors, draft, out, "fr", "--budget", 10**6), out, "fr needs between")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    assert_one_line_error(export(selectors, draft, taken, "fr"), "not an empty folder")
    assert [p.name for p in taken.iterdir()] == ["x"]


def test_a_tokenizer_of_another_model_is_refused(bundles, tiny_dirs, tmp_path):  # noqa: F811
    from tiny_models import make_tokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_dirs[1], other)
    for item in other.iterdir():
        if "token" in item.name:
            item.unlink()
    make_tokenizer(other, vocab_size=290)
    out = tmp_path / "out"
    assert_refused(export(bundles[0], other, out, "fr"), out, "built for another draft", "tokenizer_sha256")


def test_a_toy_export_format_is_one_table_entry(bundles, tmp_path):
    from dynvocab.artifacts.export import FORMATS, ExportFormat, Exported, register

    def write(bundle, out, request):
        out.write_text(str(request.size))
        return Exported(out, f"toy, {request.size} ids")

    register(ExportFormat("toy", write, "a toy", takes=("size",)))
    try:
        result = run("export", bundles[0], "--format", "toy", "--size", 3, "--out", tmp_path / "t.txt")
        assert result.exit_code == 0 and result.output.strip() == f"wrote {tmp_path / 't.txt'} (toy, 3 ids)"
        assert_one_line_error(run("export", bundles[0], "--format", "toy", "--strategy", "fr", "--out",
                                  tmp_path / "u.txt"), "--strategy does not apply to --format toy")
    finally:
        FORMATS.pop("toy")


def test_the_vllm_format_comes_from_the_serving_room_through_its_entry_point():
    """``artifacts`` never imports ``serving``: the format is the entry point pyproject.toml declares."""
    from importlib import metadata

    from dynvocab.artifacts.export import ENTRY_POINTS, formats

    points = {p.name: p.value for p in metadata.entry_points(group=ENTRY_POINTS)}
    assert points == {"vllm": "dynvocab.serving.vllm.folder:EXPORT_FORMAT"}
    assert formats()["vllm"] is EXPORT_FORMAT


def test_demo_drafts_name_their_demo_target():
    assert demo_target("demo:draft") == "demo:target"
    assert demo_target("demo:gemma-eagle1") == "demo:gemma"
    assert demo_target("/some/folder") is None


def test_a_demo_drafts_folder_names_the_target_folder_to_give_vllm(bundles, tiny_dirs, tmp_path, monkeypatch):  # noqa: F811
    """``--draft demo:draft``: the folder's section and the CLI name demo:target's local folder, vLLM's ``model=``
    (the demo cache is stood in for by the tiny pair: its folders are what ``ensure_demo`` returns)."""
    from dynvocab.models import demo

    monkeypatch.setattr(demo, "ensure_demo", lambda name: {"draft": tiny_dirs[1], "target": tiny_dirs[0]}[name])
    out = tmp_path / "demo-draft"
    result = export(bundles[0], "demo:draft", out, "fr")
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"wrote {out} (vllm, fr, ")
    assert lines[1] == (f'vLLM: model={tiny_dirs[0]}, speculative_config={{"method": "draft_model", '
                        f'"model": "{out}", "use_local_argmax_reduction": true}}')
    assert config_of(out)[names.CONFIG_KEY]["demo_target"] == {"source": "demo:target", "folder": str(tiny_dirs[0])}
    plain = tmp_path / "plain"
    assert not export(bundles[0], tiny_dirs[1], plain, "fr").output.strip().splitlines()[1].startswith("vLLM: model=")
    assert "demo_target" not in config_of(plain)[names.CONFIG_KEY]


def test_export_prints_the_gamma_and_the_batch_size_schedule(bundles, tiny_dirs, tmp_path):  # noqa: F811
    """``--gamma`` and ``--schedule``: the speculative_config export prints carries both (vLLM's ranges), and the
    folder's section records them; a schedule without --gamma, or past it, is one line."""
    out = tmp_path / "scheduled"
    result = run("export", bundles[1], "--format", "vllm", "--strategy", "fr", "--draft", tiny_dirs[1], "--out", out,
                 "--gamma", 3, "--schedule", "1:3,4:0")
    assert result.exit_code == 0, result.output
    spec = json.loads(result.output.strip().splitlines()[1].split("speculative_config=", 1)[1])
    assert spec == {"method": "draft_model", "model": str(out), "num_speculative_tokens": 3,
                    "use_local_argmax_reduction": True,
                    "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 4096, 0]]}
    assert config_of(out)[names.CONFIG_KEY]["speculative_config"] == {
        "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 4096, 0]]}
    assert_one_line_error(run("export", bundles[1], "--format", "vllm", "--strategy", "fr", "--draft", tiny_dirs[1],
                              "--out", tmp_path / "a", "--schedule", "1:3"), "--gamma")
    assert_one_line_error(run("export", bundles[1], "--format", "vllm", "--strategy", "fr", "--draft", tiny_dirs[1],
                              "--out", tmp_path / "b", "--gamma", 2, "--schedule", "1:3"), "0 … 2")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _first_ids(bundle, budget, vocab_size, hidden_size, device):
    return StaticSelector(torch.arange(budget, device=device))


def test_a_batched_strategy_is_one_registry_entry(bundles, tiny_dirs, tmp_path):  # noqa: F811
    """A strategy whose entry says how it runs batched is exported for vLLM (and built by the plugin's head from
    the folder) with no other edit; one without says so in a true refusal."""
    first = Strategy("toy-first", None, lambda options, ctx: None, batched=Batched(("freq",), _first_ids,
                                                                                    lambda bundle, vocab: 5))
    plain = Strategy("toy-plain", None, lambda options, ctx: None)
    for entry in (first, plain):
        register(entry)
    try:
        assert batch_strategies()[-1] == "toy-first" and "toy-plain" not in batch_strategies()
        folder = write_draft_folder(bundles[0], str(tiny_dirs[1]), "toy-first", tmp_path / "toy")
        assert folder.ids == 5 and config_of(folder.path)[names.CONFIG_KEY]["strategy"] == "toy-first"
        cfg = config_of(folder.path)
        with load_bundle(folder.path / names.POLICY_FILE) as policy:
            selector = build_selector(policy, SelectorSpec("toy-first"), cfg["vocab_size"], cfg["hidden_size"])
        assert selector(torch.zeros(2, cfg["hidden_size"])).tolist() == [list(range(5))] * 2
        assert refusal("toy-plain") == ("strategy 'toy-plain' has no batched selector, so it cannot run inside vLLM; "
                                        f"use one of {', '.join(batch_strategies())}")
        out = tmp_path / "plain"
        assert_refused(export(bundles[0], tiny_dirs[1], out, "toy-plain"), out, "has no batched selector")
    finally:
        for entry in (first, plain):
            unregister(entry.name)
    assert refusal("toy-first") is not None
