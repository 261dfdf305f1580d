"""Our hybrid: MicroSpec's context stream ∪ a small static core ∪ EvoSpec-style neighbours on misses.

- **Context stream** (MicroSpec): prompt tokens, target top-K at prompt and verified positions, the draft's
  tokens and top alternatives; the active part is the unique tokens of the last ``window`` entries.
- **Static core** (FR-Spec): the ``core_size`` most frequent tokens, packed once. With ``pa_core`` the core
  shrinks with the draft position as DynaSpec's position-aware budget (⌊core/(t+1)⌋ for t ≥ 2): later
  positions matter less for acceptance, so they get the context plus only the most frequent tokens.
- **Per-step candidates** (EvoSpec's retrieval, moved to every draft step): the draft's own likely next
  tokens, found without its full head: the top-``step_neighbours`` rows of an HNSW index over the draft's
  LM head for the draft hidden state (bundle stage ``draft_hnsw``) and the ``step_successors`` most likely
  graph successors of the token just fed (stage ``graph``). They catch content words that are neither frequent
  nor in the context yet, the main cause of rejections with a small active set. By default only where the search
  measures under a quarter of the draft's full head (:mod:`.step_search`): an int8 head or an EAGLE head's
  few-millisecond step would be dominated by it. On a GPU the index search
  would need the hidden state on the host at every step (a sync costing more than the whole head there), so
  it runs on CPU devices only unless ``step_search_on_gpu`` is set.
- **Neighbours on misses** (EvoSpec): when the target's token at the first rejected position was outside the
  active set, the target's top-``miss_topk`` there, HNSW neighbours of the target hidden state (when the
  bundle has an ``hnsw`` stage) and graph successors of the token and those seeds, round-robin by rank (when it
  has a ``graph`` stage; EvoSpec's own ``assemble_candidates``) join the stream, at most ``max_insert`` per miss,
  and age out with it.

The active set is returned as three disjoint segments (context \\ core, core prefix, per-step candidates),
so the draft head keeps the core packed once and copies only the context rows that changed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from dynvocab.artifacts import mips_search
from dynvocab.budget import pa_budget
from dynvocab.runtime.heads.active_set import ActiveSet, NodeSets, Prefix
from dynvocab.runtime.host import to_host, to_host_tensor
from dynvocab.runtime.selection.base import CycleReport
from dynvocab.runtime.selection.context.microspec import MicroSpecConfig, MicroSpecPolicy, _unique_in_order
from dynvocab.runtime.selection.candidates import assemble_candidates


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
        :func:`~dynvocab.runtime.selection.context.step_search.search_pays`), none where it does not."""
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


class HybridPolicy(MicroSpecPolicy):
    """Context window ∪ static core (position-aware) ∪ neighbours of missed tokens."""

    name = "hybrid"

    def __init__(
        self,
        cfg: HybridConfig,
        vocab_size: int,
        device,
        ranking: torch.Tensor,
        pinned: torch.Tensor | None = None,
        graph=None,
        hnsw=None,
        draft_hnsw=None,
    ):
        window_cfg = MicroSpecConfig(cfg.k_pre, cfg.k_ver, cfg.window, cfg.draft_alternatives,
                                     0 if cfg.prefill_positions is None else cfg.prefill_positions)
        super().__init__(window_cfg, vocab_size, device)
        self.hcfg = cfg = cfg.for_draft(searches_per_step=True)  # no-op when the caller decided for its draft
        pinned = torch.empty(0, dtype=torch.long) if pinned is None else pinned
        core = _unique_in_order(torch.cat([pinned, ranking[: cfg.core_size]]).to(device))
        self.core = core  # [C] EOS first, then by frequency
        self.core_rank = torch.full((vocab_size,), vocab_size, dtype=torch.long, device=device)  # [V]
        self.core_rank[core] = torch.arange(core.numel(), device=device)
        self.min_core = pinned.numel()
        self.graph = graph  # dynvocab.artifacts.GraphTable or None
        empty = np.zeros(1, dtype=np.int64)
        self._csr = (graph.indptr.numpy(), graph.indices.numpy()) if graph is not None else (empty, empty[:0])
        self._device_graph = None if graph is None else graph.to(device)  # per-step successors, no host read
        self._in_core = (self.core_rank < core.numel()).cpu().numpy()  # [V] bool
        self.hnsw = hnsw  # a MipsIndex over the target head (dynvocab.artifacts.load_hnsw) or None
        self.draft_hnsw = draft_hnsw  # a MipsIndex over the draft head (load_hnsw(bundle, "draft_hnsw")) or None
        if draft_hnsw is not None:
            draft_hnsw.set_ef(cfg.step_ef)
        self._none = torch.empty(0, dtype=torch.long, device=device)
        self._views: dict[int, Prefix] = {}  # the core prefix of each length: one ranking, so the head slices
        self.misses = 0

    def core_size(self, step: int) -> int:
        """Core ids active at draft position ``step``."""
        if not self.hcfg.pa_core:
            return self.core.numel()
        return max(self.min_core, min(self.core.numel(), pa_budget(self.core.numel(), step)))

    def active_ids(self, step: int, hidden=None, token=None) -> ActiveSet:
        """Three disjoint segments: the context ids outside the core (``ids``, kept incrementally by MicroSpec),
        the core prefix for this position, the per-step candidates (a changed set)."""
        k = self.core_size(step)
        return ActiveSet.of(self.window_segment(), self._core(k), self.step_candidates(k, hidden, token))

    def node_sets(self, step: int, hidden: torch.Tensor, tokens: torch.Tensor) -> NodeSets | None:
        """A tree depth's nodes ``hidden`` [K, d], fed ``tokens`` [K]: the window and the core prefix for every node,
        and each node's own per-step candidates (None where the hybrid searches nothing per step)."""
        cfg = self.hcfg
        searches = self.draft_hnsw is not None and cfg.step_neighbours
        if not (searches or (self.graph is not None and cfg.step_successors)):
            return None
        k = self.core_size(step)
        found = [self.step_candidates(k, hidden[i : i + 1], tokens[i : i + 1]) for i in range(hidden.shape[0])]
        union = torch.unique(torch.cat(found))  # [u]
        window, core = self.window_segment(), self._core(k)
        shared = torch.ones(len(found), window.size + core.size, dtype=torch.bool, device=union.device)
        own = torch.cat([shared, torch.stack([torch.isin(union, ids) for ids in found])], dim=1)
        return NodeSets(ActiveSet.of(window, core, union), own)

    def _core(self, k: int) -> Prefix:
        """The core's first ``k`` ids, one segment per length (one ranking: the head slices it)."""
        if k not in self._views:
            self._views[k] = Prefix(self.core, k)
        return self._views[k]

    def step_candidates(self, core_size: int, hidden=None, token=None) -> torch.Tensor:
        """Draft-head neighbours of ``hidden`` [1, d] and graph successors of ``token`` [1] (on the device) that are
        not already active (outside the context and the first ``core_size`` core ids), LongTensor [n], ascending."""
        cfg = self.hcfg
        parts = []
        if self.draft_hnsw is not None and hidden is not None and cfg.step_neighbours:
            parts.append(mips_search(self.draft_hnsw, to_host_tensor(hidden[-1:]), cfg.step_neighbours).flatten())
        if self.graph is not None and token is not None and cfg.step_successors:
            parts.append(self._device_graph.top_successors(token, cfg.step_successors, self.vocab_size,
                                                           below=self.vocab_size))
        if not parts:
            return self._none
        ids = torch.unique(torch.cat(parts).to(self.core.device))
        ids = ids[ids < self.vocab_size]
        return ids[~self.member[ids] & (self.core_rank[ids] >= core_size)]

    def observe(self, cycle: CycleReport) -> None:
        """Handle a miss (the target's token at the first rejected position was outside that step's active set),
        then extend the stream as MicroSpec does."""
        k = cycle.accepted
        if k < len(cycle.draft_tokens) and k < len(cycle.emitted) and k < len(cycle.active_sets):
            token = cycle.emitted[k]
            if not cycle.active_sets[k].contains(token):
                self.misses += 1
                self._push(self._neighbours(token, cycle, k))
        super().observe(cycle)

    def _neighbours(self, token: int, cycle: CycleReport, k: int) -> torch.Tensor:
        """Candidates for a missed ``token`` at verified position ``k`` (at most ``max_insert``): EvoSpec's
        retrieval (:func:`~dynvocab.runtime.selection.candidates.assemble_candidates`) over the target's top ids
        there and the HNSW neighbours of its hidden state, run in the loop's thread."""
        cfg = self.hcfg
        top = to_host(cycle.target_logits[k, : self.vocab_size].topk(cfg.miss_topk).indices)
        semantic = []
        if self.hnsw is not None:
            query = to_host_tensor(cycle.target_hidden[k : k + 1].float())
            semantic = to_host(mips_search(self.hnsw, query, cfg.miss_topk)[0])
        found = assemble_candidates(token, top, semantic, *self._csr, cfg.successors, self._in_core)
        return torch.tensor(found[: cfg.max_insert], dtype=torch.long, device=self.core.device)

    def _wanted(self, ids) -> torch.Tensor:
        """In the window and outside the core (the core is its own segment)."""
        return (self.state.counts[ids] > 0) & (self.core_rank[ids] >= self.core.numel())
