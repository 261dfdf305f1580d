"""DynaSpec: a router (meta-classifier) picks token clusters per draft step; the draft head covers their union.

At draft step t the router scores the M clusters from the draft's hidden state and the embedding of the
token it was fed (§4.2), the top-k_c(t) clusters are kept with the position-aware budget
k_c(t) = k_max for t ∈ {0, 1}, else ⌊k_max / (2(t+1))⌋, and the active set is the union of their token ids
plus the EOS ids. Clusters partition the vocabulary, so the union is a concatenation of disjoint id lists:
the ids are stored grouped by cluster (CSR) and the union is one ``torch.cat`` of k slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynvocab.artifacts import ClusterTable
from dynvocab.artifacts.router import DEFAULT_K_MAX, RouterTable, clusters_checksum
from dynvocab.budget import pa_budget
from dynvocab.errors import DynvocabError
from dynvocab.runtime.heads.active_set import ActiveSet, RowRanges
from dynvocab.runtime.selection.base import VocabPolicy
from dynvocab.runtime.selection.groups import Groups
from dynvocab.runtime.selection.context_select import RouterSelector


@dataclass(frozen=True)
class DynaSpecConfig:
    """DynaSpec's runtime knobs (§4.2). The router's training settings (top-L, width) live in its bundle stage."""

    k_max: int = DEFAULT_K_MAX  # clusters at steps 0 and 1 (the paper gives none for M = 1024; see DEFAULT_K_MAX)
    divisor: int = 2  # k_c(t) = ⌊k_max / (divisor · (t+1))⌋ for t ≥ 2 (§4.2: 2)
    position_aware: bool = True  # False: k_max clusters at every step (the paper's DynaSpec-F, Figure 2)

    def budget(self, step: int) -> int:
        """k_c(step), the number of clusters at draft step ``step`` (0-based)."""
        return pa_budget(self.k_max, step, self.divisor) if self.position_aware else self.k_max


class DynaSpecPolicy(VocabPolicy):
    """Per draft step: route (h, E(x)) to the top-k_c(t) clusters and return the union of their ids (+ EOS)."""

    name = "dynaspec"

    def __init__(
        self,
        cfg: DynaSpecConfig,
        clusters: ClusterTable,
        router: RouterTable,
        embedding: torch.Tensor,
        vocab_size: int,
        eos: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ):
        """``embedding`` [V, d_e] is the draft's input embedding; only ids < ``vocab_size`` are ever returned."""
        if cfg.k_max < 1 or cfg.divisor < 1:
            raise DynvocabError(f"dynaspec needs k_max ≥ 1 and divisor ≥ 1 (got {cfg.k_max}, {cfg.divisor})")
        m = clusters.num_clusters
        if int(router.config["num_clusters"]) != m:
            raise DynvocabError(
                f"the router scores {router.config['num_clusters']} clusters but the bundle has {m}; "
                "retrain it with `dynvocab train-router`"
            )
        self.cfg = cfg
        self.device = torch.device(device)
        self.router = router.module(self.device)
        self.embedding = embedding  # [V, d_e], any dtype; rows are cast to float32 when read
        eos = torch.empty(0, dtype=torch.long) if eos is None else eos.long()
        self.groups = Groups(clusters.assign[:vocab_size], m, eos, self.device)
        # the routing both hosts run (the vLLM plugin batches it): one row here
        self.selector = RouterSelector(self.router, clusters.assign[:vocab_size].to(self.device), m, cfg.k_max,
                                       self.groups.eos, cfg.divisor, cfg.position_aware)
        self.calls = 0  # draft steps routed

    @classmethod
    def from_context(cls, cfg: DynaSpecConfig, ctx) -> "DynaSpecPolicy":
        """Build from a :class:`~dynvocab.runtime.registry.PolicyContext` whose bundle has the clusters and router
        stages (:func:`~dynvocab.runtime.registry.make_policy` checks them) and a draft."""
        bundle = ctx.bundle
        if ctx.draft is None:
            raise DynvocabError("strategy 'dynaspec' needs a draft model; pass --draft")
        router = RouterTable.from_bundle(bundle)
        if router.config.get("clusters_sha256") != clusters_checksum(bundle):
            raise DynvocabError(
                f"the router in {bundle.path} was trained for other clusters (the clusters stage was rebuilt since); "
                f"retrain it with `dynvocab train-router --bundle {bundle.path}`"
            )
        embedding = ctx.draft.embedding  # [V, d_e]
        hidden = ctx.draft.hidden_size  # the head's input: the hidden state the loop passes
        if (int(router.config["hidden_dim"]), int(router.config["embed_dim"])) != (hidden, embedding.shape[1]):
            raise DynvocabError(
                f"the router in {bundle.path} expects hidden size {router.config['hidden_dim']}, the draft has {hidden}; "
                f"retrain it with `dynvocab train-router --bundle {bundle.path} --draft …`"
            )
        policy = cls(cfg, ClusterTable.from_bundle(bundle), router, embedding, ctx.vocab_size, ctx.eos, ctx.device)
        ctx.draft.prepare_rows(policy.order)  # the cluster order's rows, packed now and kept across prompts
        return policy

    @torch.inference_mode()
    def route(self, hidden: torch.Tensor, token: torch.Tensor, step: int) -> torch.Tensor:
        """The clusters [k_c(step)] routed for the draft's hidden state ``hidden`` [1, d] and the token [1] it was
        fed (:meth:`RouterSelector.route`, as the vLLM plugin runs it on a batch)."""
        e = self.embedding.index_select(0, token.to(self.embedding.device)).to(self.device, torch.float32)  # [1, d_e]
        return self.selector.route(hidden.to(self.device, torch.float32), e, step)[0]

    @torch.inference_mode()
    def select(self, clusters: torch.Tensor) -> tuple[RowRanges, torch.Tensor]:
        """The union of ``clusters`` [k] as row ranges of the cluster-grouped order, and the EOS ids outside them,
        LongTensor [e]: two disjoint segments."""
        return self.groups.select(clusters)

    @property
    def order(self) -> torch.Tensor:
        """[V] ids grouped by cluster: the order the head packs once."""
        return self.groups.order

    def active_ids(self, step: int, hidden: torch.Tensor | None = None,
                   token: torch.Tensor | None = None) -> ActiveSet:
        """The active set at draft step ``step`` for the draft's ``hidden`` [1, d] and last fed ``token`` [1]:
        two segments, the routed clusters (:class:`~dynvocab.runtime.heads.active_set.RowRanges`) and the EOS ids
        outside them."""
        if hidden is None or token is None:
            raise ValueError("dynaspec routes on the draft hidden state and token; the loop must pass both")
        self.calls += 1
        return ActiveSet.of(*self.select(self.route(hidden, token, step)))
