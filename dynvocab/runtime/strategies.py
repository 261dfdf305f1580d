"""Strategy names -> vocabulary policies. The loop never knows which policy it runs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from dynvocab.errors import DynvocabError
from dynvocab.runtime.policies import FrequencyPolicy, FullPolicy, PositionAwareFrequencyPolicy, VocabPolicy
from dynvocab.runtime.policies.dynaspec import DynaSpecConfig, DynaSpecPolicy
from dynvocab.runtime.policies.evospec import EvoSpecConfig, EvoSpecPolicy
from dynvocab.runtime.policies.hybrid import HybridConfig, HybridPolicy
from dynvocab.runtime.policies.microspec import MicroSpecConfig, MicroSpecPolicy
from dynvocab.runtime.token_map import load_token_map

ALL_STRATEGIES = ("ar", "full", "fr", "fr-pa", "dynaspec", "microspec", "evospec", "hybrid")
AVAILABLE = ALL_STRATEGIES
FR_SIZE = 32768  # FR-Spec's K when the ranking comes from a bundle


@dataclass(frozen=True)
class StrategyOptions:
    """Options of the strategies; each default lives here or in the strategy's own config."""

    token_map: str | None = None
    fr_size: int | None = None  # use only the first K ids of the ranking (default: the map, or 32768 of a bundle)
    pa_k_max: int | None = None  # fr-pa's k_max (default: the FR size)
    microspec: MicroSpecConfig = field(default_factory=MicroSpecConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    dynaspec: DynaSpecConfig = field(default_factory=DynaSpecConfig)
    evospec: EvoSpecConfig = field(default_factory=EvoSpecConfig)


@dataclass
class PolicyContext:
    """What a policy may need from the session: the draft's usable vocabulary, EOS ids, device, bundle."""

    vocab_size: int
    eos_ids: set[int]
    device: torch.device | str = "cpu"
    bundle: object | None = None  # dynvocab.artifacts.Bundle, already checked against the models
    draft: object | None = None  # the draft CausalLM (policies that adapt the draft, e.g. EvoSpec's LoRA)
    target: object | None = None  # the target CausalLM (read-only: its LM head, for retrieval)
    tokenizer_sha256: str | None = None  # dynvocab.models.tokenizer_fingerprint of the shared tokenizer

    @property
    def eos(self) -> torch.Tensor:
        """EOS ids the draft can propose, LongTensor [E]."""
        return torch.tensor(sorted(i for i in self.eos_ids if i < self.vocab_size), dtype=torch.long)


BUNDLE_STAGES = {"dynaspec": ("clusters", "router"), "evospec": ("freq", "hnsw", "graph")}  # stages a strategy reads


def check_bundle_stages(strategies: list[str] | tuple[str, ...], bundle_path: str | None) -> None:
    """Refuse, before any model loads, a strategy whose bundle stages are missing (or that needs a bundle)."""
    needs = {s: BUNDLE_STAGES[s] for s in strategies if s in BUNDLE_STAGES}
    if not needs:
        return
    if bundle_path is None:
        name, stages = next(iter(needs.items()))
        raise DynvocabError(
            f"strategy '{name}' needs --bundle B with {', '.join(stages)} stages; build one with "
            "`dynvocab build-index` (and `dynvocab train-router` for router)"
        )
    from dynvocab.artifacts import load_bundle

    with load_bundle(bundle_path) as bundle:
        for name, stages in needs.items():
            missing = [s for s in stages if not bundle.has(s)]
            if missing:
                how = " and ".join(
                    f"`dynvocab train-router --bundle {bundle_path}`" if s == "router"
                    else f"`dynvocab build-index --stages {s} --out {bundle_path}`" for s in missing
                )
                raise DynvocabError(
                    f"strategy '{name}' needs bundle stage(s) {', '.join(missing)}, which {bundle_path} lacks "
                    f"(it has: {', '.join(bundle.stages) or 'none'}); add them with {how}"
                )


def parse_strategies(text: str) -> list[str]:
    """Split ``a,b,c`` and check each name."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise DynvocabError("no strategy given; use one or more of " + ", ".join(AVAILABLE))
    for name in names:
        check_strategy(name)
    return names


def check_strategy(name: str) -> None:
    """Refuse unknown strategies."""
    if name not in ALL_STRATEGIES:
        raise DynvocabError(f"unknown strategy '{name}'; use one of {', '.join(AVAILABLE)}")


def frequency_ranking(opts: StrategyOptions, ctx: PolicyContext, name: str) -> torch.Tensor:
    """The FR ranking: the token map if given, else the bundle's ``freq`` stage (top 32768 by default)."""
    if opts.token_map is not None:
        ranking = load_token_map(opts.token_map, ctx.vocab_size)
        size = opts.fr_size
    elif ctx.bundle is not None and ctx.bundle.has("freq"):
        from dynvocab.artifacts import FreqTable

        ranking = FreqTable.from_bundle(ctx.bundle).ranking
        ranking = ranking[ranking < ctx.vocab_size]
        size = opts.fr_size or FR_SIZE
    elif (embedded := embedded_ranking(ctx.tokenizer_sha256)) is not None:
        ranking = embedded[embedded < ctx.vocab_size]
        size = opts.fr_size
    else:
        raise DynvocabError(
            f"strategy '{name}' needs a frequency ranking: pass --token-map FILE or --bundle B with a freq stage"
        )
    if size is not None:
        if size < 1:
            raise DynvocabError("--fr-size must be at least 1")
        ranking = ranking[:size]
    return ranking


def embedded_ranking(tokenizer_sha256: str | None) -> torch.Tensor | None:
    """The 32k FR ranking shipped for the demo tokenizer (Qwen2.5, ShareGPT training split), if it fits."""
    from importlib import resources

    folder = resources.files("dynvocab.data")
    meta = json.loads(folder.joinpath("demo_ranking.json").read_text())
    if tokenizer_sha256 != meta["tokenizer_sha256"]:
        return None
    with resources.as_file(folder.joinpath("demo_ranking.pt")) as path:
        return torch.load(path, weights_only=True).long()


def make_policy(name: str, opts: StrategyOptions, ctx: PolicyContext) -> VocabPolicy | None:
    """Build the policy of strategy ``name`` (None for ``ar``, which runs without a draft)."""
    check_strategy(name)
    if name == "ar":
        return None
    if name == "full":
        return FullPolicy(ctx.vocab_size)
    if name == "microspec":
        return MicroSpecPolicy(opts.microspec, ctx.vocab_size, ctx.device, pinned=ctx.eos)
    if name == "dynaspec":
        return DynaSpecPolicy.from_context(opts.dynaspec, ctx)
    if name == "evospec":
        if opts.evospec.online_align and ctx.draft is not None and ctx.draft.adaptable is None:
            raise DynvocabError("--online-align adapts a draft model's q/v projections, not an EAGLE head; drop it")
        return EvoSpecPolicy.from_context(opts.evospec, ctx)
    ranking = frequency_ranking(opts, ctx, name)
    eos = ctx.eos
    if name == "hybrid":
        return _hybrid(opts.hybrid, ranking, ctx)
    if name == "fr":
        missing = eos[~torch.isin(eos, ranking)]
        return FrequencyPolicy(torch.cat([ranking, missing]), device=ctx.device)  # EOS stays draftable
    return PositionAwareFrequencyPolicy(ranking, opts.pa_k_max, always=eos, device=ctx.device)


def _draft_head_index(ctx: PolicyContext, target_index):
    """The HNSW index over the draft head's rows for per-step search: the target's ``hnsw`` for a draft that
    predicts through the target's own head (an EAGLE-1 head, when asked: its default is no per-step search), the
    bundle's ``draft_hnsw`` for the draft model it was built over, else None (an EAGLE-3 head's ``lm_head``)."""
    from dynvocab.artifacts import HnswParams, load_hnsw

    if ctx.draft.shares_target_head:
        return target_index
    head = ctx.draft.index_rows  # [V, d] every row, as indexed
    if head is None or not ctx.bundle.has("draft_hnsw"):
        return None
    params = HnswParams.from_dict(ctx.bundle.info("draft_hnsw")["index"], f"bundle {ctx.bundle.path} (stage draft_hnsw)")
    if (params.num_elements, params.hidden) != tuple(head.shape):
        return None
    return load_hnsw(ctx.bundle, head, "draft_hnsw")[0]


def _hybrid(cfg: HybridConfig, ranking: torch.Tensor, ctx: PolicyContext) -> HybridPolicy:
    """The hybrid with the bundle's graph and HNSW indexes (target head, draft head) when it has them, its
    per-step candidates decided for the kind of draft (see :meth:`HybridConfig.for_draft`)."""
    cfg = cfg.for_draft(searches_per_step=ctx.draft is None or ctx.draft.searches_per_step)
    graph = hnsw = draft_hnsw = None
    if ctx.bundle is not None:
        from dynvocab.artifacts import GraphTable, load_hnsw

        if ctx.bundle.has("graph"):
            graph = GraphTable.from_bundle(ctx.bundle)
        if ctx.bundle.has("hnsw") and ctx.target is not None:
            hnsw = load_hnsw(ctx.bundle, ctx.target.weight)[0]
        if ctx.draft is not None and cfg.searches_per_step(ctx.device):
            draft_hnsw = _draft_head_index(ctx, hnsw)
    return HybridPolicy(
        cfg, ctx.vocab_size, ctx.device, ranking, pinned=ctx.eos, graph=graph, hnsw=hnsw, draft_hnsw=draft_hnsw
    )
