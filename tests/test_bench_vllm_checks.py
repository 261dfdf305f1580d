"""What ``bench --vllm`` decides from the driver's rows, without an engine: greedy acceptance that differs between
rounds ends the run non-zero naming the row (the JSON written first), and the batch-size schedule: given, picked by
``auto`` from the rows, refused in one line, and what ``export`` prints with it; a failed driver's log kept in its
run's folder."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from cli_helpers import assert_one_line_error, run

from dynvocab.bench.engines.vllm import rows as v
from dynvocab.errors import DynvocabError
from dynvocab.serving.vllm.schedule import (format_schedule, parse_schedule, pick_schedule, schedule_ranges)


def _round(wall: float, drafts: int = 10, accepted: int = 6, per_pos=(4, 2)) -> dict:
    return {"wall_s": wall, "new_tokens": 32, "drafts": drafts, "draft_tokens": 20, "accepted_tokens": accepted,
            "accepted_per_pos": list(per_pos), "head": {}, "load": None}


def _row(name: str, rounds: list[dict], users: int = 1) -> dict:
    return {"name": name, "concurrency": users, "token_ids": [[1, 2]], "rounds": rounds}


def test_rounds_with_the_same_acceptance_pass_and_a_differing_row_is_named():
    same = _row("vllm-spec:fr", [_round(1.0), _round(1.3)])  # timing may differ: only a warning elsewhere
    plain = _row("vllm", [_round(1.0, 0, 0, ()), _round(2.0, 0, 0, ())])
    bad = _row("vllm-spec:microspec", [_round(1.0), _round(1.0, accepted=2, per_pos=(2, 0))], users=4)
    assert v.acceptance_mismatches([same, plain]) == []
    found = v.acceptance_mismatches([same, plain, bad])
    assert len(found) == 1
    assert found[0].startswith("vllm-spec:microspec at 4 in flight: round 1: 10 drafts, 6 accepted [4, 2]")
    assert "round 2: 10 drafts, 2 accepted [2, 0]" in found[0]


def test_any_difference_is_a_fault_at_every_level_of_requests_in_flight():
    near_tie = [_round(1.0, 550, 209, (150, 56, 3)), _round(1.0, 553, 207, (152, 53, 2))]  # 2 of 209 accepted
    for users in (1, 4, 8):
        found = v.acceptance_mismatches([_row("vllm-spec", near_tie, users=users)])
        assert found == [f"vllm-spec at {users} in flight: round 1: 550 drafts, 209 accepted [150, 56, 3]; "
                         "round 2: 553 drafts, 207 accepted [152, 53, 2]"]
    bad = _row("vllm-spec:fr", [_round(1.0, 347, 33, (25, 7, 1)), _round(1.0, 224, 157, (104, 42, 11))], users=4)
    assert len(v.acceptance_mismatches([bad])) == 1  # drafts gone bad
    assert v.acceptance_mismatches([_row("vllm-spec", [_round(1.0), _round(1.0), _round(2.0)], users=8)]) == []


def test_the_driver_steps_its_engine_core_in_its_own_process(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert v.engine_env(sys.executable)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a caller's choice is kept
    assert v.engine_env(sys.executable)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_a_schedule_is_vllms_ranges_and_reads_back():
    ranges = parse_schedule("1:3,4:0", 3, 8)
    assert ranges == [[1, 3, 3], [4, 8, 0]]
    assert format_schedule(ranges) == "1:3,4:0"
    assert parse_schedule("1:2", 3, 8) == [[1, 8, 2]]


@pytest.mark.parametrize("text, words", [("2:3", "starts at batch size 1"), ("1:3,1:0", "rise"),
                                         ("1:3,4:1,2:0", "rise"), ("1:5", "0 … 3"), ("1-3", "START:K"),
                                         ("1:3,99:0", "max_num_seqs")])
def test_a_bad_schedule_is_one_line(text, words):
    with pytest.raises(DynvocabError, match=words):
        parse_schedule(text, 3, 8)


def test_auto_speculates_up_to_the_first_level_where_it_stopped_paying():
    assert pick_schedule({1: 1.6, 4: 1.02, 8: 0.8}, 3, 8) == [[1, 7, 3], [8, 8, 0]]
    assert pick_schedule({1: 1.6, 4: 0.9, 8: 1.1}, 3, 8) == [[1, 3, 3], [4, 8, 0]]  # off from the first loss on
    assert pick_schedule({1: 0.9, 4: 0.5}, 3, 8) == [[1, 8, 0]]
    assert pick_schedule({1: 1.3}, 4, 8) == [[1, 8, 4]]
    with pytest.raises(DynvocabError):
        pick_schedule({}, 3, 8)


def test_auto_reads_the_fastest_draft_row_over_plain_at_each_level():
    cfg = v.VllmBench(target="t", draft="d", bundle="b", strategies=("fr",), python="p", gamma=3, concurrency=(1, 4),
                      schedule=v.AUTO)
    rows = [_row("vllm", [_round(2.0)]), _row("vllm", [_round(1.0)], 4),
            _row("vllm-spec:ngram", [_round(0.5)]), _row("vllm-spec:ngram", [_round(0.5)], 4),  # not a draft row
            _row("vllm-spec", [_round(1.6)]), _row("vllm-spec", [_round(1.5)], 4),
            _row("vllm-spec:fr", [_round(1.0)]), _row("vllm-spec:fr", [_round(1.25)], 4)]
    picked = v.resolve_schedule(cfg, rows)
    assert picked["speedups"] == {1: 2.0, 4: 0.8}
    assert picked["ranges"] == [[1, 3, 3], [4, 8, 0]] and picked["text"] == "1:3,4:0"
    assert "1: 2.00×, 4: 0.80×" in picked["why"]
    assert cfg.rows[-3:] == ["vllm-spec:ngram+schedule", "vllm-spec+schedule", "vllm-spec:fr+schedule"]


def test_a_scheduled_request_names_its_rows_and_carries_the_ranges(tmp_path):
    cfg = v.VllmBench(target="t", draft="d", bundle="b", strategies=("fr",), python="p", gamma=3)
    folder = v._PlainFolder(tmp_path, "eagle")
    req = v.request(cfg, [[1, 2, 3]], folder, ["vllm-spec:ngram", "vllm-spec", "vllm-spec:fr"], [[1, 3, 3], [4, 8, 0]])
    assert [r["name"] for r in req["rows"]] == ["vllm-spec:ngram+schedule", "vllm-spec+schedule",
                                                "vllm-spec:fr+schedule"]
    assert {json.dumps(r["speculative_config"]["num_speculative_tokens_per_batch_size"]) for r in req["rows"]} == {
        "[[1, 3, 3], [4, 8, 0]]"}
    assert [r["strategy"] for r in req["rows"][1:]] == [None, "fr"]
    # a draft folder as it is runs vLLM's own class, which has no get_top_tokens for the local-argmax reduction
    assert all("use_local_argmax_reduction" not in r["speculative_config"] for r in req["rows"])


def test_export_takes_a_schedule_as_pairs_or_from_a_bench_json(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"config": {"gamma": 3, "schedule": {"text": "1:3,4:0"}}}))
    assert schedule_ranges(str(bench), 3) == [[1, 3, 3], [4, 4096, 0]]
    with pytest.raises(DynvocabError, match="--gamma 3"):
        schedule_ranges(str(bench), 4)
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(DynvocabError, match="not a `dynvocab bench --vllm --schedule` JSON"):
        schedule_ranges(str(other), 3)


def test_schedule_and_concurrency_without_vllm_are_one_line():
    assert_one_line_error(run("bench", "--schedule", "1:3,4:0"), "--vllm")
    assert_one_line_error(run("bench", "--concurrency", "1,4"), "--vllm")


def test_a_bench_whose_rounds_disagree_exits_non_zero_after_writing_its_json(tiny_dirs, tmp_path, monkeypatch):
    """The CLI with the driver's rows given: the table and JSON as ever, then one line naming the row, exit 1."""
    target, draft = tiny_dirs["target"], tiny_dirs["draft"]
    rows = [_row("vllm", [_round(2.0, 0, 0, ()), _round(2.0, 0, 0, ())]),
            _row("vllm-spec", [_round(1.0), _round(1.0)]),
            _row("vllm-spec:ngram", [_round(1.0), _round(1.0, accepted=1, per_pos=(1, 0))])]
    monkeypatch.setattr(v, "find_vllm_python", lambda path: "python")
    monkeypatch.setattr(v, "run_vllm_rows", lambda cfg, prompts, log=print: (rows, None))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "task": "code", "prompt": "the cat"}\n')
    out = tmp_path / "b.json"
    result = run("bench", "--vllm", "--target", target, "--draft", draft, "--strategies", "ngram", "--prompts", prompts,
                 "--rounds", 2, "--max-new-tokens", 2, "--json", out)
    assert result.exit_code != 0
    assert "vllm-spec:ngram at 1 in flight" in result.output and "vllm-spec at" not in result.output
    data = json.loads(out.read_text())
    assert data["acceptance_mismatches"] == v.acceptance_mismatches(rows)


def test_a_bad_schedule_is_refused_before_any_engine_starts(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(v, "find_vllm_python", lambda path: "python")
    monkeypatch.setattr(v, "run_vllm_rows", lambda *a, **k: pytest.fail("an engine started"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "task": "code", "prompt": "the cat"}\n')
    result = run("bench", "--vllm", "--target", tiny_dirs["target"], "--draft", tiny_dirs["draft"], "--strategies",
                 "ngram", "--prompts", prompts, "--gamma", 3, "--schedule", "2:3")
    assert_one_line_error(result, "starts at batch size 1")


@pytest.mark.parametrize("flag", [("--csv", "x.csv"), ("--plot", "x.png"), ("--seeds", "0,1"), ("--device", "cpu"),
                                  ("--draft-weights", "int8"), ("--threads", "1"), ("--coverage",)])
def test_flags_of_dynvocabs_own_rows_are_refused_beside_vllm(tmp_path, monkeypatch, flag):
    """No flag is silently ignored: those ``--vllm`` has no use for end the run in one line naming them, before the
    driver or an engine starts."""
    monkeypatch.setattr(v, "run_vllm_rows", lambda *a, **k: pytest.fail("an engine started"))
    args = [str(tmp_path / a) if a.startswith("x.") else a for a in flag]
    assert_one_line_error(run("bench", "--vllm", *args), f"{flag[0]} does not apply to --vllm rows")


def test_the_head_timer_waits_for_the_device_off_a_cpu(monkeypatch):
    """On a GPU a call returns before its kernels ran: the timer synchronises the device before and after it."""
    import types

    import torch

    from dynvocab.bench.engines.vllm.worker import _device_sync

    assert _device_sync(torch.zeros(1))() is None
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: waits.append(1))
    _device_sync(types.SimpleNamespace(device=torch.device("cuda")))()
    assert waits == [1]


def test_a_failed_driver_leaves_its_log_beside_its_request_in_the_kept_run_folder(tmp_path):
    """A driver that fails writes vLLM's whole output to ``vllm.log`` in the run's own folder, which stays (with the
    request it ran) and is named in the one-line error; a run that ends otherwise removes its folder."""
    python = tmp_path / "venv" / "bin" / "python"  # a stand-in for the vLLM environment's interpreter
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho 'loading the engine'\necho 'ValueError: no room for the KV cache'\nexit 3\n")
    python.chmod(0o755)
    with pytest.raises(v.DriverFailed) as failed:
        with v.work_folder("dynvocab-test-") as work:
            v.drive(str(python), {"rows": [{"name": "vllm"}]}, work)
    try:
        log = work / "vllm.log"
        assert log.read_text(encoding="utf-8") == "loading the engine\nValueError: no room for the KV cache\n"
        assert json.loads((work / "request.json").read_text()) == {"rows": [{"name": "vllm"}]}
        message = str(failed.value)
        assert "\n" not in message and "exit 3" in message and "no room for the KV cache" in message
        assert str(log) in message
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with v.work_folder("dynvocab-test-") as work:
        (work / "result.json").write_text("{}")
    assert not work.exists()
    with pytest.raises(DynvocabError, match="another failure"):
        with v.work_folder("dynvocab-test-") as work:
            raise DynvocabError("another failure")
    assert not work.exists()


def test_a_run_whose_rows_drafted_without_their_requests_context_fails_naming_them():
    """The worker's count of rows without context (each round's ``head.without_context``) fails the run in one line
    naming the row and level; rows whose count is zero, and rows without a head, pass."""
    ok = {"name": "vllm-spec:microspec", "concurrency": 1, "rounds": [{"head": {"without_context": 0}}]}
    plain = {"name": "vllm", "concurrency": 4, "rounds": [{"head": {}}, {}]}
    bad = {"name": "vllm-spec:hybrid", "concurrency": 4, "rounds": [{"head": {"without_context": 3}},
                                                                    {"head": {"without_context": 2}}]}
    v.check_context([ok, plain])
    assert v.without_context(bad) == 5
    with pytest.raises(DynvocabError) as caught:
        v.check_context([ok, bad])
    message = str(caught.value)
    assert "vllm-spec:hybrid at 4 in flight: 5" in message and "microspec" not in message and "\n" not in message


def test_the_suffix_row_is_vllms_own_draft_free_speculation_in_an_engine_of_its_own(tmp_path):
    """``suffix`` in --strategies: vLLM's suffix decoding (method "suffix", no head to switch), its own engine beside
    ngram's; not a plugin strategy (no bundle stage asked), and never auto's fastest draft row."""
    assert v.plugin_strategies("suffix,ngram", None) == ()
    cfg = v.VllmBench(target="t", draft="d", bundle="b", strategies=("fr",), python="p", gamma=3, suffix=True,
                      concurrency=(1,), schedule=v.AUTO)
    assert cfg.engines() == [["vllm"], ["vllm-spec:ngram"], ["vllm-spec:suffix"], ["vllm-spec", "vllm-spec:fr"]]
    req = v.request(cfg, [[1, 2, 3]], v._PlainFolder(tmp_path, "eagle"), ["vllm-spec:suffix"])
    assert req["rows"] == [{"name": "vllm-spec:suffix", "head": False,
                            "speculative_config": {"method": "suffix", "num_speculative_tokens": 3}}]
    rows = [_row("vllm", [_round(2.0)]), _row("vllm-spec:suffix", [_round(0.5)]), _row("vllm-spec:fr", [_round(1.0)])]
    assert v.resolve_schedule(cfg, rows)["speedups"] == {1: 2.0}  # fr's 2x, not suffix's 4x
    assert v.summarize_row(_row("vllm-spec:suffix", [_round(0.5)]), None)["oracle_tokens_per_s"] is None


def test_the_suffix_row_is_refused_in_one_line_without_arctic_inference_beside_vllm():
    with pytest.raises(DynvocabError) as caught:
        v.check_suffix(sys.executable)  # this environment has no arctic-inference
    assert "arctic-inference" in str(caught.value) and "\n" not in str(caught.value)


def test_the_serve_scripts_schedule_adds_each_speculative_row_again_with_the_ranges():
    """scripts/vllm_serve_bench.py's rows (no vLLM, no server): with ``--schedule`` each row with a draft is
    served again with the schedule's ranges in its speculative_config (vLLM's own ngram row is not)."""
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "vllm_serve_bench.py"
    spec = importlib.util.spec_from_file_location("vllm_serve_bench", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = argparse.Namespace(baselines=["vllm", "ngram"], gamma=3, schedule="1:3,2:0", strategies=["fr"],
                              dtype="float32", max_model_len=256, users=[1, 2], local_argmax=True, draft="d")
    folder = type("Folder", (), {"method": "draft_model", "path": "/f"})()
    served = dict(script.rows(args, lambda strategy: folder))
    assert list(served) == ["vllm", "ngram", "fr", "fr+schedule"]
    config = json.loads(served["fr+schedule"][served["fr+schedule"].index("--speculative-config") + 1])
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 4096, 0]]
    assert config["model"] == "/f" and config["use_local_argmax_reduction"] is True
    assert "--speculative-config" not in served["vllm"]
