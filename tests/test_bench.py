"""Bench internals: embedded tasks (evaluation split only), replay, hf rows, the coverage recorder, summary maths."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from dynvocab.bench.engines.hf import accepted_per_cycle
from dynvocab.bench.loop import runner as bench
from dynvocab.bench.loop.items import MAX_CHARS, BenchItem, clip, trim_history
from dynvocab.bench.loop.recorder import PolicyRecorder
from dynvocab.bench.loop.runner import BenchConfig, run_bench
from dynvocab.bench.loop.summary import EXTRA_KEYS, oracle_summary, summarize_bench
from dynvocab.bench.loop.tasks import embedded_items, file_items, is_code_like, topic_switch_item
from dynvocab.errors import DynvocabError
from dynvocab.runtime.decoding.loop import DecodeConfig
from dynvocab.runtime.decoding.metrics import Metrics
from dynvocab.runtime.heads.active_set import ActiveSet
from dynvocab.runtime.selection.base import CycleReport, VocabPolicy

pytestmark = [pytest.mark.transformers_api, pytest.mark.usefixtures("one_thread")]

# --- tasks ------------------------------------------------------------------------------------------------------


def _position(item_id: str) -> int:
    return int(item_id.split("/")[0].removeprefix("sg-"))


def test_code_task_reads_humaneval_offline():
    items = embedded_items(["code"], 3)
    assert [i.id for i in items] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "def has_close_elements" in items[0].messages[0]["content"]
    assert all(i.task == "code" and i.turns == 1 for i in items)


def test_sharegpt_tasks_use_the_evaluation_split_only():
    from dynvocab.data.sharegpt import sharegpt_records, to_messages

    chat = embedded_items(["chat"], 12)
    multi = embedded_items(["multiturn"], 4)
    positions = {_position(i.id) for i in chat + multi}
    assert positions and all(p % 10 == 9 for p in positions)  # never a training-split conversation
    records = dict(itertools.islice(sharegpt_records(), max(positions) + 1))
    for item in chat + multi:  # the id names the conversation the prompt really comes from
        users = [m["content"] for m in to_messages(records[_position(item.id)]) if m["role"] == "user"]
        assert item.messages[0]["content"] == clip(users[0])
        assert list(item.followups) == [clip(u) for u in users[1 : item.turns]]
    assert all(i.turns >= 2 for i in multi)
    assert all(len(m["content"]) <= MAX_CHARS + 2 for i in chat for m in i.messages)


def test_topic_switch_is_code_then_chat():
    item = topic_switch_item(2)
    assert item.turns == 4 and item.labels == ("code", "code", "chat", "chat")
    assert "```python" in item.messages[0]["content"]
    assert not any(is_code_like(t) for t in item.followups[2:])
    assert [item.row_id(t) for t in range(4)] == ["switch/t1", "switch/t2", "switch/t3", "switch/t4"]


def test_ids_select_items_and_unknown_ids_fail():
    items = embedded_items(["chat", "multiturn"], 1, ids=["sg-9/t2"])
    assert {(i.task, i.id) for i in items} == {("chat", "sg-9"), ("multiturn", "sg-9")}
    with pytest.raises(DynvocabError, match="evaluation split"):
        embedded_items(["chat"], 1, ids=["sg-8"])  # a training-split conversation
    with pytest.raises(DynvocabError, match="HumanEval/999"):
        embedded_items(["code", "chat"], 1, ids=["HumanEval/999"])
    with pytest.raises(DynvocabError, match="unknown task"):
        embedded_items(["poetry"], 1)


def test_file_items_replay_spec_bench_turns(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        {"question_id": 82, "category": "writing", "turns": ["Write a story."]},
        {"id": "c", "task": "code", "prompt": "x" * 5000},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    items = file_items(path)
    assert items[0].followups == ("Now shorter.",) and items[0].row_id(1) == "81/t2"
    assert items[1].turns == 1 and items[1].row_id(0) == "82"
    assert [i.id for i in file_items(path, n=1)] == ["81", "c"]  # first N per task
    assert [i.id for i in file_items(path, ids=["81/t2"])] == ["81"]


def test_history_is_trimmed_from_the_oldest_turns():
    msgs = [{"role": "system", "content": "s"}] + [
        {"role": r, "content": f"{r}{i}" * 10} for i in range(3) for r in ("user", "assistant")
    ][:-1]
    out = trim_history(msgs, 60)
    assert out[0]["role"] == "system" and out[-1] == msgs[-1] and out[1]["role"] == "user"
    assert len(out) < len(msgs)
    item = BenchItem("x", "t", ({"role": "user", "content": "u1"},), ("u2", "u3"))
    assert item.context(2, ["a1", "a2"]) == [
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
    ]


# --- runs on tiny models -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def session(tiny_dirs):
    from dynvocab.runtime.session import ModelConfig, Session

    return Session(ModelConfig(str(tiny_dirs["target"]), str(tiny_dirs["draft"]), "cpu", "float32"))


def _cfg(strategies, **kw):
    decode = DecodeConfig(gamma=3, max_new_tokens=kw.pop("max_new_tokens", 10), stop_below=kw.pop("stop_below", 0.4))
    return BenchConfig(strategies=tuple(strategies), decode=decode, chat_template=False, **kw)


REPLAY = BenchItem("conv", "multiturn", ({"role": "user", "content": "w1 w2 w3"},), ("w4 w5", "w6"))


@pytest.mark.parametrize("strategies, source", [(("full", "ar"), "ar"), (("full", "hf-lookup"), None)])
def test_multiturn_feeds_answers_back(session, monkeypatch, strategies, source):
    seen = []
    encode = bench.encode_prompt
    def spy(tokenizer, messages, template):
        seen.append(list(messages))
        return encode(tokenizer, messages, template)

    monkeypatch.setattr(bench, "encode_prompt", spy)
    out = run_bench(session, [REPLAY], _cfg(strategies, warmup_tokens=0))  # every encoded prompt a timed row's
    rows = {(g["id"], g["strategy"]): g for g in out["generations"]}
    assert [g["id"] for g in out["generations"]][:2] == ["conv/t1", "conv/t1"]
    assert out["generations"][0]["strategy"] == ("ar" if source == "ar" else "full")  # ar runs first
    for msgs, g in zip(seen, out["generations"]):
        turn, strategy = g["turn"], g["strategy"]
        answers = [rows[(f"conv/t{t}", source or strategy)]["text"] for t in range(1, turn)]
        assert [m["content"] for m in msgs if m["role"] == "assistant"] == answers
        assert [m["content"] for m in msgs if m["role"] == "user"] == ["w1 w2 w3", "w4 w5", "w6"][:turn]


def test_every_row_is_warmed_once_untimed_before_the_timed_rows(session, monkeypatch):
    calls = []
    generate = bench.generate_row

    def spy(session_, strategy, prompt_ids, decode, cfg):
        calls.append((strategy, decode.max_new_tokens))
        return generate(session_, strategy, prompt_ids, decode, cfg)

    monkeypatch.setattr(bench, "generate_row", spy)
    items = [BenchItem("a", "code", ({"role": "user", "content": "w1 w2 w3"},)),
             BenchItem("b", "chat", ({"role": "user", "content": "w4 w5"},))]
    out = run_bench(session, items, _cfg(("full", "ar"), warmup_tokens=3))
    assert calls[:2] == [("ar", 3), ("full", 3)]  # warm-up: each row once, short
    assert calls[2:] == [("ar", 10), ("full", 10)] * 2  # then the timed rows, as without a warm-up
    assert len(out["generations"]) == 4 and out["config"]["warmup_tokens"] == 3
    cold = run_bench(session, items, _cfg(("full", "ar"), warmup_tokens=0))
    assert [g["token_ids"] for g in cold["generations"]] == [g["token_ids"] for g in out["generations"]]


@pytest.mark.parametrize("stop_below", [0.0, 0.4])
def test_hf_rows_match_ar_in_float32(session, stop_below):
    item = BenchItem("p", "code", ({"role": "user", "content": "w1 w2 w3 w4 w1 w2"},))
    cfg = _cfg(("ar", "full", "hf-assisted", "hf-lookup"), max_new_tokens=12, stop_below=stop_below)
    out = run_bench(session, [item], cfg)
    tokens = {g["strategy"]: g["token_ids"] for g in out["generations"]}
    assert tokens["hf-assisted"] == tokens["ar"] == tokens["full"] == tokens["hf-lookup"]
    keys = set(out["generations"][0]["metrics"])
    for g in out["generations"]:
        assert set(g["metrics"]) == keys  # every metrics key on every row, None where it does not exist
    hf = next(g for g in out["generations"] if g["strategy"] == "hf-assisted")["metrics"]
    assert hf["cycles"] >= 1 and hf["mean_active_vocab"] is None and hf["prefill_s"] is None
    assert hf["leaves"] is None and hf["leaf_hits"] is None  # transformers verifies chains only
    full = next(g for g in out["generations"] if g["strategy"] == "full")["metrics"]
    if stop_below == 0.0:  # always γ draft tokens, as our loop drafts them
        assert len(hf["accept_by_position"]) == 3 and hf["draft_steps"] == 3 * hf["cycles"]
    else:  # the same confidence stop ends drafts early in both
        assert hf["draft_steps"] < 3 * hf["cycles"] and full["draft_steps"] < 3 * full["cycles"]
    assert out["summary"]["hf-assisted"]["all"]["matches_ar"] == 1.0


def test_quick_skips_rows_it_cannot_build(session):
    cfg = _cfg(("ar", "full", "fr"))
    kept, notes = bench.runnable_strategies(session, cfg, skip=True)
    assert kept.strategies == ("ar", "full") and "fr" in notes[0]
    with pytest.raises(DynvocabError, match="frequency ranking"):
        bench.runnable_strategies(session, cfg, skip=False)


def test_parse_rows():
    assert bench.parse_rows("ar, hf-assisted,full") == ["ar", "hf-assisted", "full"]
    assert bench.parse_rows("hf-lookup") == ["hf-lookup"]
    with pytest.raises(DynvocabError, match="unknown strategy"):
        bench.parse_rows("ar,hf-nope")
    with pytest.raises(DynvocabError, match="twice"):
        bench.parse_rows("ar,ar")
    assert not bench.needs_draft(["ar", "hf-lookup"]) and bench.needs_draft(["ar", "hf-assisted"])


# --- the coverage recorder ----------------------------------------------------------------------------------------


class _Steps(VocabPolicy):
    """Hands out fixed active sets per draft step and counts observes."""

    def __init__(self, sets):
        self.sets, self.observed = sets, 0

    def active_ids(self, step, hidden=None, token=None):
        return self.sets[step]

    def observe(self, cycle):
        self.observed += 1


def test_recorder_scores_on_path_positions():
    vocab = 8
    sets = [ActiveSet.of(torch.tensor([0, 1])), ActiveSet.of(torch.tensor([2]), torch.tensor([3, 4])), ActiveSet.full(vocab)]
    inner = _Steps(sets)
    rec = PolicyRecorder(inner, coverage=True, ks=(1, 2))
    assert [rec.active_ids(j) is sets[j] for j in range(3)] == [True, True, True]  # the very same objects
    logits = torch.full((4, vocab), -1e9)
    logits[0, [0, 5]] = torch.log(torch.tensor([0.75, 0.25]))  # top-1 (0) inside {0,1}; top-2 half inside
    logits[1, [7, 3]] = torch.log(torch.tensor([0.6, 0.4]))  # top-1 (7) outside {2,3,4}; mass 0.4
    logits[2, 0] = 0.0  # position 2 is off the accepted path (accepted = 1): not scored
    cycle = CycleReport(10, [0, 3, 1], [], 1, [0, 9], logits, torch.zeros(4, 2), sets)
    rec.observe(cycle)
    assert inner.observed == 1
    assert rec.mass == pytest.approx([0.75, 0.4])
    assert rec.hits[1] == [1.0, 0.0] and rec.hits[2] == [0.5, 0.5]
    m = rec.metrics()
    assert m["max_active_vocab"] == vocab and m["target_mass"] == pytest.approx(0.575)
    assert m["recall_at_1"] == 0.5 and m["scored_positions"] == 2
    assert set(EXTRA_KEYS) <= set(m)


def _dummy_report(gamma: int = 2, vocab: int = 16, dim: int = 4, sets=()) -> CycleReport:
    """A well-formed cycle report: one of ``gamma`` drafts accepted, then a correction."""
    return CycleReport(
        position=3,
        draft_tokens=list(range(gamma)),
        draft_top=[],
        accepted=1,
        emitted=[0, 5],
        target_logits=torch.zeros(gamma + 1, vocab),
        target_hidden=torch.zeros(gamma + 1, dim),
        active_sets=sets,
    )


def test_recorder_without_coverage_only_sizes():
    sets = [ActiveSet.of(torch.arange(5)), ActiveSet.of(torch.arange(3))]
    rec = PolicyRecorder(_Steps(sets))
    rec.active_ids(0), rec.active_ids(1)
    rec.observe(_dummy_report(gamma=2, vocab=100, sets=sets))
    m = rec.metrics()
    assert m["max_active_vocab"] == 5 and m["target_mass"] is None and rec.mass == []


# --- summary maths --------------------------------------------------------------------------------------------------


def _row(pid, task, strategy, tokens, wall, cycles, head=0.0, ids=None, seed=0):
    m = Metrics(new_tokens=tokens, cycles=cycles, wall_s=wall, head_s=head, draft_s=2 * head,
                tokens_per_s=tokens / wall, mean_accepted_length=tokens / cycles).as_dict()
    m.update({k: None for k in EXTRA_KEYS})
    return {"id": pid, "task": task, "strategy": strategy, "token_ids": ids or [1, 2], "metrics": m, "seed": seed}


def test_summary_speedups_std_and_oracle():
    gens = [
        _row("a", "code", "ar", 10, 10.0, 10), _row("b", "chat", "ar", 10, 5.0, 10),
        _row("a", "code", "full", 10, 5.0, 4, head=1.0), _row("b", "chat", "full", 10, 5.0, 5, head=1.0, ids=[9]),
    ]
    s = summarize_bench(gens, ("ar", "full"))
    assert s["ar"]["all"]["tokens_per_s"] == pytest.approx(20 / 15, abs=1e-4)
    assert s["full"]["all"]["tokens_per_s"] == 2.0
    assert s["full"]["all"]["speedup_vs_ar"] == pytest.approx(1.5)
    assert s["full"]["code"]["speedup_vs_ar"] == 2.0 and s["full"]["chat"]["speedup_vs_ar"] == 1.0
    assert s["ar"]["all"]["speedup_vs_full"] == pytest.approx(2 / 3, abs=1e-4)
    assert s["full"]["all"]["mean_accepted_length"] == pytest.approx(20 / 9, abs=1e-4)
    assert s["full"]["all"]["mean_accepted_length_std"] == pytest.approx(0.25)  # pstdev of 2.5 and 2.0
    assert s["ar"]["all"]["tokens_per_s_std"] == pytest.approx(0.5)  # pstdev of 1 and 2
    assert s["full"]["all"]["matches_ar"] == 0.5 and s["full"]["all"]["diverged_from_ar"] == 1
    assert s["full"]["all"]["head_share"] == 0.2 and s["full"]["all"]["head_share_of_draft"] == 0.5
    oracle = oracle_summary(gens)
    assert oracle["all"]["tokens_per_s"] == 2.5  # 20 tokens / (10 s − 2 s of head)
    assert oracle["code"]["speedup_vs_ar"] == 2.5 and oracle["all"]["speedup_vs_full"] == 1.25
    assert oracle["all"]["mean_accepted_length"] == s["full"]["all"]["mean_accepted_length"]


def test_summary_over_seeds_and_sampling():
    gens = [_row("a", "t", "ar", 10, 10.0, 10, seed=0), _row("a", "t", "ar", 10, 5.0, 10, seed=1),
            _row("a", "t", "full", 10, 5.0, 5, seed=0), _row("a", "t", "full", 10, 5.0, 5, seed=1, ids=[3])]
    s = summarize_bench(gens, ("ar", "full"), greedy=False)
    stats = s["full"]["all"]["seed_stats"]
    assert stats["speedup_vs_ar"]["values"] == [2.0, 1.0]
    assert stats["speedup_vs_ar"]["mean"] == 1.5 and stats["speedup_vs_ar"]["std"] == 0.5
    assert s["full"]["all"]["matches_ar"] is None  # sampled outputs are not expected to match
    assert s["full"]["all"]["diverged_from_ar"] == 1


def test_accepted_per_cycle_from_cache_lengths():
    # prompt 5; pass 0 feeds 5 + 3 candidates, 2 accepted (3 emitted) -> cache 7;
    # pass 1 feeds 1 + 3, all accepted (4 emitted) -> cache 11; pass 2 feeds 1 + 0, emits 1 -> 13 tokens
    passes = [(0, 8), (7, 4), (11, 1)]
    assert accepted_per_cycle(passes, prompt_len=5, new_tokens=8) == [(3, 2), (3, 3), (0, 0)]
    assert accepted_per_cycle([(-1, 3)], 5, 1) is None


def test_summary_reports_policy_and_head_time_per_draft_step():
    rows = [_row("a", "code", "hybrid", 10, 5.0, 4, head=1.0), _row("b", "chat", "hybrid", 10, 5.0, 5, head=0.5)]
    for r, (steps, policy) in zip(rows, [(20, 0.02), (10, 0.01)]):
        r["metrics"].update(draft_steps=steps, policy_s=policy)
    s = summarize_bench(rows, ("hybrid",))["hybrid"]["all"]
    assert s["draft_steps"] == 30
    assert s["policy_ms_per_step"] == pytest.approx(1.0) and s["head_ms_per_step"] == pytest.approx(50.0)
    ar = summarize_bench([_row("a", "code", "ar", 10, 5.0, 10)], ("ar",))["ar"]["all"]
    assert ar["policy_ms_per_step"] is None and ar["head_ms_per_step"] is None  # no draft steps


def test_many_tasks_get_a_line_per_task_and_row():
    """Spec-Bench's 13 categories: a column each left no room for the row names; a line per task and row does."""
    from rich.console import Console

    from dynvocab.bench.loop.report import WIDE_TASKS, _per_task_table

    tasks = [f"category-{i}" for i in range(WIDE_TASKS + 9)]
    stats = {"tokens_per_s": 5.0, "mean_accepted_length": 3.0, "speedup_vs_ar": 2.0, "speedup_vs_full": 1.0}
    per = [(name, {t: stats for t in tasks}) for name in ("ar", "full", "hybrid")]
    console = Console(width=100, record=True)
    console.print(_per_task_table(tasks, per))
    text = console.export_text()
    assert all(t in text for t in tasks) and text.count("hybrid") == len(tasks)
    assert "5.00 · 3.00 (2.00×)" in text and max(len(line) for line in text.splitlines()) <= 100
    console = Console(width=100, record=True)
    console.print(_per_task_table(tasks[:2], per))
    text = console.export_text()
    assert "hybrid" in text and tasks[1] in text
