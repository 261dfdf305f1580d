"""build-index, inspect and export through typer's CliRunner on tiny local models (no hub)."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import assert_one_line_error, run
from tiny_models import corpus_jsonl, tiny_dirs  # noqa: F401  (fixtures)

from dynvocab.artifacts import FreqTable, load_bundle


def build_args(dirs, corpus, out, *extra):
    return ["build-index", "--target", dirs[0], "--draft", dirs[1], "--corpus", corpus, "--out", out,
            "--num-clusters", 8, "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tiny_dirs, corpus_jsonl):  # noqa: F811
    out = tmp_path_factory.mktemp("bundle") / "tiny.safetensors"
    result = run(*build_args(tiny_dirs, corpus_jsonl, out))
    assert result.exit_code == 0, result.output
    for stage in ("corpus:", "freq:", "graph:", "clusters:", "hnsw:", "recall@10", "wrote"):
        assert stage in result.output
    return out


def test_build_writes_all_stages(bundle, tiny_dirs):  # noqa: F811
    b = load_bundle(bundle, verify=True)
    assert b.stages == ["freq", "clusters", "hnsw", "graph", "draft_hnsw"]
    assert b.fingerprints["target"].hidden_size == 32 and b.fingerprints["draft"].hidden_size == 16
    assert b.info("freq")["corpus"]["docs"] == 300
    assert b.info("hnsw")["recall@10"] >= 0.95
    assert b.info("draft_hnsw")["recall@10"] >= 0.95 and b.info("draft_hnsw")["model"] == "draft"
    assert b.info("hnsw")["model"] == "target"
    assert b.config("clusters")["num_clusters"] == 8
    freq = FreqTable.from_bundle(b)
    assert freq.ranking[: freq.eos_ids.numel()].tolist() == freq.eos_ids.tolist()


def test_inspect_json(bundle):
    result = run("inspect", bundle, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output.strip().splitlines()[-1])
    assert set(info["stages"]) == {"freq", "clusters", "hnsw", "graph", "draft_hnsw"}
    assert info["stages"]["graph"]["config"] == {"min_count": 5, "tau": 1e-4, "max_out_degree": 64}
    assert info["stages"]["hnsw"]["bytes"] > 0 and info["stages"]["hnsw"]["info"]["recall@10"] >= 0.95
    assert "index" not in info["stages"]["hnsw"]["tensors"] and "row_map" in info["stages"]["hnsw"]["tensors"]
    assert set(info["stages"]["freq"]["coverage"]) == {"4096", "8192", "16384", "32768"}
    assert info["fingerprint"]["target"]["head_rows"] == info["stages"]["freq"]["tensors"]["counts"]["shape"][0]


def test_inspect_human(bundle):
    result = run("inspect", bundle)
    assert result.exit_code == 0, result.output
    assert "coverage" in result.output and "hnsw" in result.output and "recall@10" in result.output


def test_export_sglang_and_eagle3(bundle, tmp_path):
    b = load_bundle(bundle)
    freq = FreqTable.from_bundle(b)
    result = run("export", bundle, "--format", "sglang", "--size", 64, "--out", tmp_path / "freq_64.pt")
    assert result.exit_code == 0, result.output
    ids = torch.load(tmp_path / "freq_64.pt", weights_only=True)
    assert isinstance(ids, list) and len(ids) == 64 and len(set(ids)) == 64
    assert all(isinstance(i, int) for i in ids) and ids == freq.ranking[:64].tolist()
    assert set(freq.eos_ids.tolist()) <= set(ids)

    result = run("export", bundle, "--format", "eagle3", "--size", 64, "--out", tmp_path / "vocab_map.pt")
    assert result.exit_code == 0, result.output
    m = torch.load(tmp_path / "vocab_map.pt", weights_only=True)
    assert m["d2t"].shape == (64,) and m["t2d"].shape == (b.fingerprints["target"].head_rows,)
    assert sorted((torch.arange(64) + m["d2t"]).tolist()) == sorted(ids)
    assert torch.nonzero(m["t2d"]).flatten().tolist() == sorted(ids)


def test_stages_rebuild_keeps_the_others(bundle, tiny_dirs, corpus_jsonl, tmp_path):  # noqa: F811
    out = tmp_path / "copy.safetensors"
    out.write_bytes(bundle.read_bytes())
    before = load_bundle(out)
    result = run(*build_args(tiny_dirs, corpus_jsonl, out, "--stages", "clusters", "--num-clusters", 5))
    assert result.exit_code == 0, result.output
    assert "kept freq, hnsw, graph" in result.output
    after = load_bundle(out, verify=True)
    assert after.stages == before.stages
    assert after.config("clusters")["num_clusters"] == 5
    for stage in ("freq", "hnsw", "graph"):
        assert after.info(stage) == before.info(stage)
        for name, t in before.stage_tensors(stage).items():
            assert torch.equal(after.tensor(f"{stage}.{name}"), t)


def test_stages_rebuild_refuses_other_models(bundle, tiny_dirs, corpus_jsonl, tmp_path):  # noqa: F811
    out = tmp_path / "copy.safetensors"
    out.write_bytes(bundle.read_bytes())
    swapped = (tiny_dirs[1], tiny_dirs[0])  # draft as target: another hidden size
    result = run(*build_args(swapped, corpus_jsonl, out, "--stages", "freq"))
    assert_one_line_error(result, "different target")
    assert out.read_bytes() == bundle.read_bytes()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_bundle_is_one_line(bundle, tmp_path, damage):
    data = bytearray(bundle.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-100] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    assert_one_line_error(run("inspect", bad), "damaged")
    assert_one_line_error(run("export", bad, "--size", 8, "--out", tmp_path / "x.pt"), "damaged")
    assert not (tmp_path / "x.pt").exists()


def test_bad_inputs_are_one_line(bundle, tiny_dirs, corpus_jsonl, tmp_path):  # noqa: F811
    assert_one_line_error(run(*build_args(tiny_dirs, corpus_jsonl, tmp_path / "o.safetensors", "--stages", "freq,nope")), "nope")
    assert_one_line_error(run(*build_args(tiny_dirs, tmp_path / "missing.jsonl", tmp_path / "o.safetensors")), "does not exist")
    assert_one_line_error(run(*build_args(tiny_dirs, corpus_jsonl, tmp_path / "no" / "o.safetensors")), "does not exist")
    assert_one_line_error(run("export", bundle, "--format", "onnx", "--out", tmp_path / "x.pt"), "onnx")
    assert_one_line_error(run("export", bundle, "--size", 10**7, "--out", tmp_path / "x.pt"), "--size")
    assert_one_line_error(run("inspect", tmp_path / "missing.safetensors"), "does not exist")


def test_missing_freq_stage_for_export(tiny_dirs, corpus_jsonl, tmp_path):  # noqa: F811
    out = tmp_path / "graph_only.safetensors"
    assert run(*build_args(tiny_dirs, corpus_jsonl, out, "--stages", "graph")).exit_code == 0
    assert load_bundle(out).stages == ["graph"]
    assert_one_line_error(run("export", out, "--out", tmp_path / "x.pt"), "no 'freq' stage")


def test_router_stage_is_kept_unless_its_clusters_change(bundle, tiny_dirs, corpus_jsonl, tmp_path):  # noqa: F811
    from dynvocab.artifacts import Stage, write_bundle

    b = load_bundle(bundle)
    router = Stage("router", {"w": torch.ones(3, 2)}, {"hidden": 2}, {})
    out = write_bundle(tmp_path / "r.safetensors", [b.load_stage(s) for s in b.stages] + [router],
                       b.fingerprints["target"], b.fingerprints["draft"])
    assert run(*build_args(tiny_dirs, corpus_jsonl, out, "--stages", "graph")).exit_code == 0
    assert "router" in load_bundle(out).stages
    result = run(*build_args(tiny_dirs, corpus_jsonl, out, "--stages", "clusters"))
    assert result.exit_code == 0 and "dropping stage router" in result.output
    assert load_bundle(out).stages == ["freq", "clusters", "hnsw", "graph", "draft_hnsw"]
