"""Our hybrid: MicroSpec's request window ∪ a small static core ∪ per-step candidates ∪ (in dynvocab's loop) EvoSpec's
neighbours of missed tokens. One selector (:class:`HybridSelector`) for every host:

- **Request window** (:mod:`.window`): the distinct ids of the request's last ``window`` stream entries; each host
  pushes the stream it sees (the loop MicroSpec's, a batched host the request's tokens).
- **Static core** (FR-Spec): the ``core_size`` most frequent tokens (EOS first), packed once. With ``pa_core`` the
  core shrinks with the draft position as DynaSpec's position-aware budget (⌊core/(t+1)⌋ for t ≥ 2): later positions
  matter less for acceptance, so they get the context plus only the most frequent tokens.
- **Per-step candidates** (EvoSpec's retrieval, moved to every draft step): the draft's own likely next tokens, found
  without its full head: the top-``step_neighbours`` rows of an HNSW index over the draft's LM head for each row's
  hidden state (bundle stage ``draft_hnsw``, :class:`~..head_search.HeadSearch`) and the ``step_successors`` most
  likely graph successors of the token each row was fed (stage ``graph``). They catch content words that are neither
  frequent nor in the context yet, the main cause of rejections with a small active set. In the loop by default only
  where the search measures under a quarter of the draft's full head (:func:`~..head_search.search_pays`). On a GPU
  the index search would need the hidden state on the host at every step (a sync costing more than the whole head
  there), so it runs on CPU devices only unless ``step_search_on_gpu`` is set.
- **Neighbours on misses** (EvoSpec; the loop only, which sees the target's logits): when the target's token at the
  first rejected position was outside the active set, the target's top-``miss_topk`` there, HNSW neighbours of the
  target hidden state (bundle stage ``hnsw``) and graph successors of the token and those seeds, round-robin by rank
  (EvoSpec's own ``assemble_candidates``) join the stream, at most ``max_insert`` per miss, and age out with it.

A batched host scores the core (shared) and each row's window and candidates (padding repeats ids); the loop's chain
gets three disjoint segments (window \\ core, core prefix, per-step candidates), so the draft head keeps the core
packed once and copies only the window rows that changed; a tree depth's nodes each their own candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from dynvocab.artifacts import mips_search
from dynvocab.artifacts.bundle import Bundle
from dynvocab.budget import pa_budget
from dynvocab.errors import DynvocabError
from dynvocab.runtime.heads.active_set import ActiveSet, NodeSets, Prefix
from dynvocab.runtime.heads.selected_head import BatchSets
from dynvocab.runtime.host import to_host, to_host_tensor
from dynvocab.runtime.selection.base import CycleReport
from dynvocab.runtime.selection.batch_select import ContextSelector, StepContext, bundle_core, eos_first
from dynvocab.runtime.selection.candidates import assemble_candidates
from dynvocab.runtime.selection.context.window import MicroSpecConfig, StreamPolicy
from dynvocab.runtime.selection.head_search import ENGINE_EF, HeadSearch


@dataclass(frozen=True)
class HybridConfig:
    """Knobs of the hybrid; window/K defaults from MicroSpec, miss handling from EvoSpec (top-10, ≤8, ≤32)."""

    core_size: int = 2048
    pa_core: bool = False
    window: int = 3072
    k_pre: int = 3
    k_ver: int = 3
    draft_alternatives: int = 3
    # As MicroSpecConfig's, but None means 0: the prompt's own tokens seed the window, as in the vLLM plugin (the
    # target's top-K_pre over the prompt's positions cost more than they gained: 1.13-1.18x full against
    # 1.09-1.13x at MicroSpec's default, 1.14x against 0.95x on replayed conversations; docs/measurements/
    # 2026-12-07-prefill-positions-and-vllm-switching.md).
    prefill_positions: int | None = None
    miss_topk: int = 10
    successors: int = 8
    max_insert: int = 32
    step_neighbours: int | None = None  # per draft step: draft-head HNSW neighbours of the hidden state (0: off)
    step_ef: int = 512  # HNSW ef for those searches (demo: MAL 96.7% of full at 256, 98.9% at 512)
    step_successors: int | None = None  # per draft step: graph successors of the token just fed (0: off)
    step_search_on_gpu: bool = False  # run the per-step HNSW search on CUDA devices too (a host sync per step)

    def for_draft(self, searches_per_step: bool) -> HybridConfig:
        """This config with the per-step candidates left unset (None) decided: 16 HNSW neighbours and 8 graph
        successors where the per-step search pays for the draft (measured against its full head,
        :func:`~dynvocab.runtime.selection.head_search.search_pays`), none where it does not."""
        neighbours, successors = (16, 8) if searches_per_step else (0, 0)
        return replace(
            self,
            step_neighbours=neighbours if self.step_neighbours is None else self.step_neighbours,
            step_successors=successors if self.step_successors is None else self.step_successors,
        )

    def searches_per_step(self, device) -> bool:
        """Whether the per-step draft-head search runs on ``device`` (unset neighbours count as a draft model's)."""
        neighbours = self.for_draft(searches_per_step=True).step_neighbours
        return neighbours > 0 and (torch.device(device).type == "cpu" or self.step_search_on_gpu)


class HybridSelector(ContextSelector):
    """``hybrid``: ``core`` [C] (EOS first, then by frequency; its first ``core_size(t)`` ids at draft position t),
    each row's request window, the ``successors`` most likely graph successors of the token each row was fed, and
    each row's ``search`` hits (``vocab_size``: the draft's, where the selector serves a chain or a tree)."""

    name = "hybrid"

    def __init__(self, core: torch.Tensor, window: int, graph=None, successors: int = 8,
                 search: HeadSearch | None = None, pa_core: bool = False, min_core: int = 0,
                 vocab_size: int | None = None):
        if window < 1:
            raise DynvocabError(f"hybrid needs a window of at least 1 token (got {window})")
        self.core, self.window, self.pa_core, self.min_core = core.long(), window, pa_core, min_core
        self.graph = graph  # dynvocab.artifacts.GraphTable on the selector's device, or None
        self.successors = successors if graph is not None else 0
        self.search = search
        self.reads = frozenset({"fed", "window"} | ({"head"} if search is not None else set()))
        self.k = int(core.numel()) + window + self.successors + (search.neighbours if search is not None else 0)
        self.vocab = vocab_size  # the draft's vocabulary: per-step candidates past it are dropped
        if vocab_size is not None:  # a chain's or a tree's candidates are filtered by index, not searched for
            self.core_rank = torch.full((vocab_size,), vocab_size, dtype=torch.long, device=core.device)  # [V]
            self.core_rank[self.core] = torch.arange(core.numel(), device=core.device)
        self._prefixes: dict[int, Prefix] = {}  # the core's first k ids: one ranking, so the head slices it
        self._window: tuple | None = None  # (the loop's window row, its ids outside the core as a segment, [V] mask)
        self._none = torch.empty(0, dtype=torch.long, device=core.device)

    def prepare(self, head: torch.Tensor) -> None:
        if self.search is not None:
            self.search.prepare(head)

    def core_size(self, step: int) -> int:
        """Core ids active at draft position ``step``."""
        n = self.core.numel()
        return max(self.min_core, min(n, pa_budget(n, step))) if self.pa_core else n

    def _core(self, k: int) -> Prefix:
        if k not in self._prefixes:
            self._prefixes[k] = Prefix(self.core, k)
        return self._prefixes[k]

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        if ctx.windows is None:
            raise DynvocabError("hybrid reads the request's window; the host keeps none")
        parts = [ctx.windows]
        if self.successors and ctx.fed is not None:
            parts.append(self.graph.top_successors(ctx.fed[:, None], self.successors, ctx.windows[:, :1]))
        found = self.search(hidden, ctx.head) if self.search is not None else None
        if found is not None:
            parts.append(found)
        rows = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        return BatchSets(self._core(self.core_size(ctx.step)).ids, rows)

    def row_set(self, hidden: torch.Tensor | None, ctx: StepContext) -> ActiveSet:
        """A chain's step: three disjoint segments, the window's ids outside the core (the same segment while the
        host hands the same window), the core prefix for this position, the per-step candidates (a changed set)."""
        k = self.core_size(ctx.step)
        window = self._window_segment(ctx.windows)
        return ActiveSet.of(window, self._core(k), self._candidates(hidden, ctx.fed, k))

    def node_sets(self, hidden: torch.Tensor, ctx: StepContext) -> NodeSets | None:
        """A tree depth's nodes ``hidden`` [K, d], fed ``ctx.fed`` [K]: the window and the core prefix for every node,
        and each node's own per-step candidates (None where the hybrid searches nothing per step)."""
        if not (self.search is not None or self.successors):
            return None
        k = self.core_size(ctx.step)
        window, core = self._window_segment(ctx.windows), self._core(k)
        found = [self._candidates(hidden[i : i + 1], ctx.fed[i : i + 1], k) for i in range(hidden.shape[0])]
        union = torch.unique(torch.cat(found))  # [u]
        shared = torch.ones(len(found), window.size + core.size, dtype=torch.bool, device=union.device)
        own = torch.cat([shared, torch.stack([torch.isin(union, ids) for ids in found])], dim=1)
        return NodeSets(ActiveSet.of(window, core, union), own)

    def _window_segment(self, windows: torch.Tensor) -> Prefix:
        """The window's ids outside the core, kept (with whether each id [V] is among them) while the host hands the
        same window."""
        if self._window is None or self._window[0] is not windows:
            ids = windows[0]
            ids = ids[self.core_rank[ids] >= self.core.numel()]
            member = torch.zeros(self.vocab, dtype=torch.bool, device=ids.device)
            member[ids] = True
            self._window = (windows, Prefix.whole(ids), member)
        return self._window[1]

    def _candidates(self, hidden, fed, core_size: int) -> torch.Tensor:
        """One row's search hits for ``hidden`` [1, d] and graph successors of ``fed`` [1] that are not already
        active (outside the window segment and the first ``core_size`` core ids), LongTensor [n], ascending."""
        parts = []
        if self.search is not None and hidden is not None:
            parts.append(self.search(hidden[-1:], None).flatten())
        if self.successors and fed is not None:
            parts.append(self.graph.top_successors(fed, self.successors, self.vocab, below=self.vocab))
        if not parts:
            return self._none
        ids = torch.unique(torch.cat(parts).to(self.core.device))
        ids = ids[ids < self.vocab]
        return ids[~self._window[2][ids] & (self.core_rank[ids] >= core_size)]


def hybrid_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                       device: torch.device, cfg, window: int | None = None) -> HybridSelector:
    """``hybrid`` in a batched host: a core of the ``budget`` most frequent ids (EOS first), the window of ``cfg`` (a
    :class:`HybridConfig` with its per-step candidates decided; the strategy registers the hybrid's defaults as a
    draft model's), the bundle's graph successors where it has a ``graph`` stage, and on a CPU its ``draft_hnsw``
    search for a head of this hidden size (:data:`~..head_search.ENGINE_EF`)."""
    from dynvocab.artifacts import GraphTable, HnswParams, StoredIndex

    core = bundle_core(bundle, vocab_size, device, budget)
    graph = GraphTable.from_bundle(bundle).to(device) if bundle.has("graph") else None
    search = None
    if bundle.has("draft_hnsw") and torch.device(device).type == "cpu":
        params = HnswParams.from_dict(bundle.info("draft_hnsw")["index"], f"bundle {bundle.path} (stage draft_hnsw)")
        if params.hidden == hidden_size:  # read the stage (its graph is tens of MB) only for a head it fits
            search = HeadSearch(StoredIndex.read(bundle, "draft_hnsw"), cfg.step_neighbours, ENGINE_EF)
    return HybridSelector(core, window or cfg.window, graph, cfg.step_successors, search, vocab_size=vocab_size)


class HybridPolicy(StreamPolicy):
    """``hybrid`` in dynvocab's loop: its selector over MicroSpec's stream, and the neighbours of missed tokens pushed
    into it. ``ranking``: the frequency ranking (the core: ``pinned`` (EOS) first, ``core_size`` ids in all);
    ``graph``, ``hnsw`` (a MipsIndex over the target's head) and ``draft_hnsw`` (over the draft's) where the bundle
    has them."""

    def __init__(self, cfg: HybridConfig, vocab_size: int, device, ranking: torch.Tensor,
                 pinned: torch.Tensor | None = None, graph=None, hnsw=None, draft_hnsw=None):
        self.hcfg = cfg = cfg.for_draft(searches_per_step=True)  # no-op when the caller decided for its draft
        pinned = torch.empty(0, dtype=torch.long) if pinned is None else pinned
        core = eos_first(ranking.to(device), pinned, cfg.core_size)
        search = HeadSearch.over(draft_hnsw, cfg.step_neighbours, cfg.step_ef) if (
            draft_hnsw is not None and cfg.step_neighbours) else None
        selector = HybridSelector(core, cfg.window, None if graph is None else graph.to(device),
                                  cfg.step_successors, search, cfg.pa_core, pinned.numel(), vocab_size)
        stream = MicroSpecConfig(cfg.k_pre, cfg.k_ver, cfg.window, cfg.draft_alternatives, cfg.prefill_positions or 0)
        super().__init__(selector, stream, vocab_size, device)
        self.hnsw = hnsw
        empty = np.zeros(1, dtype=np.int64)
        self._csr = (graph.indptr.numpy(), graph.indices.numpy()) if graph is not None else (empty, empty[:0])
        self._in_core = to_host_tensor(selector.core_rank < core.numel()).numpy()  # [V] bool
        self.misses = 0

    def seen(self, cycle: CycleReport) -> list[torch.Tensor]:
        """A miss (the target's token at the first rejected position was outside that step's active set): its
        candidates (at most ``max_insert``), EvoSpec's retrieval over the target's top ids there and the HNSW
        neighbours of its hidden state (:func:`~dynvocab.runtime.selection.candidates.assemble_candidates`)."""
        k, cfg = cycle.accepted, self.hcfg
        if not (k < len(cycle.draft_tokens) and k < len(cycle.emitted) and k < len(cycle.active_sets)):
            return []
        token = cycle.emitted[k]
        if cycle.active_sets[k].contains(token):
            return []
        self.misses += 1
        top = to_host(cycle.target_logits[k, : self.vocab_size].topk(cfg.miss_topk).indices)
        semantic = []
        if self.hnsw is not None:
            query = to_host_tensor(cycle.target_hidden[k : k + 1].float())
            semantic = to_host(mips_search(self.hnsw, query, cfg.miss_topk)[0])
        found = assemble_candidates(token, top, semantic, *self._csr, cfg.successors, self._in_core)
        return [torch.tensor(found[: cfg.max_insert], dtype=torch.long)]
