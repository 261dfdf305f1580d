"""Strategy names -> vocabulary policies. The loop never knows which policy it runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvocab.errors import DynvocabError
from dynvocab.runtime.policies import FrequencyPolicy, FullPolicy, PositionAwareFrequencyPolicy, VocabPolicy
from dynvocab.runtime.policies.microspec import MicroSpecConfig, MicroSpecPolicy
from dynvocab.runtime.token_map import load_token_map

ALL_STRATEGIES = ("ar", "full", "fr", "fr-pa", "dynaspec", "microspec", "evospec", "hybrid")
AVAILABLE = ("ar", "full", "fr", "fr-pa", "microspec")


@dataclass(frozen=True)
class StrategyOptions:
    """Options of the strategies; each default lives here (FR-Spec: K = 32768)."""

    token_map: str | None = None
    fr_size: int | None = None  # use only the first K ids of the map (default: all of it)
    pa_k_max: int | None = None  # fr-pa's k_max (default: the map's size)
    microspec: MicroSpecConfig = MicroSpecConfig()


def parse_strategies(text: str) -> list[str]:
    """Split ``a,b,c`` and check each name."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise DynvocabError("no strategy given; use one or more of " + ", ".join(AVAILABLE))
    for name in names:
        check_strategy(name)
    return names


def check_strategy(name: str) -> None:
    """Refuse unknown strategies and those this version does not ship yet."""
    if name not in ALL_STRATEGIES:
        raise DynvocabError(f"unknown strategy '{name}'; use one of {', '.join(AVAILABLE)}")
    if name not in AVAILABLE:
        raise DynvocabError(f"strategy '{name}' is not available in this version; use one of {', '.join(AVAILABLE)}")


def make_policy(
    name: str, opts: StrategyOptions, vocab_size: int, eos_ids: set[int], device="cpu"
) -> VocabPolicy | None:
    """Build the policy of strategy ``name`` for a draft with ``vocab_size`` usable rows (None for ``ar``)."""
    check_strategy(name)
    eos = torch.tensor(sorted(i for i in eos_ids if i < vocab_size), dtype=torch.long)
    if name == "ar":
        return None
    if name == "full":
        return FullPolicy()
    if name == "microspec":
        return MicroSpecPolicy(opts.microspec, vocab_size, device, pinned=eos)
    if opts.token_map is None:
        raise DynvocabError(f"strategy '{name}' needs --token-map FILE (a torch.save'd list of token ids)")
    ranking = load_token_map(opts.token_map, vocab_size)
    if opts.fr_size is not None:
        if opts.fr_size < 1:
            raise DynvocabError("--fr-size must be at least 1")
        ranking = ranking[: opts.fr_size]
    if name == "fr":
        missing = eos[~torch.isin(eos, ranking)]
        return FrequencyPolicy(torch.cat([ranking, missing]))  # EOS stays draftable so drafts can end
    return PositionAwareFrequencyPolicy(ranking, opts.pa_k_max, always=eos)
