"""The bundle: round trip, validation of damaged files, model checks, atomic writes, export formats."""

from __future__ import annotations

import json

import pytest
import torch

from dynvocab.artifacts import (
    FreqTable,
    GraphTable,
    ModelFingerprint,
    Stage,
    eagle3_mapping,
    load_bundle,
    sglang_token_map,
    write_bundle,
)
from dynvocab.artifacts import bundle as bundle_mod
from dynvocab.errors import DynvocabError

TARGET = ModelFingerprint(vocab_size=100, tokenizer_sha256="a" * 64, head_rows=104, hidden_size=8, source="t")
DRAFT = ModelFingerprint(vocab_size=100, tokenizer_sha256="a" * 64, head_rows=104, hidden_size=4, source="d")


def freq_stage() -> Stage:
    counts = torch.arange(104, dtype=torch.int64).flip(0)  # [104], id 0 most frequent
    ranking = torch.cat([torch.tensor([103]), torch.arange(103)])  # end token 103 first
    table = FreqTable(counts, ranking, torch.tensor([103]))
    return Stage("freq", table.to_tensors(), {"coverage_sizes": [4, 8]}, {"corpus": {"sources": ["x"]}})


def graph_stage() -> Stage:
    table = GraphTable(
        indptr=torch.tensor([0, 2, 3] + [3] * 102, dtype=torch.int64),
        indices=torch.tensor([1, 2, 0], dtype=torch.int32),
        probs=torch.tensor([0.6, 0.4, 1.0]),
    )
    return Stage("graph", table.to_tensors(), {"min_count": 5}, {})


@pytest.fixture
def bundle_path(tmp_path):
    path = tmp_path / "b.safetensors"
    write_bundle(path, [freq_stage(), graph_stage()], TARGET, DRAFT)
    return path


def test_round_trip(bundle_path):
    b = load_bundle(bundle_path, verify=True)
    assert b.stages == ["freq", "graph"]
    assert b.fingerprints["target"] == TARGET and b.fingerprints["draft"] == DRAFT
    assert b.config("freq") == {"coverage_sizes": [4, 8]}
    assert b.info("freq")["corpus"] == {"sources": ["x"]}
    for stage in (freq_stage(), graph_stage()):
        got = b.stage_tensors(stage.name)
        assert set(got) == set(stage.tensors)
        for name, t in stage.tensors.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    graph = GraphTable.from_bundle(b)
    ids, probs = graph.successors(0)
    assert ids.tolist() == [1, 2] and probs.tolist() == pytest.approx([0.6, 0.4])
    assert graph.successors(0, k=1)[0].tolist() == [1]
    assert b.metadata["format_version"] == 1


def test_metadata_is_strings_with_json(bundle_path):
    from safetensors import safe_open

    with safe_open(str(bundle_path), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "dynvocab-bundle"
    assert json.loads(meta["stages"])["graph"]["config"] == {"min_count": 5}
    assert json.loads(meta["fingerprint"])["draft"]["hidden_size"] == 4


def test_missing_stage_is_one_line(bundle_path):
    b = load_bundle(bundle_path)
    with pytest.raises(DynvocabError, match="no 'hnsw' stage.*--stages hnsw"):
        b.require("hnsw")


def test_truncated_file(bundle_path):
    data = bundle_path.read_bytes()
    for cut in (4, 100, len(data) - 1):
        bundle_path.write_bytes(data[:cut])
        with pytest.raises(DynvocabError, match="damaged") as exc:
            load_bundle(bundle_path)
        assert "\n" not in str(exc.value)


def test_flipped_data_byte_fails_checksum(bundle_path):
    data = bytearray(bundle_path.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's data
    bundle_path.write_bytes(bytes(data))
    b = load_bundle(bundle_path)  # the header is intact
    with pytest.raises(DynvocabError, match="stage 'graph' fails its checksum"):
        b.verify()
    with pytest.raises(DynvocabError, match="damaged"):
        load_bundle(bundle_path, verify=True)


def test_flipped_header_byte(bundle_path):
    data = bytearray(bundle_path.read_bytes())
    data[12] ^= 0xFF  # inside the JSON header
    bundle_path.write_bytes(bytes(data))
    with pytest.raises(DynvocabError, match="damaged|not a dynvocab bundle"):
        load_bundle(bundle_path)


def test_not_a_bundle_and_missing(tmp_path):
    from safetensors.torch import save_file

    other = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(3)}, str(other))
    with pytest.raises(DynvocabError, match="not a dynvocab bundle"):
        load_bundle(other)
    with pytest.raises(DynvocabError, match="does not exist"):
        load_bundle(tmp_path / "nope.safetensors")


def test_newer_format_version_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_mod, "FORMAT_VERSION", 99)
    path = write_bundle(tmp_path / "future.safetensors", [freq_stage()], TARGET, DRAFT)
    monkeypatch.setattr(bundle_mod, "FORMAT_VERSION", 1)
    with pytest.raises(DynvocabError, match="upgrade dynvocab"):
        load_bundle(path)


def test_check_models_names_the_model(bundle_path):
    b = load_bundle(bundle_path)
    b.check_models(TARGET, DRAFT)
    b.check_models(TARGET)
    other_draft = ModelFingerprint(100, "a" * 64, 104, 16, "other")
    with pytest.raises(DynvocabError, match="different draft.*hidden_size") as exc:
        b.check_models(TARGET, other_draft)
    assert "\n" not in str(exc.value)
    other_target = ModelFingerprint(100, "b" * 64, 104, 8, "t2")
    with pytest.raises(DynvocabError, match="different target.*tokenizer_sha256"):
        b.check_models(other_target, DRAFT)


def test_interrupted_write_keeps_the_old_bundle(bundle_path, monkeypatch):
    import safetensors.torch

    before = bundle_path.read_bytes()

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        write_bundle(bundle_path, [graph_stage()], TARGET, DRAFT)
    assert bundle_path.read_bytes() == before
    assert [p.name for p in bundle_path.parent.iterdir()] == [bundle_path.name]


def test_exports():
    freq = FreqTable(
        counts=torch.tensor([5, 9, 0, 7, 1]),
        ranking=torch.tensor([4, 1, 3, 0, 2]),  # end token 4 first
        eos_ids=torch.tensor([4]),
    )
    assert sglang_token_map(freq, 3) == [4, 1, 3]
    m = eagle3_mapping(freq, 3)
    assert m["d2t"].dtype == torch.int64 and m["t2d"].dtype == torch.bool
    kept = torch.arange(3) + m["d2t"]  # target id = draft index + d2t[draft index]
    assert kept.tolist() == [1, 3, 4]
    assert m["t2d"].tolist() == [False, True, False, True, True]
    with pytest.raises(DynvocabError, match="--size"):
        sglang_token_map(freq, 6)
    two_ends = FreqTable(freq.counts, freq.ranking, torch.tensor([4, 2]))
    with pytest.raises(DynvocabError, match="end tokens"):
        sglang_token_map(two_ends, 1)


def test_an_open_bundle_survives_its_file_being_replaced(bundle_path):
    with load_bundle(bundle_path) as b:
        write_bundle(bundle_path, [graph_stage()], TARGET, DRAFT)  # a rebuild replaces the path
        assert torch.equal(b.tensor("freq.ranking"), freq_stage().tensors["ranking"])
    assert load_bundle(bundle_path).stages == ["graph"]


def test_written_files_get_the_usual_permissions(bundle_path):
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert bundle_path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would create it, not mkstemp's 0600
