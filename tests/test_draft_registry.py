"""The draft registry: a toy draft kind defined here (a proposer, its recogniser, loader and stand-in, one registry
entry) runs through ``generate``, ``bench`` and ``microbench policy-steps --draft-kind`` (``policy_step_bench``)
with no other edit; every draft — the built-in kinds, the toy, bench's stand-ins — satisfies the protocol the loop
drives and policies read; kinds and strategies register from installed packages through entry points; the
registry is left as it was found."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
import torch
from cli_helpers import run

from dynvocab.bench.micro.policy_step import bench_context, policy_step_bench
from dynvocab.bench.micro.scripted import ScriptedDraft
from dynvocab.errors import DynvocabError
from dynvocab.models import resolve_model
from dynvocab.models.rows import FloatRows
from dynvocab.registry import forget_plugins, load_plugins
from dynvocab.runtime import strategies
from dynvocab.runtime.drafts import kinds as drafts
from dynvocab.runtime.drafts.draft import DraftInfo, OwnsHead, Proposer, protocol_gaps
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.eagle_draft import Eagle1Draft, Eagle3Draft
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.heads.active_set import ActiveSet
from dynvocab.runtime.heads.head import DraftHead
from dynvocab.runtime.strategies import Strategy, strategy_names
from dynvocab.runtime.strategies import register as register_strategy
from dynvocab.runtime.strategies import unregister as unregister_strategy

pytestmark = [pytest.mark.transformers_api, pytest.mark.usefixtures("one_thread")]

PROMPT = "w1 w2 w3 w4 w5"
TOY_TYPE = "toy-draft"  # its config.json's model_type
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 3000, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 512}


class ToyDraft(OwnsHead):
    """A draft with no body: the hidden state of a token is its embedding through a fixed random mixing, and the
    head is the target's own (so its rows are target ids). Proposes badly, which is what the tests need: the
    target rejects often and the output must still be the target's."""

    def __init__(self, embedding: torch.Tensor, rows: torch.Tensor, seed: int):
        g = torch.Generator().manual_seed(seed)
        d = embedding.shape[1]
        self.embedding = embedding  # [V, d]
        self.mix = torch.eye(d) + 0.5 * torch.randn(d, d, generator=g) / d**0.5  # [d, d]
        self.step_rows = (rows, None)
        self.length = 0
        self.info = DraftInfo("toy draft", rows.shape[0], d, rows.device, embedding, self.head_rows)

    def reset(self) -> None:
        self.length = 0
        self._forget_head()

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        self.length += ids.numel()
        return self.embedding[ids].float() @ self.mix

    def rollback(self, length: int) -> None:
        self.length = min(self.length, length)

    def observe(self, start, hidden, rows) -> None:
        pass

    def _new_head(self) -> DraftHead:
        return DraftHead(self.head_rows)


def recognize_toy(spec) -> dict | None:
    """The toy's config, where the folder's config.json declares one."""
    config = json.loads((Path(spec.path) / "config.json").read_text())
    return config if config.get("model_type") == TOY_TYPE else None


def load_toy(request: drafts.LoadRequest) -> drafts.LoadedDraft:
    seed = request.found["seed"]
    embedding = request.target_model.get_input_embeddings().weight.detach().float()
    draft = ToyDraft(embedding, request.target.weight.float(), seed)
    return drafts.LoadedDraft(draft, "float32", {"weights": 0, "prepared": 0, "total": 0})


def toy_stand_in(vocab: int, hidden: int, g: torch.Generator) -> DraftInfo:
    rows = torch.randn(vocab, hidden, generator=g)
    return DraftInfo("toy draft", vocab, hidden, torch.device("cpu"), rows, FloatRows(rows))


TOY_KIND = drafts.DraftKind("toy", "toy draft", recognize_toy, load_toy, priority=50, stand_in=toy_stand_in)
PLUGIN_STRATEGY = Strategy("plugged", None, lambda options, ctx: None, dynamic=False, drafts=False)


@pytest.fixture
def toy():
    """The toy kind, registered for one test and removed after it."""
    drafts.register(TOY_KIND)
    try:
        yield TOY_KIND
    finally:
        drafts.unregister(TOY_KIND.name)


@pytest.fixture
def toy_dir(tmp_path):
    folder = tmp_path / "toy"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": TOY_TYPE, "seed": 3}))
    return folder


def models(dirs, draft):
    return ["--target", dirs["target"], "--draft", draft, "--no-chat-template", "--dtype", "float32"]


def test_the_registry_recognises_each_kind(toy, toy_dir, tiny_dirs):
    assert drafts.find_kind(resolve_model(str(toy_dir)))[0] is TOY_KIND
    assert drafts.find_kind(resolve_model(str(tiny_dirs["draft"])))[0].name == "draft-model"  # the catch-all, asked last
    assert [k.name for k in drafts.draft_kinds()][-1] == "draft-model" and "toy" in drafts.kind_names()
    with pytest.raises(ValueError, match="already registered"):
        drafts.register(TOY_KIND)


def test_generate_runs_the_toy_kind(toy, toy_dir, tiny_dirs):
    outs = {}
    for strategy in ("ar", "full", "microspec"):
        result = run("generate", PROMPT, *models(tiny_dirs, toy_dir), "--quiet", "--strategy", strategy,
                     "--max-new-tokens", 12, "--json")
        assert result.exit_code == 0, result.output
        outs[strategy] = json.loads(result.stdout.strip().splitlines()[-1])
    for strategy in ("full", "microspec"):
        assert outs[strategy]["token_ids"] == outs["ar"]["token_ids"], strategy
        assert outs[strategy]["metrics"]["draft_steps"] > 0


def test_bench_runs_the_toy_kind(toy, toy_dir, tiny_dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "task": "code", "prompt": "w1 w2 w3 w1 w2"}))
    out = tmp_path / "bench.json"
    result = run("bench", "--prompts", prompts, "--strategies", "ar,full,microspec", "--max-new-tokens", 8,
                 "--json", out, *models(tiny_dirs, toy_dir))
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert payload["config"]["draft"] == "toy draft"
    assert all(payload["summary"][s]["all"]["matches_ar"] == 1.0 for s in ("full", "microspec"))


def test_policy_steps_read_the_toy_kinds_stand_in(toy):
    result = policy_step_bench(dtypes=("float32",), policies=("microspec",), cycles=3, warmup_cycles=1,
                               target=TINY, threads=1, kind="toy")
    assert result["kind"] == "toy draft"
    assert result["dtypes"]["float32"]["policies"]["microspec"]["head_ms"] > 0
    with pytest.raises(DynvocabError, match="unknown draft kind 'nope'"):
        policy_step_bench(dtypes=("float32",), policies=(), cycles=1, warmup_cycles=1, target=TINY, kind="nope")


def test_every_draft_satisfies_the_protocol(toy, tiny_dirs):
    from test_eagle_loop import eagle1, eagle3
    from conftest import tiny_qwen2

    from dynvocab.models.eagle import LayerTap

    target_model = tiny_qwen2(layers=4, seed=0)
    target = CausalLM(target_model)
    eagle3_model = eagle3(target_model)
    tap = LayerTap(target_model, eagle3_model.config.target_layers(4))
    proposers = [
        DraftModel(tiny_qwen2(layers=2, seed=1)),
        Eagle1Draft(eagle1(target_model), target),
        Eagle3Draft(eagle3_model, target, tap),
        ToyDraft(target_model.get_input_embeddings().weight.detach(), target.weight, 0),
    ]
    try:
        for draft in proposers:
            assert isinstance(draft, Proposer) and protocol_gaps(draft) == [], type(draft).__name__
            assert draft.info.vocab_size == target.vocab_size
            draft.reset()
            hidden = draft.step(torch.tensor([1, 2, 3]))[-1:]
            assert hidden.shape == (1, draft.info.hidden_size)
            logits, cols = draft.head_logits(hidden, ActiveSet.of(torch.tensor([4, 9, 2])))
            assert sorted(cols.tolist()) == sorted(set(cols.tolist())) and set(cols.tolist()) <= {4, 9, 2}
    finally:
        tap.remove()
    for kind in drafts.draft_kinds():  # bench's stand-ins are what policies read of a draft, and nothing more
        assert isinstance(kind.stand_in(TINY["vocab_size"], 32, torch.Generator()), DraftInfo), kind.name
    with bench_context(None, TINY["vocab_size"], 32, 0) as ctx:
        assert isinstance(ctx.draft, DraftInfo)
        assert protocol_gaps(ScriptedDraft(ctx.draft)) == []  # the proposer bench and the policy tests drive


def test_protocol_gaps_name_what_a_draft_lacks():
    class Partial(ToyDraft):
        observe = None

        def rollback(self, n, extra):  # a required parameter the loop does not pass
            pass

    draft = Partial(torch.randn(8, 4), torch.randn(8, 4), 0)
    gaps = protocol_gaps(draft)
    assert any(g.startswith("rollback") for g in gaps) and any(g.startswith("observe") for g in gaps), gaps
    draft.info = "not an info"
    assert any("not a DraftInfo" in g for g in protocol_gaps(draft))


def test_plugins_register_through_entry_points(monkeypatch, toy_dir, tiny_dirs):
    """What an installed package declares (entry points in ``dynvocab.drafts`` / ``dynvocab.strategies``) is
    registered by the same call that registers the built-ins' plugins at import; nothing is installed here."""
    points = {
        drafts.ENTRY_POINTS: [metadata.EntryPoint("toy", "test_draft_registry:TOY_KIND", drafts.ENTRY_POINTS)],
        strategies.ENTRY_POINTS: [metadata.EntryPoint("plugged", "test_draft_registry:PLUGIN_STRATEGY", strategies.ENTRY_POINTS)],
    }
    monkeypatch.setattr(metadata, "entry_points", lambda group: points.get(group, []))
    for group in points:
        forget_plugins(group)
    try:
        assert load_plugins(drafts.ENTRY_POINTS, drafts.register, drafts.DraftKind) == ["toy"]
        assert load_plugins(strategies.ENTRY_POINTS, register_strategy, Strategy) == ["plugged"]
        assert "toy" in drafts.kind_names() and "plugged" in strategy_names()
        assert drafts.find_kind(resolve_model(str(toy_dir)))[0] is TOY_KIND
        result = run("generate", PROMPT, *models(tiny_dirs, toy_dir), "--quiet", "--strategy", "full",
                     "--max-new-tokens", 4, "--json")
        assert result.exit_code == 0, result.output
    finally:
        drafts.unregister(TOY_KIND.name)
        unregister_strategy(PLUGIN_STRATEGY.name)
        for group in points:
            forget_plugins(group)
    assert "toy" not in drafts.kind_names() and "plugged" not in strategy_names()


def test_a_broken_plugin_is_refused_in_one_line(monkeypatch):
    point = metadata.EntryPoint("broken", "no_such_module_here:THING", drafts.ENTRY_POINTS)
    monkeypatch.setattr(metadata, "entry_points", lambda group: [point])
    forget_plugins(drafts.ENTRY_POINTS)
    try:
        with pytest.raises(DynvocabError, match="plugin 'broken'.*failed to load"):
            load_plugins(drafts.ENTRY_POINTS, drafts.register, drafts.DraftKind)
    finally:
        forget_plugins(drafts.ENTRY_POINTS)
