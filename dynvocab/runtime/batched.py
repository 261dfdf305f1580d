"""Strategies in a batched host (the vLLM plugin), read off their registry entries.

A strategy that runs batched says so on its :class:`~dynvocab.runtime.registry.Strategy` entry (``batched``: the
bundle stages its selector reads, its default budget and the function that builds it from a bundle), and one that
cannot says why (``why_not_batched``). This module only looks them up, so a new strategy is one module and one entry
in both hosts: dynvocab's loop and the vLLM plugin. The selection maths is
:mod:`dynvocab.runtime.selection.batch_select`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvocab.errors import DynvocabError
from dynvocab.runtime.decoding.ngram import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, NgramLookup, split_ngram
from dynvocab.runtime.registry import SHARED_BUDGET_FLAG, Batched, Strategy, StrategyOptions
from dynvocab.runtime.selection.batch_select import BatchSelector
from dynvocab.runtime.strategies import lookup, strategies


@dataclass(frozen=True)
class SelectorSpec:
    """What a batched host needs to build a selector: the strategy and its budget (``fr``: ids; ``lowrank``:
    candidates; ``centroids``: blocks; None: the bundle's default); a strategy ending in ``+ngram`` also drafts by
    lookup in each request's tokens first, over suffixes of ``ngram_min`` to ``ngram_max`` tokens."""

    strategy: str
    budget: int | None = None
    ngram_max: int = DEFAULT_NGRAM_MAX
    ngram_min: int = DEFAULT_NGRAM_MIN

    @property
    def lookup(self) -> NgramLookup | None:
        """The n-gram lookup a ``+ngram`` strategy drafts by first (None: none)."""
        return NgramLookup(self.ngram_max, self.ngram_min) if split_ngram(self.strategy)[1] else None


def batch_strategies() -> tuple[str, ...]:
    """The registered strategies that run in a batched host, in registration order."""
    return tuple(entry.name for entry in strategies() if entry.batched is not None)


def _entry(strategy: str) -> Strategy | None:
    """The registry entry of ``strategy`` (one look-up by name; a ``+ngram`` strategy's is its base's), None for an
    unknown name."""
    try:
        return lookup(split_ngram(strategy)[0])
    except DynvocabError:
        return None


DRAFT_MODEL = "draft-model"  # the draft kind (runtime/drafts/kinds.py) to which vLLM hands no target hidden states
NO_HEAD = ("ar",)  # rows that draft nothing themselves: '+ngram' on them is lookup alone


def refusal(strategy: str, kind: str | None = None) -> str | None:
    """Why ``strategy`` cannot run as a batched selector inside vLLM, in one line (None: it can); ``kind``: the
    draft's kind where known (a strategy that reads the target's hidden states runs on EAGLE heads only, and so does
    a ``+ngram`` lookup, which reads each request's tokens through an EAGLE proposer's passes)."""
    base, ngram = split_ngram(strategy)
    if ngram and base in NO_HEAD:
        return (f"'{strategy}' inside vLLM is vLLM's own 'ngram' method (speculative_config method 'ngram'); "
                "the plugin's '+ngram' rows look up first and draft with a selected head where nothing matched")
    if ngram and kind == DRAFT_MODEL:
        return (f"'{strategy}' cannot run inside vLLM on a draft model: the lookup reads each request's tokens "
                f"through an EAGLE proposer's passes; use an EAGLE head, vLLM's own 'ngram' method, or '{base}'")
    entry = _entry(strategy)
    if entry is not None and entry.batched is not None:
        if kind == DRAFT_MODEL and entry.batched.target_states:
            return (f"strategy '{strategy}' cannot run inside vLLM on a draft model: its retrieval reads the target's "
                    "hidden states, which vLLM hands EAGLE heads only; use an EAGLE head, or hybrid")
        return None
    use = ", ".join(batch_strategies())
    if entry is None:
        return f"strategy '{strategy}' cannot run inside vLLM: it is not a dynvocab strategy; use one of {use}"
    if entry.why_not_batched:
        return f"strategy '{strategy}' cannot run inside vLLM: {entry.why_not_batched}; use one of {use}"
    return f"strategy '{strategy}' has no batched selector, so it cannot run inside vLLM; use one of {use}"


def batched(strategy: str) -> Batched:
    """The batched form of ``strategy``; refused in one line where it has none."""
    why = refusal(strategy)
    if why:
        raise DynvocabError(why)
    return _entry(strategy).batched


def bundle_stages(strategy: str) -> tuple[str, ...]:
    """The bundle stages ``strategy``'s batched selector reads."""
    return batched(strategy).stages


def exported_stages(strategy: str) -> tuple[str, ...]:
    """The stages a draft folder for ``strategy`` carries where the bundle has them: those its selector needs, those
    it reads when present, and ``freq`` (its EOS ids)."""
    form = batched(strategy)
    return tuple(dict.fromkeys((*form.stages, *form.optional, "freq")))


def asked_budget(strategy: str, options: StrategyOptions) -> int | None:
    """The budget ``strategy``'s own flags ask of its batched selector: the first of its ``budget_flags`` that is
    set (``--fr-size``, ``--k-max``, ``--candidates``, …; None: its default). Any other flag of its set away from
    its default is refused in one line, since a batched host reads the budget only."""
    form, entry = batched(strategy), _entry(strategy)
    values = {SHARED_BUDGET_FLAG: options.fr_size}
    for flag in entry.flags:
        value = getattr(options.config(entry.config), flag.field)
        if flag.name not in form.budget_flags and value != flag.default(entry.config):
            takes = ", ".join("--" + name.replace("_", "-") for name in form.budget_flags) or "no flag"
            raise DynvocabError(f"--{flag.name.replace('_', '-')} does not reach {strategy} inside vLLM: the plugin "
                                f"takes its budget only ({takes})")
        values[flag.name] = value
    return next((values[name] for name in form.budget_flags if values[name] is not None), None)


def default_budget(bundle, strategy: str, vocab_size: int) -> int:
    """The budget ``strategy``'s selector uses when none is given, for a head of ``vocab_size`` rows."""
    return batched(strategy).default_budget(bundle, vocab_size)


def build_selector(bundle, spec: SelectorSpec, vocab_size: int, hidden_size: int,
                   device: torch.device | str = "cpu") -> BatchSelector:
    """The batched selector of ``spec`` from ``bundle``, for a draft head of ``vocab_size`` rows read at
    ``hidden_size``; mismatches and strategies without a batched form are one-line :class:`DynvocabError` s."""
    form = batched(spec.strategy)
    for stage in form.stages:
        bundle.require(stage)
    budget = spec.budget or form.default_budget(bundle, vocab_size)
    return form.build(bundle, budget, vocab_size, hidden_size, torch.device(device))
