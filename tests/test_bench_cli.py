"""``dynvocab bench`` through CliRunner on tiny local models: files written, embedded tasks, --quick, errors."""

from __future__ import annotations

import csv
import itertools
import json

import pytest
from cli_helpers import assert_one_line_error, run

from dynvocab.bench import stability

pytestmark = pytest.mark.usefixtures("one_thread")


def models(dirs):
    return ["--target", dirs["target"], "--draft", dirs["draft"], "--no-chat-template", "--dtype", "float32"]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"id": "a", "task": "code", "prompt": "w1 w2 w3 w1 w2"}, {"id": "b", "task": "chat", "prompt": "w9 w8"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_bench_writes_json_csv_and_plot(tiny_dirs, prompts, tmp_path):
    out_json, out_csv, out_png = tmp_path / "b.json", tmp_path / "b.csv", tmp_path / "b.png"
    result = run("bench", "--prompts", prompts, "--strategies", "ar,full,hf-lookup", "--max-new-tokens", 6,
                 "--coverage", "--json", out_json, "--csv", out_csv, "--plot", out_png, *models(tiny_dirs))
    assert result.exit_code == 0, result.output
    assert "oracle" in result.output and "hf-lookup" in result.output
    data = json.loads(out_json.read_text())
    assert len(data["generations"]) == 2 * 3
    assert set(data["summary"]) == {"ar", "full", "hf-lookup"}
    assert data["summary"]["full"]["all"]["matches_ar"] == 1.0
    assert data["summary"]["full"]["all"]["target_mass"] == 1.0  # the full vocabulary holds all the mass
    assert set(data["oracle"]) == {"code", "chat", "all"}
    assert all(0 <= g["load"]["others_share"] <= 1 for g in data["generations"])  # the machine's load, every row
    assert data["machine"]["rows_measured"] == 6 and isinstance(data["warnings"], list)
    rows = list(csv.DictReader(out_csv.open()))
    assert {(r["strategy"], r["task"]) for r in rows} == {
        (s, t) for s in ("ar", "full", "hf-lookup", "oracle") for t in ("code", "chat", "all")
    }
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left behind


def readings(others_share: float):
    """A stand-in for ``stability.sample``: each reading 100 machine ticks after the last, ``others_share`` of them
    spent by other processes (none by this one)."""
    count = itertools.count(1)

    def sample() -> stability.LoadSample:
        n = next(count)
        return stability.LoadSample(float(n), (0.5, 0.4, 0.3), round(100 * n * others_share), 100 * n, 0)

    return sample


@pytest.mark.parametrize("others_share", [0.0, 0.3])
def test_a_busy_machine_prints_one_warning_under_the_table(tiny_dirs, prompts, tmp_path, monkeypatch, others_share):
    """The load read around each row (readings in which other processes took ``others_share`` of the machine): the
    JSON records that share; at 10% or more one warning line says the figures are not the method's, and on an idle
    machine nothing says it was busy."""
    monkeypatch.setattr(stability, "sample", readings(others_share))
    out_json = tmp_path / "b.json"
    result = run("bench", "--prompts", prompts, "--strategies", "ar,full", "--max-new-tokens", 4, "--json", out_json,
                 *models(tiny_dirs))
    assert result.exit_code == 0, result.output
    data = json.loads(out_json.read_text())
    assert data["machine"]["others_share_max"] == pytest.approx(others_share)
    busy = [w for w in data["warnings"] if w.startswith("the machine was busy")]
    if others_share:
        assert len(busy) == 1 and "30%" in busy[0]
        assert result.output.count("warning:") == 1 and "the machine was busy" in result.output
    else:
        assert busy == [] and "the machine was busy" not in result.output


def test_bench_seeds_report_spread(tiny_dirs, prompts, tmp_path):
    out = tmp_path / "s.json"
    result = run("bench", "--prompts", prompts, "--ids", "a", "--strategies", "ar,full", "--max-new-tokens", 4,
                 "--temperature", 0.8, "--seeds", "0,1", "--json", out, *models(tiny_dirs))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert sorted({g["seed"] for g in data["generations"]}) == [0, 1]
    assert set(data["summary"]["full"]["all"]["seed_stats"]) >= {"tokens_per_s", "speedup_vs_ar"}


def test_bench_embedded_multiturn(tiny_dirs, tmp_path):
    out = tmp_path / "m.json"
    result = run("bench", "--tasks", "multiturn", "--num-prompts", 1, "--strategies", "ar,full",
                 "--max-new-tokens", 3, "--json", out, *models(tiny_dirs))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [g["id"] for g in data["generations"] if g["strategy"] == "ar"] == ["sg-9/t1", "sg-9/t2", "sg-9/t3"]
    assert data["summary"]["full"]["multiturn"]["matches_ar"] == 1.0


def test_quick_skips_strategies_without_a_ranking(tiny_dirs):
    result = run("bench", "--quick", "--max-new-tokens", 3, *models(tiny_dirs))
    assert result.exit_code == 0, result.output
    assert "skipped fr" in result.output and "skipped hybrid" in result.output
    assert "microspec" in result.output


@pytest.mark.parametrize(
    "args, words",
    [
        (["--strategies", "ar,hf-bogus"], ["unknown strategy", "hf-bogus"]),
        (["--seeds", "0,x"], ["--seeds"]),
        (["--csv", "/no/such/folder/b.csv"], ["does not exist"]),
        (["--tasks", "poetry"], ["unknown task", "poetry"]),
        (["--ids", "sg-10"], ["evaluation split"]),
    ],
)
def test_bench_bad_input_one_line_error(tiny_dirs, args, words):
    result = run("bench", *args, *models(tiny_dirs))
    assert result.exit_code != 0
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for word in words:
        assert word in lines[0]


def test_quick_on_the_default_pair_runs_the_large_vocabulary_demo_too(tiny_dirs, tmp_path, monkeypatch):
    """On bench's default models --quick runs a second table (the 262k demo), its files beside the first's; on other
    models only the one."""
    from dynvocab.cli import bench_run

    target, draft = str(tiny_dirs["target"]), str(tiny_dirs["draft"])
    monkeypatch.setattr(bench_run, "DEFAULT_PAIR", (target, draft))
    real = bench_run.LargeVocabulary
    large = real(target=target, draft=target, strategies="ar,full", num_prompts=1,
                                      max_new_tokens=3, packages=("torch",))
    monkeypatch.setattr(bench_run, "LargeVocabulary", lambda: large)
    out = tmp_path / "q.json"
    result = run("bench", "--quick", "--max-new-tokens", 3, "--json", out, *models(tiny_dirs))
    assert result.exit_code == 0, result.output
    assert "the demo pair" in result.output and "the 262k demo" in result.output
    first, second = json.loads(out.read_text()), json.loads((tmp_path / "q.gemma.json").read_text())
    assert {g["strategy"] for g in first["generations"]} >= {"ar", "full", "microspec"}
    assert {g["strategy"] for g in second["generations"]} == {"ar", "full"}
    assert second["summary"]["full"]["code"]["matches_ar"] == 1.0  # the target drafting for itself

    monkeypatch.setattr(bench_run, "LargeVocabulary", lambda: real(packages=("no_such_package_x",)))
    result = run("bench", "--quick", "--max-new-tokens", 3, *models(tiny_dirs))
    assert result.exit_code == 0 and "the 262k demo is skipped" in result.output

    monkeypatch.setattr(bench_run, "DEFAULT_PAIR", ("demo:target", "demo:draft"))
    result = run("bench", "--quick", "--max-new-tokens", 3, *models(tiny_dirs))
    assert result.exit_code == 0 and "262k" not in result.output


@pytest.mark.parametrize("args, command", [
    (["--kernels"], "dynvocab microbench kernels"),
    (["--policy-steps", "--bundle", "b.safetensors"], "dynvocab microbench policy-steps"),
    (["--eagle-step", "--device", "cpu"], "dynvocab microbench eagle-step"),
    (["--draft-kind", "eagle3"], "dynvocab microbench policy-steps --draft-kind"),
])
def test_the_microbenchmark_flags_moved_to_their_own_command(args, command):
    flag = args[0]
    assert_one_line_error(run("bench", *args), f"bench {flag} moved", f"`{command}`")
    assert flag not in run("bench", "--help").output


def test_lookup_rows_report_their_cycles_and_match_ar(tiny_dirs, tmp_path):
    """``ar+ngram`` (no draft) and ``full+ngram`` beside ``ar``: the same text in float32, the lookup counted in the
    JSON and shown in its own column."""
    out = tmp_path / "b.json"
    result = run("bench", "--strategies", "ar,ar+ngram,full+ngram", "--tasks", "code,chat", "--num-prompts", 1,
                 "--max-new-tokens", 12, "--dtype", "float32", "--json", out, *models(tiny_dirs))
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())["summary"]
    for row in ("ar+ngram", "full+ngram"):
        s = summary[row]["all"]
        assert s["matches_ar"] == 1.0 and s["lookup_cycles"] > 0 and 0 <= s["lookup_accepted"] <= s["lookup_drafted"]
    assert summary["ar+ngram"]["all"]["draft_steps"] == 0
    assert summary["ar"]["all"]["lookup_cycles"] == 0
    assert "lookup" in result.output
