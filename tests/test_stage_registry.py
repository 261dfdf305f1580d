"""The stage registries: a toy bundle stage defined here (its table, one ``BundleStage`` for its readers and one
``StageBuilder`` for build-index) is built by ``build-index --stages toy``, read back, shown by ``inspect``, kept
and dropped like the built-in stages, resumed after a killed build, and made at random for ``microbench
policy-steps``, with no other edit; the registries are left as they were found."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, run
from tiny_models import corpus_jsonl, tiny_dirs  # noqa: F401  (fixtures)

from dynvocab.artifacts import FreqTable, ModelFingerprint, Stage, load_bundle, read_stage, stage_names, write_bundle
from dynvocab.artifacts.stages import BundleStage, adding_commands
from dynvocab.bench.micro.policy_step import bench_context
from dynvocab.builders import stages

TOY_TOP = 16
FAIL = {"toy": False}  # set to make the toy's builder fail, as a build killed half-way


@dataclass(frozen=True)
class ToyTable:
    """The ``toy`` stage: the corpus's most frequent ids, most frequent first."""

    top: torch.Tensor  # [n] int64

    @classmethod
    def from_bundle(cls, bundle) -> "ToyTable":
        return bundle.loaded("toy", lambda: cls(bundle.tensor("toy.top")))


@dataclass(frozen=True)
class ToyConfig:
    size: int = TOY_TOP


def build_toy(inputs: stages.BuildInputs, cfg: ToyConfig) -> stages.Built:
    if FAIL["toy"]:
        raise RuntimeError("killed")
    top = np.argsort(-inputs.counts.unigrams, kind="stable")[: cfg.size]  # [size]
    return stages.Built({"top": torch.from_numpy(top)}, {"ids": cfg.size}, {"corpus": inputs.corpus_info})


def synthetic_toy(spec: stages.Synthetic, made: dict) -> Stage:
    return Stage("toy", {"top": torch.randperm(spec.vocab, generator=spec.generator)[:TOY_TOP]}, {"size": TOY_TOP})


TOY = BundleStage("toy", "the corpus's most frequent ids", made_from=("freq",), table=ToyTable.from_bundle,
                  describe=lambda b: {"first": int(ToyTable.from_bundle(b).top[0])},
                  headline=lambda entry: f"toy: most frequent id {entry['first']}")
TOY_BUILDER = stages.StageBuilder(TOY, ToyConfig, build_toy, needs=(stages.COUNTS,), synthetic=synthetic_toy)


@pytest.fixture
def toy():
    """The toy stage, registered (both halves, by one call) for one test and removed after it."""
    stages.register(TOY_BUILDER)
    try:
        yield TOY_BUILDER
    finally:
        stages.unregister(TOY.name)
        FAIL["toy"] = False


def build_args(dirs, corpus, out, *extra):
    return ["build-index", "--target", dirs[0], "--draft", dirs[1], "--corpus", corpus, "--out", out,
            "--num-clusters", 8, "--device", "cpu", *extra]


def test_the_toy_stage_is_built_read_back_and_inspected(toy, tiny_dirs, corpus_jsonl, tmp_path):  # noqa: F811
    out = tmp_path / "toy.safetensors"
    result = run(*build_args(tiny_dirs, corpus_jsonl, out, "--stages", "toy,freq"))
    assert result.exit_code == 0, result.output
    assert result.output.count("corpus:") == 1 and "toy:" in result.output and "ids 16" in result.output
    bundle = load_bundle(out, verify=True)
    assert bundle.stages == ["freq", "toy"] and bundle.config("toy") == {"size": TOY_TOP}
    counts = FreqTable.from_bundle(bundle).counts
    expected = torch.from_numpy(np.argsort(-counts.numpy(), kind="stable")[:TOY_TOP])
    assert torch.equal(read_stage(bundle, "toy").top, expected)
    assert bundle.info("toy")["corpus"]["docs"] == 300

    result = run("inspect", out, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output.strip().splitlines()[-1])
    assert info["stages"]["toy"]["first"] == int(expected[0]) and info["stages"]["toy"]["tensors"]["top"]["shape"] == [16]
    human = run("inspect", out)
    assert human.exit_code == 0 and f"toy: most frequent id {int(expected[0])}" in human.output


def test_the_toy_stage_is_kept_unless_freq_is_rebuilt(toy, tiny_dirs, corpus_jsonl, tmp_path):  # noqa: F811
    out = tmp_path / "toy.safetensors"
    assert run(*build_args(tiny_dirs, corpus_jsonl, out, "--stages", "freq,toy")).exit_code == 0
    result = run(*build_args(tiny_dirs, corpus_jsonl, out, "--stages", "graph"))
    assert result.exit_code == 0 and "kept freq, toy" in result.output
    result = run(*build_args(tiny_dirs, corpus_jsonl, out, "--stages", "freq"))
    assert result.exit_code == 0 and "dropping stage toy" in result.output
    assert load_bundle(out).stages == ["freq", "graph"]


def test_a_killed_build_resumes_after_its_last_finished_stage(toy, tiny_dirs, corpus_jsonl, tmp_path):  # noqa: F811
    out = tmp_path / "toy.safetensors"
    FAIL["toy"] = True
    killed = run(*build_args(tiny_dirs, corpus_jsonl, out, "--stages", "freq,toy"))
    assert killed.exit_code != 0 and not out.exists()
    assert [p.name.split("-")[0] for p in (tmp_path / ".toy.safetensors.stages").iterdir()] == ["freq"]
    FAIL["toy"] = False
    result = run(*build_args(tiny_dirs, corpus_jsonl, out, "--stages", "freq,toy"))
    assert result.exit_code == 0, result.output
    assert "resuming: freq" in result.output and "freq:" not in result.output and "toy:" in result.output
    assert load_bundle(out, verify=True).stages == ["freq", "toy"]
    assert not (tmp_path / ".toy.safetensors.stages").exists()


def test_the_bench_makes_a_random_toy_stage(toy):
    with bench_context(None, 3000, 32, 0) as ctx:
        assert ctx.bundle.has("toy") and read_stage(ctx.bundle, "toy").top.shape == (TOY_TOP,)
        assert ctx.bundle.has("router") and ctx.bundle.has("hnsw")  # the built-ins' stand-ins are still made


def test_the_registries_refuse_and_restore(toy, tiny_dirs, corpus_jsonl, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="already registered"):
        stages.register(TOY_BUILDER)
    with pytest.raises(ValueError, match="needs weights"):
        stages.register(stages.StageBuilder(BundleStage("bad", "?"), ToyConfig, build_toy, needs=("weights",)))
    assert stages.build_stage_names()[-1] == "toy" and stage_names()[-1] == "toy"
    result = run(*build_args(tiny_dirs, corpus_jsonl, tmp_path / "o.safetensors", "--stages", "nope"))
    assert_one_line_error(result, "nope", "toy")
    stages.unregister("toy")
    assert "toy" not in stages.build_stage_names() and "toy" not in stage_names()
    stages.register(TOY_BUILDER)


def test_the_command_that_adds_a_stage_comes_from_its_entry(tmp_path):
    assert adding_commands(["clusters", "router", "hnsw", "lowrank"], "B") == (
        "`dynvocab build-index --stages clusters,hnsw --out B` and "
        "`dynvocab train-router --selector router,lowrank --bundle B`"
    )
    fp = ModelFingerprint(10, "t", 10, 4, "sha")
    bundle = load_bundle(write_bundle(tmp_path / "b.safetensors", [Stage("freq", {"x": torch.ones(2)}, {})], fp, fp))
    with pytest.raises(Exception, match="add it with `dynvocab train-router --selector router --bundle"):
        bundle.require("router")

