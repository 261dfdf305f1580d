"""Nothing half-written: a build killed with SIGKILL resumes to the same bundle, a flipped byte in any stage is
caught and named, a truncated cache entry is rebuilt, and two processes filling an empty cache both succeed."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_one_line_error, run
from tiny_models import corpus_jsonl, tiny_dirs  # noqa: F401  (fixtures)

from dynvocab.artifacts import load_bundle
from dynvocab.files import write_atomic
from dynvocab.models.cache import MARKER, ensure_entry, entry_problem

REPO = Path(__file__).resolve().parents[1]


def build_args(dirs, corpus, out):
    return ["build-index", "--target", str(dirs[0]), "--draft", str(dirs[1]), "--corpus", str(corpus),
            "--out", str(out), "--num-clusters", "8", "--device", "cpu", "--hnsw-threads", "1"]


def content(path: Path) -> dict:
    """A bundle's content: per stage its config and its tensors' bytes (not the build times)."""
    with load_bundle(path, verify=True) as b:
        return {
            stage: (b.config(stage), {n: bytes(t.contiguous().view(-1).view(torch.uint8).numpy())
                                      for n, t in b.stage_tensors(stage).items()})
            for stage in b.stages
        }


@pytest.fixture(scope="module")
def whole(tmp_path_factory, tiny_dirs, corpus_jsonl):  # noqa: F811
    """An uninterrupted build."""
    out = tmp_path_factory.mktemp("whole") / "b.safetensors"
    result = run(*build_args(tiny_dirs, corpus_jsonl, out))
    assert result.exit_code == 0, result.output
    return out


# The build as `python -m dynvocab` runs it, killed with SIGKILL right after its first stage's checkpoint is written:
# where a kill lands is not left to a race between the build and a poll.
KILLED_AFTER_ONE_STAGE = """
import os, signal
from dynvocab.builders.checkpoints import StageCheckpoints
save = StageCheckpoints.save
def save_then_die(self, stage, config):
    save(self, stage, config)
    os.kill(os.getpid(), signal.SIGKILL)
StageCheckpoints.save = save_then_die
from dynvocab.cli import main
main()
"""


def test_killed_build_resumes_to_the_same_bundle(whole, tiny_dirs, corpus_jsonl, tmp_path):  # noqa: F811
    out = tmp_path / "b.safetensors"
    stages_dir = tmp_path / ".b.safetensors.stages"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = build_args(tiny_dirs, corpus_jsonl, out)
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_ONE_STAGE, *args], env=env, capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()  # nothing half-written where a reader would look
    finished = sorted(p.name.split("-")[0] for p in stages_dir.iterdir() if not p.name.startswith("."))
    assert len(finished) == 1  # it had written part of the work: the one stage it was killed after

    result = subprocess.run([sys.executable, "-m", "dynvocab", *args], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert "resuming: " in result.stderr and finished[0] in result.stderr
    assert content(out) == content(whole)
    assert not stages_dir.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["b.safetensors"]  # no temp file left behind


def flip_byte_in(path: Path, tensor: str, dest: Path) -> Path:
    with load_bundle(path) as b:
        entry = b.entries[tensor]
    data = bytearray(path.read_bytes())
    data[(entry.begin + entry.end) // 2] ^= 0x01
    dest.write_bytes(bytes(data))
    return dest


@pytest.mark.parametrize("stage", ["freq", "clusters", "hnsw", "graph", "draft_hnsw"])
def test_flipped_byte_in_each_stage_is_named(whole, stage, tmp_path, tiny_dirs):  # noqa: F811
    with load_bundle(whole) as b:
        tensor = max(b.tensor_names(stage), key=lambda n: b.entries[f"{stage}.{n}"].nbytes)
    bad = flip_byte_in(whole, f"{stage}.{tensor}", tmp_path / "bad.safetensors")
    assert_one_line_error(run("inspect", bad), f"stage '{stage}' fails its checksum", "rebuild")
    with load_bundle(bad) as b:  # every loader reads stages through the checked tensor reader
        with pytest.raises(Exception, match=f"stage '{stage}' fails its checksum"):
            b.load_stage(stage)
    if stage == "freq":
        assert_one_line_error(run("export", bad, "--out", tmp_path / "m.pt"), "stage 'freq' fails its checksum")
    if stage == "hnsw":
        result = run("generate", "w1 w2", "--target", tiny_dirs[0], "--draft", tiny_dirs[1], "--strategy", "evospec",
                     "--bundle", bad, "--no-chat-template", "--quiet", "--dtype", "float32", "--max-new-tokens", 4)
        assert_one_line_error(result, "stage 'hnsw' fails its checksum")


def test_stage_checksums_are_shown_and_checked(whole, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    info = json.loads(run("inspect", whole, "--json").output.strip().splitlines()[-1])
    assert all(len(st["sha256"]) == 64 for st in info["stages"].values())
    with safe_open(str(whole), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    stages = json.loads(metadata["stages"])
    stages["graph"]["sha256"] = "0" * 64
    metadata["stages"] = json.dumps(stages)
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=metadata)
    assert_one_line_error(run("inspect", bad), "stage 'graph' disagrees with its tensors' checksums")


def test_bundle_without_checksums_still_loads(whole, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(whole), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    del metadata["checksums"]
    metadata["stages"] = json.dumps(
        {k: {key: v[key] for key in ("config", "info")} for k, v in json.loads(metadata["stages"]).items()}
    )
    old = tmp_path / "old.safetensors"
    save_file(tensors, str(old), metadata=metadata)
    result = run("inspect", old, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output.strip().splitlines()[-1])
    assert info["checksums"].startswith("no checksum (built before")
    assert "no checksum (built before" in " ".join(run("inspect", old).output.split())  # rich wraps long paths


def save_tiny(folder: Path) -> None:
    """A stand-in conversion: a tiny model saved as safetensors, as the demo conversion saves its models."""
    from conftest import tiny_qwen2

    tiny_qwen2(vocab=64, layers=1, hidden=16).save_pretrained(folder)


def test_truncated_cache_entry_is_named_and_rebuilt(tmp_path, caplog):
    entry = tmp_path / "cache" / "tiny-0123"
    calls = []
    ensure_entry(entry, lambda f: (calls.append(1), save_tiny(f)), "tiny")
    assert entry_problem(entry) is None and (entry / MARKER).is_file() and len(calls) == 1
    ensure_entry(entry, lambda f: (calls.append(1), save_tiny(f)), "tiny")
    assert len(calls) == 1  # a whole entry is loaded, not rebuilt

    weights = entry / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 100)
    assert "model.safetensors" in entry_problem(entry)
    with caplog.at_level("WARNING"):
        ensure_entry(entry, lambda f: (calls.append(1), save_tiny(f)), "tiny")
    assert len(calls) == 2 and weights.stat().st_size == size
    assert "damaged" in caplog.text and "model.safetensors" in caplog.text

    (entry / MARKER).unlink()  # an entry from before markers: accepted when its headers agree with its sizes
    with open(weights, "r+b") as f:
        f.truncate(size - 1)
    ensure_entry(entry, lambda f: (calls.append(1), save_tiny(f)), "tiny")
    assert len(calls) == 3 and entry_problem(entry) is None


def _convert_slowly(entry: str, log: str) -> None:
    def convert(folder: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        save_tiny(folder)

    ensure_entry(Path(entry), convert, "tiny")


def test_two_processes_fill_an_empty_cache(tmp_path):
    entry, log = tmp_path / "cache" / "tiny-0123", tmp_path / "conversions.log"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_convert_slowly, args=(str(entry), str(log))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(log.read_text().split()) == 1  # one converted, the other found its entry
    assert entry_problem(entry) is None


def test_a_killed_writer_leaves_no_file_and_its_temp_is_swept(tmp_path):
    target = tmp_path / "out.json"
    code = (
        "import os, signal, sys\n"
        "from dynvocab.files import write_atomic\n"
        "def write(tmp):\n"
        "    tmp.write_text('{\"half\": ')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"write_atomic({str(target)!r}, write)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == -signal.SIGKILL
    assert not target.exists() and len(list(tmp_path.iterdir())) == 1  # only the dead writer's temp file
    write_atomic(target, lambda tmp: tmp.write_text("{}"))
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_conversion_killed_half_way_leaves_nothing_to_load(tmp_path):
    entry = tmp_path / "cache" / "tiny-0123"
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "sys.path.insert(0, 'tests')\n"
        "from test_whole_files import save_tiny\n"
        "from dynvocab.models.cache import ensure_entry\n"
        "def convert(folder):\n"
        "    save_tiny(folder)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        f"ensure_entry(Path({str(entry)!r}), convert, 'tiny')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO).returncode == -signal.SIGKILL
    assert entry_problem(entry) == "missing"  # the half-made folder is a temp beside it, never the entry
    calls = []
    ensure_entry(entry, lambda f: (calls.append(1), save_tiny(f)), "tiny")
    assert len(calls) == 1 and entry_problem(entry) is None
    assert sorted(p.name for p in entry.parent.iterdir()) == [".tiny-0123.lock", "tiny-0123"]  # the dead temp swept
