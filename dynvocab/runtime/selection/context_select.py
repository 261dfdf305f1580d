"""One selector, two hosts, for the strategies that read the request's context: the draft position, the token the
draft was fed, and the request's own tokens. Each is a batched function ``(hidden [B, d], StepContext) -> sets``
(:class:`~.batch_select.BatchSets`: a part the same for every row, kept packed by the head, and each row's own
part, a fixed number of ids per row); a batched host (the vLLM plugin, :mod:`dynvocab.serving.vllm.context`) fills the
:class:`StepContext` from its engine, dynvocab's own loop from its cycle.

- :class:`PositionSelector` (``fr-pa``): the first ``pa_budget(k_max, t)`` ids of the frequency ranking at draft
  position t, the same for every row (FR-Spec's position-aware budget, DynaSpec appendix A.1).
- :class:`RouterSelector` (``dynaspec``): the router scores the clusters from the hidden state and the fed token's
  embedding; each row's top ``k_c(t)`` clusters, as ids padded to the largest such union, and the EOS ids.
  :class:`~dynvocab.runtime.selection.dynaspec.DynaSpecPolicy` routes through the same :meth:`RouterSelector.route`.
- :class:`WindowSelector` (``microspec``): each row's request window (:class:`RequestWindows`: the distinct ids of
  the request's last W tokens) and the EOS ids.
- :class:`HybridSelector` (``hybrid``): a static core of the most frequent ids, the request window, the graph
  successors of the fed token, and on a CPU the draft head's rows nearest each hidden state (:class:`HeadSearch`,
  bundle stage ``draft_hnsw``: the retrieval :class:`~dynvocab.runtime.selection.hybrid.HybridPolicy` runs at every
  draft step).
- ``evospec``: :class:`~dynvocab.runtime.selection.evospec_select.EvoSpecSelector`, whose per-request ARC caches
  change between cycles (its own module).

Padding repeats an id of the row: its logits equal the id's own, so the argmax and the scattered row are the same
as with one copy (the head multiplies each distinct id once, :class:`~.selected_head.SelectedHead`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dynvocab.artifacts.bundle import Bundle
from dynvocab.artifacts.hnsw import MipsIndex, mips_search
from dynvocab.artifacts.router import DEFAULT_K_MAX
from dynvocab.budget import pa_budget
from dynvocab.errors import DynvocabError
from dynvocab.runtime.host import to_host_tensor
from dynvocab.runtime.selection.batch_select import BatchSets, bundle_eos

# HNSW ef of the hybrid's per-step search in a batched host: on the demo pair in vLLM-CPU (bfloat16, one request) ef 32
# kept 97.2% of the full head's MAL and ef 64 and 128 98.3%
# (docs/measurements/2026-11-27-vllm-demo-context-strategies.md); one query took ~0.45 / 0.58 / 0.85 ms outside the
# engine
ENGINE_EF = 64


@dataclass(frozen=True)
class StepContext:
    """What a context selector reads at one draft step of a batch of B rows."""

    step: int  # the draft position t (0-based), the same for every row
    fed: torch.Tensor | None = None  # [B] the token each row's draft was fed at this step (None: not known)
    windows: torch.Tensor | None = None  # [B, W] each row's request window (None: the host keeps none)
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None  # ids [n] -> the draft's input embeddings [n, d_e]
    head: torch.Tensor | None = None  # [V, d] every row of the draft's head (None: the host holds a shard or none)
    requests: tuple | None = None  # [B] each row's request key (None: the host keeps none)
    target: torch.Tensor | None = None  # [B, d] the target's hidden state that produced each row's fed token, at
    # draft position 0 (None: not known, or not the target's last layer: an EAGLE-3 head gets its mid layers)


class ContextSelector:
    """``select(hidden [B, d], ctx) -> BatchSets``; ``reads`` names what of the context it needs ("fed",
    "window", "head") so a host captures only that; ``window`` is the request window's size in tokens (0: none)."""

    reads_context = True  # SelectedHead passes it the step's context
    reads: frozenset[str] = frozenset()
    window: int = 0
    k: int = 0  # ids per row at draft position 0 (the bench reports it)

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        raise NotImplementedError

    def prepare(self, head: torch.Tensor) -> None:
        """Build ahead what the selector lays over the draft head's rows ``head`` [V, d] (a host calls it once its
        weights are loaded, so no request's first step pays for it); nothing for most selectors."""


def head_eos_ids(bundle: Bundle, vocab_size: int, device) -> torch.Tensor:
    """The bundle's EOS ids (:func:`~.batch_select.bundle_eos`) a head of ``vocab_size`` rows has."""
    eos = bundle_eos(bundle).long()
    return eos[eos < vocab_size].to(device)


def eos_first_ranking(bundle: Bundle, vocab_size: int, eos: torch.Tensor, device) -> torch.Tensor:
    """The bundle's frequency ranking over a head of ``vocab_size`` rows, the EOS ids first (every prefix has them)."""
    from dynvocab.artifacts.tables import FreqTable

    ranking = FreqTable.from_bundle(bundle).ranking.long()
    ranking = ranking[ranking < vocab_size].to(device)
    return torch.cat([eos, ranking[~torch.isin(ranking, eos)]])


class PositionSelector(ContextSelector):
    """``fr-pa``: the first ``pa_budget(k_max, t)`` ids of ``ranking`` at draft position t, for every row."""

    def __init__(self, ranking: torch.Tensor, k_max: int):
        if not 1 <= k_max <= ranking.numel():
            raise DynvocabError(f"fr-pa needs between 1 and {ranking.numel()} ids (got {k_max})")
        self.ranking, self.k_max, self.k = ranking.long(), k_max, k_max

    def size(self, step: int) -> int:
        """Ids at draft position ``step``."""
        return pa_budget(self.k_max, step)

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        return BatchSets(self.ranking[: self.size(ctx.step)], None)


class RouterSelector(ContextSelector):
    """``dynaspec``: route (hidden, embedding of the fed token) to each row's top ``k_c(t)`` clusters; their ids,
    one after another, padded to the largest such union at that position (repeating the row's first id), and the
    EOS ids."""

    reads = frozenset({"fed"})

    def __init__(self, router: torch.nn.Module, assign: torch.Tensor, num_clusters: int, k_max: int,
                 eos: torch.Tensor, divisor: int = 2, position_aware: bool = True):
        """``assign`` [V] the cluster of each draftable id; ``router(h [B, d], e [B, d_e]) -> scores [B, M]``."""
        if k_max < 1:
            raise DynvocabError(f"dynaspec needs at least 1 cluster (got {k_max})")
        self.router, self.k_max, self.divisor, self.position_aware = router, k_max, divisor, position_aware
        assign = assign.long()
        self.order = torch.argsort(assign, stable=True)  # [V] ids grouped by cluster
        self.sizes = torch.bincount(assign, minlength=num_clusters)  # [M]
        self.starts = self.sizes.cumsum(0) - self.sizes  # [M] each cluster's first slot in ``order``
        self.largest = torch.sort(self.sizes, descending=True).values.cumsum(0).tolist()  # the n largest clusters' ids
        self.eos = eos.long().to(assign.device)
        self.k = self.width(self.budget(0)) + int(self.eos.numel())

    def budget(self, step: int) -> int:
        """k_c(step): the clusters routed at draft position ``step``."""
        return pa_budget(self.k_max, step, self.divisor) if self.position_aware else self.k_max

    def width(self, clusters: int) -> int:
        """Ids per row for ``clusters`` routed clusters: as many as the largest of them hold together."""
        return self.largest[min(clusters, len(self.largest)) - 1]

    def route(self, hidden: torch.Tensor, embedded: torch.Tensor, step: int) -> torch.Tensor:
        """The top ``k_c(step)`` clusters [B, k_c] of each row, for its ``hidden`` [B, d] and fed token's
        ``embedded`` [B, d_e] (dynvocab's own loop routes one row through this too)."""
        scores = self.router(hidden.float(), embedded.float())  # [B, M]
        return scores.topk(min(self.budget(step), scores.shape[1]), dim=-1).indices

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        if ctx.fed is None or ctx.embed is None:
            raise DynvocabError("dynaspec routes on the fed token's embedding; the host gave none")
        picked = self.route(hidden, ctx.embed(ctx.fed), ctx.step)  # [B, k_c]
        lens = self.sizes[picked]  # [B, k_c]
        ends = lens.cumsum(1)  # [B, k_c] where each picked cluster's ids end in the row
        slots = torch.arange(self.width(picked.shape[1]), device=picked.device).repeat(picked.shape[0], 1)  # [B, w]
        which = torch.searchsorted(ends, slots, right=True).clamp(max=picked.shape[1] - 1)  # [B, w] its cluster
        offset = slots - (ends - lens).gather(1, which)  # [B, w] the slot within that cluster
        ids = self.order[(self.starts[picked.gather(1, which)] + offset).clamp(0, self.order.numel() - 1)]
        inside = slots < ends[:, -1:]  # past the row's own ids: padding
        ids = torch.where(inside, ids, ids[:, :1])
        return BatchSets(self.eos if self.eos.numel() else None, ids)


class WindowSelector(ContextSelector):
    """``microspec`` in a batched host: each row's request window (the distinct ids of its last ``window`` tokens)
    and the EOS ids."""

    reads = frozenset({"window"})

    def __init__(self, window: int, eos: torch.Tensor):
        if window < 1:
            raise DynvocabError(f"microspec needs a window of at least 1 token (got {window})")
        self.window, self.eos = window, eos.long()
        self.k = window + int(self.eos.numel())

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        if ctx.windows is None:
            raise DynvocabError("microspec reads the request's window; the host keeps none")
        return BatchSets(self.eos if self.eos.numel() else None, ctx.windows)


class HeadSearch:
    """Each row's ``neighbours`` draft-head rows of the largest inner product with its hidden state, found by the
    HNSW index of a bundle's ``draft_hnsw`` stage (:func:`~dynvocab.artifacts.hnsw.mips_search`, the search the
    hybrid runs at every draft step in dynvocab's own loop). The index is laid over the head the host hands it, once
    per head; a head of another shape (a shard, another model) gets no search: smaller sets, the same output.
    It reads the hidden state on the host, so hosts run it on CPU devices only."""

    def __init__(self, stored, neighbours: int, ef: int):
        """``stored``: the stage as read (:class:`~dynvocab.artifacts.hnsw.StoredIndex`)."""
        if neighbours < 1 or ef < 1:
            raise DynvocabError(f"the per-step search needs at least 1 neighbour and ef 1 (got {neighbours}, {ef})")
        self.stored, self.neighbours, self.ef = stored, neighbours, max(ef, neighbours)
        self._over: tuple | None = None  # (the head's data pointer, its MipsIndex)

    def prepare(self, head: torch.Tensor | None) -> MipsIndex | None:
        """The index over ``head`` [V, d] (its first ``num_elements`` rows; rows past them are padding), built on
        the first call for that head (about 6 s for 151,936 rows of 896), or None where the head is not the indexed
        one."""
        params = self.stored.params
        if head is None or head.shape[0] < params.num_elements or head.shape[1] != params.hidden:
            return None
        if self._over is None or self._over[0] != head.data_ptr():
            index = self.stored.over(head[: params.num_elements])
            index.set_ef(self.ef)
            self._over = (head.data_ptr(), index)
        return self._over[1]

    def __call__(self, hidden: torch.Tensor, head: torch.Tensor | None) -> torch.Tensor | None:
        """Ids [B, neighbours] on ``hidden``'s device, or None where ``head`` [V, d] is not the indexed one."""
        index = self.prepare(head)
        if index is None:
            return None
        threads = min(int(hidden.shape[0]), torch.get_num_threads())
        return mips_search(index, to_host_tensor(hidden), self.neighbours, num_threads=threads).to(hidden.device)


class HybridSelector(ContextSelector):
    """``hybrid`` in a batched host: a static core (EOS and the most frequent ids), each row's request window, the
    ``successors`` most likely graph successors of the token each row was fed, and each row's ``search`` hits."""

    def __init__(self, core: torch.Tensor, window: int, graph=None, successors: int = 8,
                 search: HeadSearch | None = None):
        if window < 1:
            raise DynvocabError(f"hybrid needs a window of at least 1 token (got {window})")
        self.core, self.window = core.long(), window
        self.graph = graph  # dynvocab.artifacts.GraphTable on the selector's device, or None
        self.successors = successors if graph is not None else 0
        self.search = search
        self.reads = frozenset({"fed", "window"} | ({"head"} if search is not None else set()))
        self.k = int(core.numel()) + window + self.successors + (search.neighbours if search is not None else 0)

    def prepare(self, head: torch.Tensor) -> None:
        if self.search is not None:
            self.search.prepare(head)

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        if ctx.windows is None:
            raise DynvocabError("hybrid reads the request's window; the host keeps none")
        parts = [ctx.windows]
        if self.successors and ctx.fed is not None:
            parts.append(self.graph.top_successors(ctx.fed[:, None], self.successors, ctx.windows[:, :1]))
        found = self.search(hidden, ctx.head) if self.search is not None else None
        if found is not None:
            parts.append(found)
        return BatchSets(self.core, torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])


def position_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                         device: torch.device) -> PositionSelector:
    """``fr-pa``: the bundle's frequency ranking (EOS first), ``budget`` ids at draft positions 0 and 1."""
    eos = head_eos_ids(bundle, vocab_size, device)
    return PositionSelector(eos_first_ranking(bundle, vocab_size, eos, device), budget)


def router_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                       device: torch.device) -> RouterSelector:
    """``dynaspec``: the bundle's clusters and router, ``budget`` clusters at draft positions 0 and 1."""
    from dynvocab.artifacts import ClusterTable
    from dynvocab.artifacts.router import RouterTable, clusters_checksum

    router = RouterTable.from_bundle(bundle)
    if router.config.get("clusters_sha256") != clusters_checksum(bundle):
        raise DynvocabError(f"the router in {bundle.path} was trained for other clusters; retrain it with "
                            f"`dynvocab train-router --bundle {bundle.path}`")
    if int(router.config["hidden_dim"]) != hidden_size:
        raise DynvocabError(f"the router in {bundle.path} reads hidden size {router.config['hidden_dim']}, the draft "
                            f"has {hidden_size}; retrain it with `dynvocab train-router --bundle {bundle.path}`")
    clusters = ClusterTable.from_bundle(bundle)
    return RouterSelector(router.module(device), clusters.assign[:vocab_size].to(device), clusters.num_clusters,
                          budget, head_eos_ids(bundle, vocab_size, device))


def window_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                       device: torch.device) -> WindowSelector:
    """``microspec``: a window of ``budget`` tokens per request and the bundle's EOS ids."""
    return WindowSelector(budget, head_eos_ids(bundle, vocab_size, device))


def hybrid_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                       device: torch.device, cfg, window: int | None = None) -> HybridSelector:
    """``hybrid``: a core of the ``budget`` most frequent ids (EOS first), the window of ``cfg`` (a
    :class:`~dynvocab.runtime.selection.hybrid.HybridConfig` with its per-step candidates decided; the strategy
    registers the hybrid's defaults as a draft model's), the bundle's graph successors where it has a ``graph``
    stage, and on a CPU its ``draft_hnsw`` search for a head of this hidden size (:data:`ENGINE_EF`)."""
    from dynvocab.artifacts import GraphTable, HnswParams, StoredIndex

    eos = head_eos_ids(bundle, vocab_size, device)
    core = eos_first_ranking(bundle, vocab_size, eos, device)[: max(budget, eos.numel())]
    graph = GraphTable.from_bundle(bundle).to(device) if bundle.has("graph") else None
    search = None
    if bundle.has("draft_hnsw") and torch.device(device).type == "cpu":
        params = HnswParams.from_dict(bundle.info("draft_hnsw")["index"], f"bundle {bundle.path} (stage draft_hnsw)")
        if params.hidden == hidden_size:  # read the stage (its graph is tens of MB) only for a head it fits
            search = HeadSearch(StoredIndex.read(bundle, "draft_hnsw"), cfg.step_neighbours, ENGINE_EF)
    return HybridSelector(core, window or cfg.window, graph, cfg.step_successors, search)


def fixed_budget(size: int):
    """A default budget that does not depend on the bundle: ``(bundle, vocab_size) -> min(size, vocab_size)``."""
    return lambda bundle, vocab_size: min(size, vocab_size)


def router_budget(bundle: Bundle, vocab_size: int) -> int:
    """``dynaspec``'s default clusters at positions 0 and 1: DynaSpec's k_max."""
    return DEFAULT_K_MAX

