"""The loop's device→host reads, counted on CPU: at most one per draft step and one per cycle, all through
:func:`dynvocab.runtime.host.to_host`, and no ``int()``/``float()``/``.item()``/``.tolist()``/``bool()`` of a
tensor anywhere else in dynvocab while a generation runs (on a GPU each would be a wait).

Before run_cycle, the same count gave 6 reads per ranked greedy draft step (early stop and runner-up leaves), 3 per
unranked one, 4 per sampled one plus 2–4 per sampled cycle."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

import dynvocab
from dynvocab.runtime import host
from dynvocab.runtime.draft_model import DraftModel
from dynvocab.runtime.lm import CausalLM
from dynvocab.runtime.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.policies import FrequencyPolicy, FullPolicy

CONVERSIONS = ("__int__", "__float__", "__bool__", "__index__", "item", "tolist")
PACKAGE = str(Path(dynvocab.__file__).parent)
HOST = str(Path(host.__file__))


class Reads:
    """Counts :func:`to_host` calls by the function that made them, and every other tensor conversion made from
    a dynvocab frame (file:line), while installed."""

    def __init__(self, monkeypatch, roots: tuple[str, ...] = (PACKAGE,)):
        self.roots = roots
        self.helper: collections.Counter = collections.Counter()
        self.elsewhere: collections.Counter = collections.Counter()
        helper = host.to_host
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("dynvocab") and getattr(module, "to_host", None) is helper:
                monkeypatch.setattr(module, "to_host", self._counting(helper))
        for name in CONVERSIONS:
            monkeypatch.setattr(torch.Tensor, name, self._watching(name, getattr(torch.Tensor, name)))

    def _counting(self, to_host):
        def counted(t):
            self.helper[sys._getframe(1).f_code.co_name] += 1
            return to_host(t)
        return counted

    def _watching(self, name, conversion):
        def watched(t, *args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            where = "" if frame is None else frame.f_code.co_filename
            if where.startswith(self.roots) and where != HOST:
                self.elsewhere[f"{Path(where).name}:{frame.f_lineno} {name}"] += 1
            return conversion(t, *args, **kwargs)
        return watched


@pytest.fixture(scope="module")
def pair(tiny_pair):
    target, draft = tiny_pair
    return CausalLM(target), DraftModel(draft, one_token_steps=True)  # the draft steps as a session runs it


CONFIGS = {
    "greedy-ranked": DecodeConfig(gamma=4, max_new_tokens=40, stop_below=0.05, branch_below=0.9),
    "greedy": DecodeConfig(gamma=4, max_new_tokens=40, stop_below=0.0, branch_below=0.0),
    "sampling": DecodeConfig(gamma=4, max_new_tokens=40, stop_below=0.05, temperature=0.9, seed=3),
}


@pytest.mark.parametrize("policy", ["full", "fr"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_one_host_read_per_draft_step_and_one_per_cycle(pair, monkeypatch, config, policy):
    target, draft = pair
    cfg = CONFIGS[config]
    make = {"full": lambda: FullPolicy(draft.vocab_size), "fr": lambda: FrequencyPolicy(torch.arange(60))}[policy]
    expected = speculative_generate(target, [3, 1, 4, 1, 5], cfg, set(), draft, make())
    reads = Reads(monkeypatch)
    g = speculative_generate(target, [3, 1, 4, 1, 5], cfg, set(), draft, make())
    monkeypatch.undo()
    m = g.metrics
    assert g.token_ids == expected.token_ids  # counting changed nothing
    assert m.draft_steps >= m.cycles > 1
    assert not reads.elsewhere, dict(reads.elsewhere)
    assert reads.helper["read_choice"] == m.draft_steps  # the draft step's one read
    verdicts = reads.helper["verify_tree_greedy"] + reads.helper["verify_sampling"]
    assert verdicts == m.cycles
    assert sum(reads.helper.values()) <= m.draft_steps + m.cycles + 1  # + the tally's hit count, once


def test_autoregressive_decoding_reads_once_per_token(pair, monkeypatch):
    target, _ = pair
    reads = Reads(monkeypatch)
    g = speculative_generate(target, [3, 1, 4], DecodeConfig(max_new_tokens=12), set())
    monkeypatch.undo()
    assert not reads.elsewhere, dict(reads.elsewhere)
    assert reads.helper == {"verify_tree_greedy": 12} and len(g.token_ids) == 12


def test_the_counter_sees_a_stray_read(pair, monkeypatch):
    """The check can fail: a policy that reads a tensor with ``int()`` on its step is caught."""
    target, draft = pair

    class Reading(FullPolicy):
        def active_ids(self, step, hidden=None, token=None):
            int(hidden.argmax())
            return super().active_ids(step, hidden, token)

    reads = Reads(monkeypatch, roots=(PACKAGE, __file__))
    g = speculative_generate(target, [3, 1, 4], DecodeConfig(gamma=2, max_new_tokens=6), set(), draft,
                             Reading(draft.vocab_size))
    monkeypatch.undo()
    (where, count), = reads.elsewhere.items()
    assert where.startswith(f"{Path(__file__).name}:") and where.endswith("__int__")
    assert count == g.metrics.draft_steps
