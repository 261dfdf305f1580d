"""One registry of strategies: a name maps to everything it takes to run that strategy.

A :class:`Strategy` entry holds the strategy's config dataclass (its defaults are the command-line defaults), the
factory that builds its policy from the user's :class:`StrategyOptions` and the session's :class:`PolicyContext`,
the bundle stages it cannot run without, the command-line flags it contributes, and how it runs in a batched host
such as the vLLM plugin (:class:`Batched`, or why it cannot). :func:`make_policy`, the stage check, the
strategy-name checks, the ``generate`` / ``bench`` flags, ``microbench policy-steps`` and the batched hosts
(:mod:`dynvocab.runtime.batched`) all read it, so adding a policy is one module (the policy and its config) and one
:func:`register` call, in both hosts.

The built-in strategies are registered by :mod:`dynvocab.runtime.strategies`; import the API from there, so that
they are in the registry.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, TypeVar

import torch

from dynvocab.artifacts.stages import adding_commands
from dynvocab.errors import DynvocabError
from dynvocab.registry import Registry
from dynvocab.runtime.decoding.ngram import split_ngram
from dynvocab.runtime.drafts.draft import DraftInfo
from dynvocab.runtime.selection.base import VocabPolicy
from dynvocab.runtime.trees.shape import split_tree

C = TypeVar("C")


@dataclass
class PolicyContext:
    """What a policy may need from the session: the draft's usable vocabulary, EOS ids, device, bundle."""

    vocab_size: int
    eos_ids: set[int]
    device: torch.device | str = "cpu"
    bundle: object | None = None  # dynvocab.artifacts.Bundle, already checked against the models
    draft: DraftInfo | None = None  # what policies read of the draft: its embedding, hidden size, head rows, …
    target: object | None = None  # the target CausalLM (read-only: its LM head, for retrieval)
    tokenizer_sha256: str | None = None  # dynvocab.models.tokenizer_fingerprint of the shared tokenizer

    @property
    def eos(self) -> torch.Tensor:
        """EOS ids the draft can propose, LongTensor [E]."""
        return torch.tensor(sorted(i for i in self.eos_ids if i < self.vocab_size), dtype=torch.long)


@dataclass(frozen=True)
class StrategyOptions:
    """What the user chose: where the frequency ranking comes from (fr, fr-pa, hybrid) and the strategies'
    configs. A strategy whose config type is not among ``configs`` runs with that type's defaults."""

    token_map: str | None = None
    fr_size: int | None = None  # use only the first K ids of the ranking (default: the map, or 32768 of a bundle)
    configs: tuple = ()  # frozen config dataclasses, at most one of each type

    def __post_init__(self):
        kinds = [type(c) for c in self.configs]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"StrategyOptions holds two configs of one type: {[k.__name__ for k in kinds]}")

    def config(self, kind: type[C]) -> C:
        """The config of type ``kind`` among ``configs``, else ``kind()`` (its defaults)."""
        for cfg in self.configs:
            if type(cfg) is kind:
                return cfg
        return kind()


@dataclass(frozen=True)
class Flag:
    """A command-line option a strategy contributes: ``--name`` (underscores as dashes) sets the field ``attr``
    (default: ``name``) of the strategy's config, whose type and default it takes. A bool flag switches on.
    Strategies that declare a flag of the same name share one option (its help names them all)."""

    name: str
    help: str
    attr: str = ""
    min: int | float | None = None

    @property
    def field(self) -> str:
        """The config field the flag sets."""
        return self.attr or self.name

    def value_type(self, config: type):
        """The flag's value type: the config field's annotation."""
        return typing.get_type_hints(config)[self.field]

    def default(self, config: type):
        """The flag's default: the config field's default."""
        return getattr(config(), self.field)


SHARED_BUDGET_FLAG = "fr_size"  # the one shared option a strategy's batched budget may come from (--fr-size)


@dataclass(frozen=True)
class Batched:
    """How a strategy runs in a batched host (the vLLM plugin): one selector of a fixed ``k`` per draft position,
    built from bundle stages, each row its own set: ``hidden [B, d] -> ids [B, k]``
    (:mod:`dynvocab.runtime.selection.batch_select`), or, for a strategy that reads the request's context,
    ``(hidden, StepContext) -> BatchSets`` (:mod:`dynvocab.runtime.selection.context`)."""

    stages: tuple[str, ...]  # the bundle stages its selector reads
    build: Callable[..., object]  # (bundle, budget, vocab_size, hidden_size, device) -> a selector
    default_budget: Callable[[object, int], int]  # (bundle, vocab_size) -> the budget when none is given
    optional: tuple[str, ...] = ()  # stages it reads where the bundle has them (exported with it)
    budget_flags: tuple[str, ...] = ()  # its flags (or --fr-size) whose first value set is its budget there
    target_states: bool = False  # it reads the target's hidden states, which vLLM hands EAGLE heads only


@dataclass(frozen=True)
class Strategy:
    """One registry entry: what it takes to run strategy ``name``."""

    name: str
    config: type | None  # its frozen config dataclass, read with ``options.config(…)`` (None: no knobs)
    factory: Callable[[StrategyOptions, PolicyContext], VocabPolicy | None]  # None: no draft runs (``ar``)
    stages: tuple[str, ...] = ()  # bundle stages it cannot run without (checked before any model loads)
    flags: tuple[Flag, ...] = ()  # options that set fields of ``config``
    dynamic: bool = True  # its active set follows the context: ``microbench policy-steps`` times its work per step
    drafts: bool = True  # it runs a draft (False: the target decodes alone, and the factory returns None)
    batched: Batched | None = None  # its selector in a batched host (None: it does not run there)
    why_not_batched: str = ""  # why it cannot run in a batched host, for the refusal ("": it has no batched form)

    def __post_init__(self):
        if self.batched is not None and self.why_not_batched:
            raise ValueError(f"strategy '{self.name}' runs batched and says why it cannot; drop why_not_batched")
        fields = {f.name for f in dataclasses.fields(self.config)} if self.config is not None else set()
        own = {flag.name for flag in self.flags} | {SHARED_BUDGET_FLAG}
        for name in self.batched.budget_flags if self.batched is not None else ():
            if name not in own:
                raise ValueError(f"strategy '{self.name}': budget flag '{name}' is none of its flags")
        for flag in self.flags:
            if flag.field not in fields:
                raise ValueError(f"strategy '{self.name}': flag '{flag.name}' sets no field of its config")
            if flag.value_type(self.config) is bool and flag.default(self.config) is not False:
                raise ValueError(f"strategy '{self.name}': bool flag '{flag.name}' switches on; default it to False")


_REGISTRY: Registry[Strategy] = Registry("strategy", duplicate="{noun} '{name}' is registered already")
unregister = _REGISTRY.pop  # remove strategy ``name`` from the registry; returns its entry


def lookup(name: str) -> Strategy:
    """The entry of strategy ``name`` (``X+ngram`` is ``X``'s: the suffix adds n-gram lookup to the loop, see
    :mod:`dynvocab.runtime.decoding.ngram`; ``X@tree`` too: X drafted as a tree, :mod:`dynvocab.runtime.trees.shape`);
    an unknown name is refused in one line."""
    return _REGISTRY.lookup(split_ngram(split_tree(name)[0])[0])


def register(entry: Strategy) -> Strategy:
    """Add ``entry`` to the registry (a flag it shares with another strategy must be declared alike)."""
    _REGISTRY.check_new(entry)
    for flag in entry.flags:
        for other, users in strategy_flags():
            if other.name == flag.name and _spec(other, users[0].config) != _spec(flag, entry.config):
                raise ValueError(f"flag '{flag.name}' of '{entry.name}' differs from the one of '{users[0].name}'")
    return _REGISTRY.register(entry)


def _spec(flag: Flag, config: type) -> tuple:
    return flag.help, flag.min, flag.value_type(config), flag.default(config)


def strategies() -> tuple[Strategy, ...]:
    """Every registered strategy, in registration order."""
    return tuple(_REGISTRY.values())


def strategy_names() -> tuple[str, ...]:
    """Names of every registered strategy, in registration order."""
    return _REGISTRY.names()


def check_strategy(name: str) -> None:
    """Refuse unknown strategies."""
    lookup(name)


def parse_strategies(text: str) -> list[str]:
    """Split ``a,b,c`` and check each name."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise DynvocabError("no strategy given; use one or more of " + ", ".join(_REGISTRY))
    for name in names:
        check_strategy(name)
    return names


def strategy_flags() -> list[tuple[Flag, list[Strategy]]]:
    """Every flag the registered strategies contribute, once, with the strategies that declare it."""
    users: dict[str, tuple[Flag, list[Strategy]]] = {}
    for entry in _REGISTRY.values():
        for flag in entry.flags:
            users.setdefault(flag.name, (flag, []))[1].append(entry)
    return list(users.values())


def configs_from_flags(values: dict[str, object]) -> tuple:
    """The configs that flag ``values`` (by flag name) describe: one per config type some flag sets."""
    fields: dict[type, dict[str, object]] = {}
    for entry in _REGISTRY.values():
        for flag in entry.flags:
            if flag.name in values:
                fields.setdefault(entry.config, {})[flag.field] = values[flag.name]
    return tuple(config(**kw) for config, kw in fields.items())


def require_stages(entry: Strategy, bundle) -> None:
    """Refuse ``entry`` when ``bundle`` (None: none given) lacks a stage it needs: one line naming the stages
    and the commands that add them."""
    if bundle is None:
        raise DynvocabError(
            f"strategy '{entry.name}' needs --bundle B with stages {', '.join(entry.stages)}; "
            f"build one with {_adding(entry.stages, 'B')}"
        )
    missing = [s for s in entry.stages if not bundle.has(s)]
    if missing:
        raise DynvocabError(
            f"strategy '{entry.name}' needs bundle stages {', '.join(entry.stages)}; {bundle.path} lacks "
            f"{', '.join(missing)} (it has: {', '.join(bundle.stages) or 'none'}); add them with "
            f"{_adding(missing, bundle.path)}"
        )


def _adding(stages: Sequence[str], path) -> str:
    """The commands that add ``stages`` to the bundle at ``path``, as the stage registry says each is made."""
    return adding_commands(stages, path)


def check_bundle_stages(names: Iterable[str], bundle_path: str | None) -> None:
    """Refuse, before any model loads, a strategy whose bundle stages are missing (or that needs a bundle). Names
    that are no strategy (bench's ``hf-*`` rows) need no bundle."""
    needs = [_REGISTRY[n] for n in names if n in _REGISTRY and _REGISTRY[n].stages]
    if not needs:
        return
    if bundle_path is None:
        require_stages(needs[0], None)
    from dynvocab.artifacts import load_bundle

    with load_bundle(bundle_path) as bundle:
        for entry in needs:
            require_stages(entry, bundle)


def make_policy(name: str, options: StrategyOptions, ctx: PolicyContext) -> VocabPolicy | None:
    """Build the policy of strategy ``name`` (None for one that runs without a draft, ``ar``)."""
    entry = lookup(name)
    if entry.stages:
        require_stages(entry, ctx.bundle)
    return entry.factory(options, ctx)
