"""EvoSpec in a batched host (the vLLM plugin): a static core shared by every row, and each request's own dynamic
buffer, an ARC cache refilled by retrieval on out-of-vocabulary events, kept per request across cycles.

The rules are :class:`~.evospec.EvoSpecPolicy`'s, per request (its
:class:`~.evospec.EvoSpecConfig` knobs): at draft position 0 of each cycle the residency
clock of the row's request ticks, and the token the draft is fed there (the target's last emitted token: its
correction or bonus token, the one emitted token that can lie outside the set the cycle was drafted with) is looked
up: in the dynamic buffer it is a hit, outside the core and the buffer it is an OOV event whose candidates (the
token, the HNSW top ids for the target's hidden state that produced it, then the graph successors of each,
:func:`~..candidates.assemble_candidates`) are offered to the request's cache. The cache changes
only there, so positions 1 … γ - 1 draft from the same set.

What differs from dynvocab's own loop, and why:

- **retrieval runs in the step**, not in a worker thread: its ids join the buffer before the cycle drafts rather
  than a cycle later, at 0.1–0.3 ms a step on the Gemma pair (docs/measurements/2026-11-28-vllm-gemma-evospec.md);
- **no target top-k seeds**: vLLM hands a draft the target's hidden states, not its logits; the HNSW search over
  the target's head rows for that hidden state is the top-k by inner product, what the logits' top-k would be,
  approximately;
- **no semantic seeds where the host has no target state** (an EAGLE-3 head receives the target's middle layers
  combined, not its last; a tensor-parallel rank holds a shard of the head): the token and its graph successors;
- **no online LoRA alignment**: it changes weights that every request in an engine shares.

Requests the host no longer runs give their caches back, as the request windows do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dynvocab.artifacts.bundle import Bundle
from dynvocab.errors import DynvocabError
from dynvocab.runtime.selection.evospec.arc import ARCCache
from dynvocab.runtime.selection.candidates import assemble_candidates
from dynvocab.runtime.selection.batch_select import (
    BatchSets,
    ContextSelector,
    StepContext,
    eos_first_ranking,
    head_eos_ids,
)
from dynvocab.runtime.selection.context.context_select import HeadSearch

# HNSW ef of the OOV searches in a batched host (the hybrid's per-step search measured ~0.6 ms a query at 64 over the
# demo pair's 151,936 rows, outside the engine)
EVOSPEC_EF = 64


@dataclass
class EvoSpecSelectorStats:
    """What the selector did over an engine's life (for the bench's log and the tests)."""

    cycles: int = 0  # rows seen at draft position 0 (one a request per cycle)
    oov_events: int = 0
    searched: int = 0  # events with an HNSW search (the host gave the target's hidden state and the whole head)
    inserted: int = 0  # ids newly admitted into a request's buffer


class EvoSpecSelector(ContextSelector):
    """``evospec`` in a batched host: ``core`` [K] for every row, and each request's ARC buffer (at most
    ``cfg.dynamic_size`` ids, padded with the core's first id)."""

    def __init__(self, core: torch.Tensor, vocab_size: int, graph, cfg, search: HeadSearch | None = None):
        """``graph``: the bundle's :class:`~dynvocab.artifacts.GraphTable` (host tensors); ``cfg``: EvoSpec's knobs
        (:class:`~.evospec.EvoSpecConfig`: the buffer's size and cache, the graph fan-out,
        the ids admitted per event); ``search``: the HNSW index of the bundle's ``hnsw`` stage over the target's head
        rows, or None."""
        if core.numel() < 1 or cfg.dynamic_size < 1:
            raise DynvocabError("evospec needs a core and a dynamic buffer of at least 1 id each")
        self.core, self.cfg, self.search = core.long(), cfg, search
        self.in_core = np.zeros(vocab_size, dtype=bool)
        self.in_core[core.cpu().numpy()] = True
        self.indptr, self.indices = graph.indptr.cpu().numpy(), graph.indices.cpu().numpy()
        self.reads = frozenset({"fed", "requests", "target"} | ({"head"} if search is not None else set()))
        self.k = int(core.numel()) + cfg.dynamic_size
        self.caches: dict[object, ARCCache] = {}  # request key -> its dynamic buffer
        self.stats = EvoSpecSelectorStats()
        self._rows: torch.Tensor | None = None  # [B, dynamic_size] the batch's buffers, set at draft position 0

    def prepare(self, head: torch.Tensor) -> None:
        if self.search is not None:
            self.search.prepare(head)

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        rows = int(hidden.shape[0])
        if ctx.step == 0 or self._rows is None or self._rows.shape[0] != rows:
            self._rows = self._cycle(rows, ctx, hidden.device)
        return BatchSets(self.core, self._rows)

    def _cycle(self, rows: int, ctx: StepContext, device) -> torch.Tensor:
        """A new cycle of every row: tick its request's clock, take its fed token's event, and return the
        buffers [rows, dynamic_size]. Rows without a request key or fed token get the core alone."""
        keys = list(ctx.requests) if ctx.requests is not None and len(ctx.requests) == rows else None
        if keys is None or ctx.fed is None or ctx.step != 0:
            return self.core[:1].expand(rows, self.cfg.dynamic_size).to(device)
        alive = set(keys)
        for key in [k for k in self.caches if k not in alive]:
            del self.caches[key]
        fed = ctx.fed.tolist()
        caches = [self._cache(key) for key in keys]
        oov = []
        for r, (cache, token) in enumerate(zip(caches, fed)):
            self.stats.cycles += 1
            cache.tick()
            if not 0 <= token < self.in_core.shape[0] or self.in_core[token]:
                continue
            if token in cache:
                if self.cfg.hit_on_use:
                    cache.touch(token)
                continue
            oov.append(r)
        semantic = self._semantic(oov, ctx)
        for r in oov:
            self.stats.oov_events += 1
            found = assemble_candidates(fed[r], (), semantic.get(r, ()), self.indptr, self.indices,
                                        self.cfg.graph_fanout, self.in_core)
            self.stats.inserted += len(caches[r].admit(found, self.cfg.max_insert))
        out = np.full((rows, self.cfg.dynamic_size), int(self.core[0]), dtype=np.int64)
        for r, cache in enumerate(caches):
            ids = sorted(cache.resident())  # the set, not its LRU order: a hit changes no row
            out[r, : len(ids)] = ids
        return torch.from_numpy(out).to(device)

    def _cache(self, key) -> ARCCache:
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = self.cfg.new_cache()
        return cache

    def _semantic(self, rows: list[int], ctx: StepContext) -> dict[int, list[int]]:
        """Each OOV row's HNSW top ids for the target's hidden state there; none where the host gave no target
        state or no whole head."""
        if not rows or self.search is None or ctx.target is None or ctx.head is None:
            return {}
        found = self.search(ctx.target[rows], ctx.head)
        if found is None:
            return {}
        self.stats.searched += len(rows)
        return {r: ids for r, ids in zip(rows, found.tolist())}

    def held(self) -> int:
        """Requests whose buffers the selector holds."""
        return len(self.caches)


def evospec_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int, device: torch.device,
                        cfg) -> EvoSpecSelector:
    """``evospec``: a core of the ``budget`` most frequent ids (EOS first), the buffer and retrieval knobs of ``cfg``
    (an :class:`~.evospec.EvoSpecConfig`; the strategy registers EvoSpec's defaults), the
    bundle's graph, and on a CPU the search of its ``hnsw`` stage for a head of this hidden size."""
    from dynvocab.artifacts import GraphTable, HnswParams, StoredIndex

    eos = head_eos_ids(bundle, vocab_size, device)
    core = eos_first_ranking(bundle, vocab_size, eos, device)[: max(budget, eos.numel())]
    search = None
    if torch.device(device).type == "cpu":
        params = HnswParams.from_dict(bundle.info("hnsw")["index"], f"bundle {bundle.path} (stage hnsw)")
        if params.hidden == hidden_size:
            search = HeadSearch(StoredIndex.read(bundle, "hnsw"), cfg.hnsw_topk, EVOSPEC_EF)
    return EvoSpecSelector(core, vocab_size, GraphTable.from_bundle(bundle), cfg, search)
