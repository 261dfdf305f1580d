"""The strategy registry: a toy strategy defined here (a VocabPolicy subclass, its config and one registry entry)
runs through make_policy, ``generate``, ``bench`` and ``microbench policy-steps`` (``policy_step_bench``) with no
other edit, its flag included, and the registry is left as it was found."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from cli_helpers import assert_one_line_error, run

from dynvocab.bench.micro.policy_step import policy_rows, policy_step_bench
from dynvocab.errors import DynvocabError
from dynvocab.runtime.heads.active_set import ActiveSet
from dynvocab.runtime.selection import VocabPolicy
from dynvocab.runtime.strategies import (
    Batched,
    Flag,
    PolicyContext,
    Strategy,
    StrategyOptions,
    check_strategy,
    make_policy,
    register,
    strategies,
    strategy_flags,
    unregister,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "w1 w2 w3 w4 w5"
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 3000, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 512}


@dataclass(frozen=True)
class ToyConfig:
    """The toy's one knob."""

    size: int = 40  # ids active at first: 0 … size-1


class ToyPolicy(VocabPolicy):
    """The first ``size`` ids and EOS, joined by every emitted token: a set that follows the context."""

    name = "toy"

    def __init__(self, cfg: ToyConfig, vocab_size: int, eos: torch.Tensor, device):
        self.vocab_size = vocab_size
        self.ids = torch.unique(torch.cat([torch.arange(min(cfg.size, vocab_size)), eos])).to(device)  # [n]

    def active_ids(self, step, hidden=None, token=None) -> ActiveSet:
        return ActiveSet.of(self.ids)

    def observe(self, cycle) -> None:
        emitted = torch.tensor([t for t in cycle.emitted if t < self.vocab_size], dtype=torch.long)
        self.ids = torch.unique(torch.cat([self.ids, emitted.to(self.ids.device)]))


def make_toy(options: StrategyOptions, ctx: PolicyContext) -> ToyPolicy:
    return ToyPolicy(options.config(ToyConfig), ctx.vocab_size, ctx.eos, ctx.device)


TOY = Strategy("toy", ToyConfig, make_toy, flags=(Flag("toy_size", "ids active at first.", attr="size", min=1),))


@pytest.fixture
def toy():
    """The toy strategy, registered for one test and removed after it."""
    register(TOY)
    try:
        yield TOY
    finally:
        unregister(TOY.name)


def models(dirs):
    return ["--target", dirs["target"], "--draft", dirs["draft"], "--no-chat-template", "--dtype", "float32"]


def test_make_policy_builds_the_toy(toy):
    policy = make_policy("toy", StrategyOptions(configs=(ToyConfig(size=10),)), PolicyContext(96, {95}))
    assert isinstance(policy, ToyPolicy)
    assert policy.active_ids(0).ids().tolist() == [*range(10), 95]
    assert make_policy("toy", StrategyOptions(), PolicyContext(96, {95})).active_ids(0).size == 41


def test_generate_runs_the_toy_with_its_flag(toy, tiny_dirs):
    outs = {}
    for strategy, extra in (("ar", []), ("toy", ["--toy-size", 30])):
        result = run("generate", PROMPT, *models(tiny_dirs), "--quiet", "--strategy", strategy,
                     "--max-new-tokens", 10, "--json", *extra)
        assert result.exit_code == 0, result.output
        outs[strategy] = json.loads(result.stdout.strip().splitlines()[-1])
    toy_run = outs["toy"]
    assert toy_run["strategy"] == "toy" and toy_run["token_ids"] == outs["ar"]["token_ids"]
    # --toy-size 30 reached the policy: 30 ids and EOS at first, then the emitted tokens join
    assert 31 <= toy_run["metrics"]["mean_active_vocab"] <= 31 + len(toy_run["token_ids"])


def test_bench_runs_the_toy(toy, tiny_dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "task": "code", "prompt": "w1 w2 w3 w1 w2"}))
    out = tmp_path / "bench.json"
    result = run("bench", "--prompts", prompts, "--strategies", "ar,toy", "--max-new-tokens", 6, "--toy-size", 20,
                 "--json", out, *models(tiny_dirs))
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"ar", "toy"} and summary["toy"]["all"]["matches_ar"] == 1.0
    assert summary["toy"]["all"]["mean_active_vocab"] >= 21


def test_policy_steps_time_the_toy(toy):
    assert "toy" in policy_rows()
    result = policy_step_bench(dtypes=("float32",), policies=("microspec", "toy"), cycles=3, warmup_cycles=1,
                               target=TINY, threads=1)
    row = result["dtypes"]["float32"]["policies"]["toy"]
    assert row["head_ms"] > 0 and 41 <= row["mean_active"] <= TINY["vocab_size"]


def test_register_then_unregister_leaves_the_registry_as_it_was(tiny_dirs):
    before, flags_before = strategies(), strategy_flags()
    register(TOY)
    try:
        assert strategies() == (*before, TOY)
        with pytest.raises(ValueError, match="registered already"):
            register(TOY)
    finally:
        unregister(TOY.name)
    assert strategies() == before and strategy_flags() == flags_before and "toy" not in policy_rows()
    with pytest.raises(DynvocabError, match="unknown strategy 'toy'"):
        check_strategy("toy")
    result = run("generate", PROMPT, *models(tiny_dirs), "--strategy", "toy", "--toy-size", 3)
    assert result.exit_code != 0 and "No such option: --toy-size" in result.output


def test_a_shared_flag_must_be_declared_alike():
    clash = Strategy("toy", ToyConfig, make_toy, flags=(Flag("k_pre", "another meaning.", attr="size", min=1),))
    with pytest.raises(ValueError, match="flag 'k_pre' of 'toy' differs"):
        register(clash)
    assert "toy" not in {s.name for s in strategies()}


def test_a_flag_must_set_a_config_field():
    with pytest.raises(ValueError, match="sets no field"):
        Strategy("toy", ToyConfig, make_toy, flags=(Flag("toy_width", "no such field."),))
    assert_one_line_error(run("generate", PROMPT, "--strategy", "toy"), "unknown strategy 'toy'")


def test_a_batched_budget_must_come_from_a_flag_of_the_strategy():
    toy = dict(flags=(Flag("toy_size", "ids active at first.", attr="size", min=1),))
    with pytest.raises(ValueError, match="budget flag 'toy_width' is none of its flags"):
        Strategy("toy", ToyConfig, make_toy, **toy, batched=Batched((), make_toy, len, budget_flags=("toy_width",)))
    budget = ("toy_size", "fr_size")  # its own flag, then the shared --fr-size
    entry = Strategy("toy", ToyConfig, make_toy, **toy, batched=Batched((), make_toy, len, budget_flags=budget))
    assert entry.batched.budget_flags == ("toy_size", "fr_size")
