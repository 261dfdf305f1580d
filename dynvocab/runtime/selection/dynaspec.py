"""DynaSpec: a router (meta-classifier) picks token clusters per draft step; the draft head covers their union.

At draft step t the router scores the M clusters from the draft's hidden state and the embedding of the token it was
fed (§4.2), the top-k_c(t) clusters are kept with the position-aware budget k_c(t) = k_max for t ∈ {0, 1}, else
⌊k_max / (2(t+1))⌋, and the active set is the union of their token ids plus the EOS ids. Clusters partition the
vocabulary, so the ids are stored grouped by cluster (:class:`~.groups.Groups`) and a union is row ranges of that one
order.

One selector for every host (:class:`RouterSelector`): a batched host gets each row's clusters' ids padded to the
largest such union; dynvocab's loop gets a chain step's clusters as row ranges (:meth:`RouterSelector.row_set`) and a
tree depth's nodes each their own clusters over the union (:meth:`RouterSelector.node_sets`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvocab.artifacts import ClusterTable
from dynvocab.artifacts.bundle import Bundle
from dynvocab.artifacts.router import DEFAULT_K_MAX, RouterTable, clusters_checksum
from dynvocab.budget import pa_budget
from dynvocab.errors import DynvocabError
from dynvocab.runtime.heads.active_set import ActiveSet, NodeSets
from dynvocab.runtime.heads.selected_head import BatchSets
from dynvocab.runtime.selection.batch_select import ContextSelector, StepContext, bundle_eos
from dynvocab.runtime.selection.groups import Groups


@dataclass(frozen=True)
class DynaSpecConfig:
    """DynaSpec's runtime knobs (§4.2). The router's training settings (top-L, width) live in its bundle stage."""

    k_max: int = DEFAULT_K_MAX  # clusters at steps 0 and 1 (the paper gives none for M = 1024; see DEFAULT_K_MAX)
    divisor: int = 2  # k_c(t) = ⌊k_max / (divisor · (t+1))⌋ for t ≥ 2 (§4.2: 2)
    position_aware: bool = True  # False: k_max clusters at every step (the paper's DynaSpec-F, Figure 2)

    def budget(self, step: int) -> int:
        """k_c(step), the number of clusters at draft step ``step`` (0-based)."""
        return pa_budget(self.k_max, step, self.divisor) if self.position_aware else self.k_max


class RouterSelector(ContextSelector):
    """``dynaspec``: route (hidden, embedding of the fed token) to each row's top ``k_c(t)`` clusters; their ids and
    the EOS ids."""

    name = "dynaspec"
    reads = frozenset({"fed"})

    def __init__(self, router: torch.nn.Module, assign: torch.Tensor, num_clusters: int, cfg: DynaSpecConfig,
                 eos: torch.Tensor):
        """``assign`` [V] the cluster of each draftable id; ``router(h [B, d], e [B, d_e]) -> scores [B, M]``."""
        if cfg.k_max < 1 or cfg.divisor < 1:
            raise DynvocabError(f"dynaspec needs k_max ≥ 1 and divisor ≥ 1 (got {cfg.k_max}, {cfg.divisor})")
        self.router, self.cfg, self.budget = router, cfg, cfg.budget
        self.groups = Groups(assign, num_clusters, eos, assign.device)
        self.order = self.groups.order  # [V] ids grouped by cluster: the order the loop's head packs once
        self.starts, ends = self.groups.bounds  # [M] each cluster's first and end slot in ``order``
        self.sizes = ends - self.starts  # [M]
        self.largest = torch.sort(self.sizes, descending=True).values.cumsum(0).tolist()  # the n largest clusters' ids
        self.eos = self.groups.eos
        self.k = self.width(self.budget(0)) + int(self.eos.numel())
        self.calls = 0  # steps routed

    def width(self, clusters: int) -> int:
        """Ids per row for ``clusters`` routed clusters: as many as the largest of them hold together."""
        return self.largest[min(clusters, len(self.largest)) - 1]

    def route(self, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The top ``k_c(step)`` clusters [B, k_c] of each row, for its ``hidden`` [B, d] and the embedding of the
        token it was fed (``ctx.fed``, embedded by ``ctx.embed``)."""
        if hidden is None or ctx.fed is None or ctx.embed is None:
            raise DynvocabError("dynaspec routes on the draft hidden state and the fed token's embedding; the host "
                                "gave none")
        self.calls += 1
        scores = self.router(hidden.float(), ctx.embed(ctx.fed).float())  # [B, M]
        return scores.topk(min(self.budget(ctx.step), scores.shape[1]), dim=-1).indices

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        """Each row's clusters' ids one after another, padded to the largest such union at that position (repeating
        the row's first id), and the EOS ids."""
        picked = self.route(hidden, ctx)  # [B, k_c]
        lens = self.sizes[picked]  # [B, k_c]
        ends = lens.cumsum(1)  # [B, k_c] where each picked cluster's ids end in the row
        slots = torch.arange(self.width(picked.shape[1]), device=picked.device).repeat(picked.shape[0], 1)  # [B, w]
        which = torch.searchsorted(ends, slots, right=True).clamp(max=picked.shape[1] - 1)  # [B, w] its cluster
        offset = slots - (ends - lens).gather(1, which)  # [B, w] the slot within that cluster
        ids = self.order[(self.starts[picked.gather(1, which)] + offset).clamp(0, self.order.numel() - 1)]
        inside = slots < ends[:, -1:]  # past the row's own ids: padding
        ids = torch.where(inside, ids, ids[:, :1])
        return BatchSets(self.eos if self.eos.numel() else None, ids)

    @torch.inference_mode()
    def row_set(self, hidden: torch.Tensor | None, ctx: StepContext) -> ActiveSet:
        """The routed clusters as row ranges of the cluster order, and the EOS ids outside them: two segments."""
        return ActiveSet.of(*self.groups.select(self.route(hidden, ctx)[0]))

    @torch.inference_mode()
    def node_sets(self, hidden: torch.Tensor, ctx: StepContext) -> NodeSets:
        """Each of the rows ``hidden`` [B, d] its own routed clusters, scored over the union of the rows' clusters."""
        return self.groups.node_sets(self.route(hidden, ctx))


def router_table(bundle: Bundle, hidden_size: int, embed_dim: int | None = None) -> RouterTable:
    """The bundle's router, refused in one line where it was trained for other clusters, another hidden size or
    (``embed_dim`` given) another embedding width."""
    router = RouterTable.from_bundle(bundle)
    retrain = f"retrain it with `dynvocab train-router --bundle {bundle.path} --draft …`"
    if router.config.get("clusters_sha256") != clusters_checksum(bundle):
        raise DynvocabError(f"the router in {bundle.path} was trained for other clusters (the clusters stage was "
                            f"rebuilt since); {retrain}")
    if int(router.config["hidden_dim"]) != hidden_size or (
            embed_dim is not None and int(router.config["embed_dim"]) != embed_dim):
        raise DynvocabError(f"the router in {bundle.path} expects hidden size {router.config['hidden_dim']}, the "
                            f"draft has {hidden_size}; {retrain}")
    return router


def router_selector(clusters: ClusterTable, router: RouterTable, cfg: DynaSpecConfig, vocab_size: int,
                    eos: torch.Tensor, device: torch.device | str = "cpu") -> RouterSelector:
    """``router`` routing with ``cfg`` to ``clusters`` over a draft of ``vocab_size`` ids (and the ``eos`` ids it
    has)."""
    m = clusters.num_clusters
    if int(router.config["num_clusters"]) != m:
        raise DynvocabError(f"the router scores {router.config['num_clusters']} clusters but the bundle has {m}; "
                            "retrain it with `dynvocab train-router`")
    device = torch.device(device)
    return RouterSelector(router.module(device), clusters.assign[:vocab_size].to(device), m, cfg, eos)


def router_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                       device: torch.device) -> RouterSelector:
    """``dynaspec``: the bundle's clusters and router, ``budget`` clusters at draft positions 0 and 1."""
    return router_selector(ClusterTable.from_bundle(bundle), router_table(bundle, hidden_size),
                           DynaSpecConfig(k_max=budget), vocab_size, bundle_eos(bundle, vocab_size, device), device)


def router_budget(bundle: Bundle, vocab_size: int) -> int:
    """``dynaspec``'s default clusters at positions 0 and 1: DynaSpec's k_max."""
    return DEFAULT_K_MAX


def router_for_loop(cfg: DynaSpecConfig, ctx) -> RouterSelector:
    """``dynaspec`` in dynvocab's loop (a :class:`~dynvocab.runtime.registry.PolicyContext` whose bundle has the
    clusters and router stages and a draft); the draft packs the cluster order's rows now."""
    if ctx.draft is None:
        raise DynvocabError("strategy 'dynaspec' needs a draft model; pass --draft")
    router = router_table(ctx.bundle, ctx.draft.hidden_size, ctx.draft.embedding.shape[1])
    selector = router_selector(ClusterTable.from_bundle(ctx.bundle), router, cfg, ctx.vocab_size, ctx.eos, ctx.device)
    ctx.draft.prepare_rows(selector.order)  # the cluster order's rows, packed now and kept across prompts
    return selector
