"""The built-in strategies, each a factory and one entry in the registry (:mod:`dynvocab.runtime.registry`).

The loop never knows which policy it runs. Adding a strategy: its policy and frozen config in a module under
``runtime/selection/``, a factory ``(options, ctx) -> VocabPolicy``, and one ``register(Strategy(…))`` call (below, or
in the module that brings it, or through an entry point in the :data:`ENTRY_POINTS` group). A strategy runs inside
vLLM too when its entry says how (``batched=Batched(stages, build, default_budget)``, :mod:`dynvocab.runtime.batched`:
a selector over the draft's hidden state, or one that also reads the request's context,
:mod:`dynvocab.runtime.selection.context`); one that cannot says why (``why_not_batched``). Import the
registry's API from here, so that the built-in strategies are in it.
"""

from __future__ import annotations

import json
from functools import partial

import torch

from dynvocab.budget import FR_SIZE
from dynvocab.errors import DynvocabError
from dynvocab.registry import load_plugins
from dynvocab.runtime.heads.token_map import load_token_map
from dynvocab.runtime.registry import (
    Batched,
    Flag,
    PolicyContext,
    Strategy,
    StrategyOptions,
    check_bundle_stages,
    check_strategy,
    configs_from_flags,
    lookup,
    make_policy,
    parse_strategies,
    register,
    strategies,
    strategy_flags,
    strategy_names,
    unregister,
)
from dynvocab.runtime.selection import FullPolicy, SelectorPolicy
from dynvocab.runtime.selection.batch_select import eos_first, fixed_budget, stage_budget
from dynvocab.runtime.selection.centroids import CentroidConfig, centroids_for_loop, centroids_from_bundle
from dynvocab.runtime.selection.context.hybrid import HybridConfig, HybridPolicy, hybrid_from_bundle
from dynvocab.runtime.selection.context.window import MicroSpecConfig, MicroSpecPolicy, window_from_bundle
from dynvocab.runtime.selection.dynaspec import DynaSpecConfig, router_budget, router_for_loop, router_from_bundle
from dynvocab.runtime.selection.evospec.evospec import EvoSpecConfig, EvoSpecPolicy, evospec_from_bundle
from dynvocab.runtime.selection.frequency import (
    PositionAwareConfig,
    PositionSelector,
    StaticSelector,
    frequency_budget,
    frequency_selector,
    position_from_bundle,
)
from dynvocab.runtime.selection.head_search import search_pays
from dynvocab.runtime.selection.lowrank import LowRankConfig, lowrank_for_loop, lowrank_from_bundle

ENTRY_POINTS = "dynvocab.strategies"  # the entry-point group of strategies that installed packages bring


def frequency_ranking(options: StrategyOptions, ctx: PolicyContext, name: str) -> torch.Tensor:
    """The FR ranking: the token map if given, else the bundle's ``freq`` stage (top ``FR_SIZE`` by default)."""
    if options.token_map is not None:
        ranking = load_token_map(options.token_map, ctx.vocab_size)
        size = options.fr_size
    elif ctx.bundle is not None and ctx.bundle.has("freq"):
        from dynvocab.artifacts import FreqTable

        ranking = FreqTable.from_bundle(ctx.bundle).ranking
        ranking = ranking[ranking < ctx.vocab_size]
        size = options.fr_size or FR_SIZE
    elif (embedded := embedded_ranking(ctx.tokenizer_sha256)) is not None:
        ranking = embedded[embedded < ctx.vocab_size]
        size = options.fr_size
    else:
        raise DynvocabError(
            f"strategy '{name}' needs a frequency ranking: pass --token-map FILE or --bundle B with a freq stage"
        )
    if size is not None:
        if size < 1:
            raise DynvocabError("--fr-size must be at least 1")
        ranking = ranking[:size]
    return ranking


EMBEDDED_RANKINGS = ("demo_ranking", "gemma_ranking")  # dynvocab/data/<name>.json (its tokenizer) + <name>.pt


def embedded_ranking(tokenizer_sha256: str | None) -> torch.Tensor | None:
    """The 32k FR ranking shipped for a demo tokenizer (Qwen2.5's for the demo pair, Gemma-3's for
    ``demo:gemma``; ShareGPT training split), if one fits."""
    from importlib import resources

    folder = resources.files("dynvocab.data")
    for name in EMBEDDED_RANKINGS:
        meta = json.loads(folder.joinpath(f"{name}.json").read_text())
        if tokenizer_sha256 == meta["tokenizer_sha256"]:
            with resources.as_file(folder.joinpath(f"{name}.pt")) as path:
                return torch.load(path, weights_only=True).long()
    return None


def _ar(options: StrategyOptions, ctx: PolicyContext) -> None:
    """One target pass per token: no draft, no policy."""
    return None


def _full(options: StrategyOptions, ctx: PolicyContext) -> FullPolicy:
    return FullPolicy(ctx.vocab_size)


def _prepared(selector, ctx: PolicyContext) -> SelectorPolicy:
    """``selector`` in the loop, its static ranking's rows packed in the draft's head now (its prefixes: int8 packs
    where the draft keeps them), so the first draft step costs what every later one does."""
    if ctx.draft is not None:
        ctx.draft.prepare_rows(selector.ranking, selector.prefixes)
    return SelectorPolicy(selector)


def _fr(options: StrategyOptions, ctx: PolicyContext) -> SelectorPolicy:
    ranking, eos = frequency_ranking(options, ctx, "fr"), ctx.eos
    missing = eos[~torch.isin(eos, ranking)]
    return _prepared(StaticSelector(torch.cat([ranking, missing]).to(ctx.device)), ctx)  # EOS stays draftable


def _fr_pa(options: StrategyOptions, ctx: PolicyContext) -> SelectorPolicy:
    ranking = frequency_ranking(options, ctx, "fr-pa")
    k_max = min(options.config(PositionAwareConfig).k_max or ranking.numel(), ranking.numel())
    return _prepared(PositionSelector(eos_first(ranking, ctx.eos).to(ctx.device), k_max), ctx)


def _microspec(options: StrategyOptions, ctx: PolicyContext) -> MicroSpecPolicy:
    return MicroSpecPolicy(options.config(MicroSpecConfig), ctx.vocab_size, ctx.device, pinned=ctx.eos)


def _dynaspec(options: StrategyOptions, ctx: PolicyContext) -> SelectorPolicy:
    return SelectorPolicy(router_for_loop(options.config(DynaSpecConfig), ctx), ctx.draft.embedding, ctx.device)


def _lowrank(options: StrategyOptions, ctx: PolicyContext) -> SelectorPolicy:
    return SelectorPolicy(lowrank_for_loop(options.config(LowRankConfig), ctx))


def _centroids(options: StrategyOptions, ctx: PolicyContext) -> SelectorPolicy:
    return SelectorPolicy(centroids_for_loop(options.config(CentroidConfig), ctx))


def _evospec(options: StrategyOptions, ctx: PolicyContext) -> EvoSpecPolicy:
    return EvoSpecPolicy.from_context(options.config(EvoSpecConfig), ctx)


def _hybrid(options: StrategyOptions, ctx: PolicyContext) -> HybridPolicy:
    """The hybrid with the bundle's graph and HNSW indexes (target head, draft head) when it has them, its
    per-step candidates left unset decided by measurement: on where the draft-head search costs less than a
    quarter of the draft's full head (:mod:`~dynvocab.runtime.selection.head_search`), else off."""
    ranking = frequency_ranking(options, ctx, "hybrid")
    asked = options.config(HybridConfig)
    graph = hnsw = draft_hnsw = None
    if ctx.bundle is not None:
        from dynvocab.artifacts import GraphTable, load_hnsw

        if ctx.bundle.has("graph"):
            graph = GraphTable.from_bundle(ctx.bundle)
        if ctx.bundle.has("hnsw") and ctx.target is not None:
            hnsw = load_hnsw(ctx.bundle, ctx.target.weight)[0]
        if ctx.draft is not None and asked.searches_per_step(ctx.device):
            draft_hnsw = _draft_head_index(ctx, hnsw)
    neighbours = asked.for_draft(searches_per_step=True).step_neighbours
    pays = draft_hnsw is not None and search_pays(ctx.draft, draft_hnsw, neighbours)
    cfg = asked.for_draft(searches_per_step=pays)
    if not cfg.step_neighbours:
        draft_hnsw = None
    return HybridPolicy(
        cfg, ctx.vocab_size, ctx.device, ranking, pinned=ctx.eos, graph=graph, hnsw=hnsw, draft_hnsw=draft_hnsw
    )


def _draft_head_index(ctx: PolicyContext, target_index):
    """The HNSW index over the draft head's rows for per-step search: the target's ``hnsw`` for a draft that
    predicts through the target's own head (an EAGLE-1 head, when asked: its default is no per-step search), the
    bundle's ``draft_hnsw`` over the draft's ``index_rows`` when it was built for them, else None."""
    from dynvocab.artifacts import HnswParams, load_hnsw

    if ctx.draft.shares_target_head:
        return target_index
    rows = ctx.draft.index_rows  # [V, d] every row of the draft's head, as indexed
    if rows is None or not ctx.bundle.has("draft_hnsw"):
        return None
    params = HnswParams.from_dict(ctx.bundle.info("draft_hnsw")["index"], f"bundle {ctx.bundle.path} (stage draft_hnsw)")
    if (params.num_elements, params.hidden) != tuple(rows.shape):
        return None
    return load_hnsw(ctx.bundle, rows, "draft_hnsw")[0]


K_PRE = Flag("k_pre", "target top-K_pre per prompt position joining the stream.", min=1)
K_VER = Flag("k_ver", "target top-K_ver per verified position joining the stream.", min=1)
PREFILL_POSITIONS = Flag("prefill_positions", "the last prompt positions whose target top-K_pre join the stream (0: "
                         "the prompt's tokens only). Default: microspec as many as its window holds (W_max / K_pre, "
                         "the paper's); hybrid 0.", min=0)

register(Strategy("ar", None, _ar, dynamic=False, drafts=False, why_not_batched="it drafts nothing"))
register(Strategy("full", None, _full, dynamic=False,
                  why_not_batched="it is the draft's own full head: run vLLM's speculation without the plugin"))
register(Strategy("fr", None, _fr, dynamic=False,
                  batched=Batched(("freq",), frequency_selector, frequency_budget, budget_flags=("fr_size",))))
register(Strategy(
    "fr-pa", PositionAwareConfig, _fr_pa, dynamic=False,
    flags=(Flag("pa_k_max", "k_max of the position-aware budget (default: the map size).", attr="k_max", min=1),),
    batched=Batched(("freq",), position_from_bundle, frequency_budget, budget_flags=("pa_k_max", "fr_size")),
))
register(Strategy(
    "dynaspec", DynaSpecConfig, _dynaspec, stages=("clusters", "router"),
    flags=(Flag("k_max", "clusters routed at draft steps 0 and 1 (k_max).", min=1),),
    batched=Batched(("clusters", "router"), router_from_bundle, router_budget, optional=("freq",),
                    budget_flags=("k_max",)),
))
register(Strategy(
    "lowrank", LowRankConfig, _lowrank, stages=("lowrank",),
    flags=(Flag("candidates", "candidate ids per draft step (default: the bundle stage's budget).", min=1),),
    batched=Batched(("lowrank",), lowrank_from_bundle, stage_budget("lowrank"), budget_flags=("candidates",)),
))
register(Strategy(
    "centroids", CentroidConfig, _centroids, stages=("centroids",),
    flags=(Flag("blocks", "vocabulary blocks per draft step (default: the bundle stage's budget).", min=1),),
    batched=Batched(("centroids",), centroids_from_bundle, stage_budget("centroids"), budget_flags=("blocks",)),
))
register(Strategy(
    "microspec", MicroSpecConfig, _microspec,
    flags=(K_PRE, K_VER, PREFILL_POSITIONS,
           Flag("window", "W_max, the stream entries the active set is drawn from.", min=1)),
    batched=Batched((), window_from_bundle, fixed_budget(MicroSpecConfig().window), optional=("freq",),
                    budget_flags=("window",)),
))
register(Strategy(
    "evospec", EvoSpecConfig, _evospec, stages=("freq", "hnsw", "graph"),
    flags=(Flag("online_align", "online LoRA alignment of the draft (q, v projections)."),),
    batched=Batched(("freq", "hnsw", "graph"), partial(evospec_from_bundle, cfg=EvoSpecConfig()),
                    fixed_budget(EvoSpecConfig().static_size), budget_flags=("fr_size",), target_states=True),
))
register(Strategy(
    "hybrid", HybridConfig, _hybrid,
    flags=(
        Flag("core_size", "size of the static core of most frequent tokens.", min=1),
        Flag("hybrid_window", "stream entries of its context window.", attr="window", min=1),
        K_PRE,
        K_VER,
        PREFILL_POSITIONS,
        Flag(
            "step_neighbours",
            "per draft step, HNSW neighbours of the draft hidden state among the draft's head rows (bundle stage "
            "draft_hnsw; 0 = off; CPU devices only: on a GPU it would cost a host sync per step). Default: 16 where "
            "the search measures under a quarter of the draft's full head, else 0.",
            min=0,
        ),
        Flag(
            "step_successors",
            "per draft step, graph successors of the token just fed (bundle stage graph; 0 = off). Default: 8 where "
            "the per-step search pays (see --step-neighbours), else 0.",
            min=0,
        ),
    ),
    batched=Batched(("freq",), partial(hybrid_from_bundle, cfg=HybridConfig().for_draft(searches_per_step=True)),
                    fixed_budget(HybridConfig().core_size), optional=("graph", "draft_hnsw"),
                    budget_flags=("core_size",)),
))

load_plugins(ENTRY_POINTS, register, Strategy)  # strategies that installed packages bring

__all__ = [
    "ENTRY_POINTS",
    "Batched",
    "Flag",
    "PolicyContext",
    "Strategy",
    "StrategyOptions",
    "check_bundle_stages",
    "check_strategy",
    "configs_from_flags",
    "embedded_ranking",
    "frequency_ranking",
    "lookup",
    "make_policy",
    "parse_strategies",
    "register",
    "strategies",
    "strategy_flags",
    "strategy_names",
    "unregister",
]
