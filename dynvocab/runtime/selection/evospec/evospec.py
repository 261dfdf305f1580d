"""EvoSpec: a static frequency core plus each request's dynamic buffer, an ARC cache refilled by retrieval on
out-of-vocabulary events. One selector, :class:`EvoSpecSelector`, keeps the core and every request's cache for both
hosts: a batched host (the vLLM plugin) calls its ``select``, dynvocab's loop runs it through :class:`EvoSpecPolicy`.

The draft's set is ``V_static ∪ V_dyn`` (Eq. 3): the core (frequent ids and the EOS ids, one tensor for every step,
so a packed head packs its rows once) and at most ``dynamic_size`` ids of the request's cache. An OOV event is an
emitted token outside the set its cycle drafted with (only the correction or the bonus token can be); its candidates
(paper appendix A.3, :func:`~..candidates.assemble_candidates`) are

    seeds = {x} ∪ target top-10 at that position ∪ HNSW top-10 for the target's hidden state there,
    candidates = seeds, then up to 8 bigram-graph successors of each seed (round-robin by rank),

deduplicated, in the draft's vocabulary and outside the core, and the cache admits at most 32 new ids of them. Its
residency clock ticks once per draft-verify cycle ("min residency 8 decoding steps" means 8 cycles), and it changes
only between cycles.

What differs between the hosts, and why:

- **the loop** raises events from each cycle's emitted tokens, with the target's top-10 seeds; retrieval runs in a
  worker thread, off the critical path, and the cache takes every finished result at the next cycle's start
  (``synchronous=True``: inside ``observe``, reproducible for tests). ``online_align`` adds a temporary LoRA adapter
  trained on mismatched cycles (:mod:`dynvocab.runtime.drafts.lora_align`), which :meth:`EvoSpecPolicy.close` removes;
- **a batched host** finds the event at draft position 0, in the token the draft is fed there (the target's last
  emitted token). Retrieval runs in the step: its ids join before the cycle drafts rather than a cycle later, at
  0.1–0.3 ms a step on the Gemma pair (docs/measurements/2026-11-28-vllm-gemma-evospec.md). No target top-k seeds:
  vLLM hands a draft the target's hidden states, not its logits, and the HNSW search over the target's head rows for
  that state is approximately their top-k. No HNSW seeds where the host has no target state (an EAGLE-3 head gets
  the target's middle layers combined, a tensor-parallel rank a shard of the head): the token and its graph
  successors. No LoRA alignment: it changes weights every request shares. A request that leaves gives its cache back.

The core is the same in both: the EOS ids, then the most frequent to ``static_size`` (a batched host's budget).
"""

from __future__ import annotations

import collections
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from dynvocab.artifacts.bundle import Bundle
from dynvocab.artifacts.hnsw import mips_search
from dynvocab.errors import DynvocabError
from dynvocab.runtime.drafts.lora_align import AlignConfig, Aligner
from dynvocab.runtime.heads.active_set import ActiveSet, Prefix
from dynvocab.runtime.heads.selected_head import BatchSets
from dynvocab.runtime.host import to_host, to_host_tensor
from dynvocab.runtime.selection.base import CycleReport, SelectorPolicy
from dynvocab.runtime.selection.batch_select import ContextSelector, StepContext, bundle_core, eos_first
from dynvocab.runtime.selection.candidates import assemble_candidates
from dynvocab.runtime.selection.evospec.arc import ARCCache
from dynvocab.runtime.selection.head_search import HeadSearch

# HNSW ef of the OOV searches in a batched host (the hybrid's per-step search measured ~0.6 ms a query at 64 over the
# demo pair's 151,936 rows, outside the engine)
EVOSPEC_EF = 64
KEY = 0  # the loop's one request


@dataclass(frozen=True)
class EvoSpecConfig:
    """EvoSpec's knobs; defaults from the paper's Table 5 / appendix A.3 unless marked "ours"."""

    static_size: int = 32000  # |V_static|, top of the freq ranking (Table 5: 32,000)
    dynamic_size: int = 256  # N_dyn, the ARC capacity (Table 5)
    target_topk: int = 10  # seeds: target top-10 at the OOV position (Table 5 "initial candidate set")
    hnsw_topk: int = 10  # … ∪ HNSW top-10 for the target hidden state there (Table 5)
    graph_fanout: int = 8  # graph successors per seed (Table 5 "top-8 outgoing neighbours")
    max_insert: int = 32  # new ids admitted per OOV event (Table 5)
    ghost_size: int = 256  # |B1| = |B2| (Table 5)
    arc_p: int = 128  # initial ARC target p (Table 5)
    min_residency: int = 8  # cycles an id stays before it may be evicted (Table 5: 8 decoding steps)
    warmup_events: int = 50  # events during which p stays fixed (Table 5)
    hit_on_use: bool = True  # ours: an emitted token from the dynamic buffer counts as an ARC hit
    synchronous: bool = False  # ours: retrieve inside observe() (tests) instead of a worker thread
    hnsw_threads: int = 1  # hnswlib threads per query
    online_align: bool = False  # the LoRA online alignment (paper §3.4), off by default
    align: AlignConfig = field(default_factory=AlignConfig)

    def new_cache(self) -> ARCCache:
        """An empty dynamic buffer with these knobs (Table 5's sizes, residency and warm-up)."""
        return ARCCache(self.dynamic_size, self.ghost_size, self.arc_p, self.min_residency, self.warmup_events)


@dataclass(frozen=True)
class OOVEvent:
    """An emitted token that lay outside the active set, with what the loop's retrieval needs from that position."""

    token: int
    target_top: tuple[int, ...]  # the target's top-k ids at that position, best first
    hidden: torch.Tensor  # [d_target] the target's final hidden state there (the MIPS query)


@dataclass
class EvoSpecStats:
    """What EvoSpec did: over one generation in the loop, over an engine's life in a batched host."""

    cycles: int = 0  # request cycles (a batched host's rows at draft position 0)
    oov_events: int = 0
    searched: int = 0  # a batched host's events with an HNSW search (it gave the target's state and the whole head)
    retrievals: int = 0  # events whose candidates reached the cache
    retrieval_s: float = 0.0  # the loop's total worker time (HNSW + graph + assembly)
    candidates: int = 0  # candidates offered to the caches (after dedup and core filtering)
    inserted: int = 0  # ids newly admitted into a dynamic buffer
    dropped: int = 0  # the loop's events still pending at close()
    failed: int = 0  # the loop's retrievals that raised (the worker carries on)


class EvoSpecSelector(ContextSelector):
    """``core`` [K] for every row and each request's ARC buffer (at most ``cfg.dynamic_size`` ids): a batched host's
    rows padded with the core's first id (:meth:`select`), the loop's chain two segments (:meth:`row_set`)."""

    name = "evospec"

    def __init__(self, core: torch.Tensor, vocab_size: int, graph, cfg: EvoSpecConfig,
                 search: HeadSearch | None = None):
        """``graph``: the bundle's :class:`~dynvocab.artifacts.GraphTable` (host tensors); ``cfg``: EvoSpec's knobs;
        ``search``: a batched host's HNSW index of the bundle's ``hnsw`` stage over the target's head rows, or None."""
        if core.numel() < 1 or cfg.dynamic_size < 1:
            raise DynvocabError("evospec needs a core and a dynamic buffer of at least 1 id each")
        self.core, self.cfg, self.search = core.long(), cfg, search
        self.in_core = np.zeros(vocab_size, dtype=bool)
        self.in_core[core.cpu().numpy()] = True
        self.indptr, self.indices = graph.indptr.cpu().numpy(), graph.indices.cpu().numpy()
        self.reads = frozenset({"fed", "requests", "target"} | ({"head"} if search is not None else set()))
        self.k = int(core.numel()) + cfg.dynamic_size
        self.caches: dict[object, ARCCache] = {}  # request key -> its dynamic buffer
        self.stats = EvoSpecStats()
        self._rows: torch.Tensor | None = None  # [B, dynamic_size] the batch's buffers, set at draft position 0
        self._view: tuple | None = None  # (cache, its version, the chain's ActiveSet)

    # -- one request's cache --------------------------------------------------------------------------------------
    def cache(self, key) -> ARCCache:
        """Request ``key``'s dynamic buffer (a new, empty one for a new key)."""
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = self.cfg.new_cache()
        return cache

    def tick(self, key) -> None:
        """A new cycle of request ``key``: its residency clock ticks."""
        self.stats.cycles += 1
        self.cache(key).tick()

    def holds(self, key, token: int) -> bool:
        """Whether ``token`` is in request ``key``'s set: the core or its buffer."""
        return 0 <= token < self.in_core.shape[0] and bool(self.in_core[token] or token in self.cache(key))

    def lookup(self, key, token: int) -> bool:
        """An emitted ``token`` of request ``key``: True for an OOV event (a draftable id outside its set); one in
        its buffer is a hit (``hit_on_use``)."""
        if self.holds(key, token):
            if self.cfg.hit_on_use and not self.in_core[token]:
                self.cache(key).touch(token)
            return False
        return 0 <= token < self.in_core.shape[0]

    def candidates(self, token: int, target_top, semantic) -> list[int]:
        """One event's ordered candidates (:func:`~..candidates.assemble_candidates`); reads only what never changes,
        so the loop's worker thread calls it."""
        return assemble_candidates(token, target_top, semantic, self.indptr, self.indices, self.cfg.graph_fanout,
                                   self.in_core)

    def admit(self, key, candidates: list[int]) -> None:
        """One event's ``candidates`` into request ``key``'s buffer (at most ``max_insert`` new ids)."""
        self.stats.retrievals += 1
        self.stats.candidates += len(candidates)
        self.stats.inserted += len(self.cache(key).admit(candidates, self.cfg.max_insert))

    def offer(self, key, token: int, target_top, semantic) -> None:
        """One OOV event of request ``key`` retrieved at once: its candidates admitted."""
        self.stats.oov_events += 1
        self.admit(key, self.candidates(token, target_top, semantic))

    # -- the hosts ------------------------------------------------------------------------------------------------
    def row_set(self, hidden: torch.Tensor | None, ctx: StepContext) -> ActiveSet:
        """The loop's chain: the core and the dynamic ids of ``ctx.requests[0]``, the same object until its cache
        admits or evicts (the packed head keys a segment by its tensor: a new one, a new key, changed rows copied)."""
        cache = self.cache(ctx.requests[0])
        if self._view is None or self._view[0] is not cache or self._view[1] != cache.version:
            dynamic = torch.from_numpy(np.asarray(cache.resident(), dtype=np.int64)).to(self.core.device)
            self._view = (cache, cache.version, ActiveSet.of(Prefix.whole(self.core), Prefix.whole(dynamic)))
        return self._view[2]

    def node_sets(self, hidden: torch.Tensor, ctx: StepContext) -> None:
        """Every node of a tree depth has the request's one set."""
        return None

    def prepare(self, head: torch.Tensor) -> None:
        if self.search is not None:
            self.search.prepare(head)

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        """A batched host's step: the core, and each row's request buffer as of the cycle's draft position 0."""
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
        oov = []
        for r, (key, token) in enumerate(zip(keys, fed)):
            self.tick(key)
            if self.lookup(key, token):
                oov.append(r)
        semantic = self._semantic(oov, ctx)
        for r in oov:
            self.offer(keys[r], fed[r], (), semantic.get(r, ()))
        out = np.full((rows, self.cfg.dynamic_size), int(self.core[0]), dtype=np.int64)
        for r, key in enumerate(keys):
            ids = sorted(self.caches[key].resident())  # the set, not its LRU order: a hit changes no row
            out[r, : len(ids)] = ids
        return torch.from_numpy(out).to(device)

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
    (an :class:`EvoSpecConfig`; the strategy registers EvoSpec's defaults), the bundle's graph, and on a CPU the
    search of its ``hnsw`` stage for a head of this hidden size."""
    from dynvocab.artifacts import GraphTable, HnswParams, StoredIndex

    core = bundle_core(bundle, vocab_size, device, budget)
    search = None
    if torch.device(device).type == "cpu":
        params = HnswParams.from_dict(bundle.info("hnsw")["index"], f"bundle {bundle.path} (stage hnsw)")
        if params.hidden == hidden_size:
            search = HeadSearch(StoredIndex.read(bundle, "hnsw"), cfg.hnsw_topk, EVOSPEC_EF)
    return EvoSpecSelector(core, vocab_size, GraphTable.from_bundle(bundle), cfg, search)


def semantic(index, hidden: torch.Tensor, cfg: EvoSpecConfig) -> list[int]:
    """The loop's HNSW top-``hnsw_topk`` ids for one target hidden state [d] (``index``: from ``load_hnsw``, MIPS
    over the target's LM-head rows)."""
    return to_host(mips_search(index, hidden, cfg.hnsw_topk, num_threads=cfg.hnsw_threads)[0])


def retrieve(selector: EvoSpecSelector, index, event: OOVEvent) -> tuple[list[int], float]:
    """The loop's retrieval of one event: (its candidates, the seconds the search and assembly took). Holds no
    reference to the policy, so the worker thread never keeps one alive."""
    start = time.perf_counter()
    found = selector.candidates(event.token, event.target_top, semantic(index, event.hidden, selector.cfg))
    return found, time.perf_counter() - start


class EvoSpecPolicy(SelectorPolicy):
    """EvoSpec in dynvocab's loop: the selector's one request, its events raised from each cycle's emitted tokens
    and retrieved in a worker thread, and optionally the LoRA alignment of the draft."""

    def __init__(self, cfg: EvoSpecConfig, core: torch.Tensor, index, graph, vocab_size: int,
                 device: torch.device | str = "cpu", draft=None):
        """``core`` [K]: the static ids; ``index``: the HNSW index over the target's head rows (``load_hnsw``);
        ``draft``: the draft model ``online_align`` adapts."""
        super().__init__(EvoSpecSelector(core.to(device), vocab_size, graph, cfg), device=device)
        self.cfg, self.vocab_size, self.index = cfg, vocab_size, index
        self.stats, self.cache = self.selector.stats, self.selector.cache(KEY)
        self.aligner = None
        if cfg.online_align:
            if draft is None:
                raise DynvocabError("EvoSpec --online-align needs the draft model")
            self.aligner = Aligner(draft, cfg.align)
        self.tokens: list[int] = []  # the sequence so far (context of alignment samples)
        self._ready: list[tuple[list[int] | None, float]] = []  # synchronous retrievals, not yet admitted
        self._pending: collections.deque = collections.deque()  # the worker's futures, in event order
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    @classmethod
    def from_context(cls, cfg: EvoSpecConfig, ctx) -> "EvoSpecPolicy":
        """Build from a :class:`~dynvocab.runtime.registry.PolicyContext` whose bundle has the freq, hnsw and
        graph stages (:func:`~dynvocab.runtime.registry.make_policy` checks them)."""
        from dynvocab.artifacts import FreqTable, GraphTable, load_hnsw

        bundle = ctx.bundle
        if cfg.online_align and ctx.draft is not None and ctx.draft.adaptable is None:
            raise DynvocabError("--online-align adapts a draft model's q/v projections, not an EAGLE head; drop it")
        if cfg.static_size < 1 or cfg.dynamic_size < 1:
            raise DynvocabError("evospec needs a static size and a dynamic size of at least 1")
        target = ctx.target
        if target is None:
            raise DynvocabError("strategy 'evospec' needs the target model: the HNSW vectors are rebuilt from its "
                                "LM head")
        index, _ = load_hnsw(bundle, target.weight)  # once per bundle; a head of another shape is refused
        ranking = FreqTable.from_bundle(bundle).ranking
        core = eos_first(ranking[ranking < ctx.vocab_size], ctx.eos, cfg.static_size)  # EOS: so drafts can end
        return cls(cfg, core, index, GraphTable.from_bundle(bundle), ctx.vocab_size, ctx.device,
                   draft=ctx.draft.adaptable if cfg.online_align else None)

    def prefill(self, prompt_ids: torch.Tensor, target_logits, target_hidden) -> None:
        """Remember the prompt (the context of alignment samples); the dynamic buffer starts empty."""
        self.tokens = to_host(prompt_ids)

    def active_ids(self, step: int, hidden=None, token=None) -> ActiveSet:
        """The core and the dynamic ids; at step 0 the cache first takes every retrieval that has finished."""
        return self.apply_ready() if step == 0 else super().active_ids(step, hidden, token)

    def _context(self, step: int, fed: torch.Tensor | None) -> StepContext:
        return StepContext(step, fed, requests=(KEY,))

    def observe(self, cycle: CycleReport) -> None:
        """Tick the residency clock, raise OOV events for emitted tokens outside the active set, align."""
        self.selector.tick(KEY)
        for j, tok in enumerate(cycle.emitted):
            if not self.selector.lookup(KEY, tok):
                continue
            top = cycle.target_logits[j, : self.vocab_size].topk(self.cfg.target_topk).indices  # [k]
            hidden = to_host_tensor(cycle.target_hidden[j].float()).clone()  # the worker's own copy
            event = OOVEvent(tok, tuple(to_host(top)), hidden)
            self.stats.oov_events += 1
            if self.cfg.synchronous:
                self._ready.append(retrieve(self.selector, self.index, event))
            else:
                self._submit(event)
        if self.aligner is not None:
            self._align(cycle)
        self.tokens.extend(cycle.emitted)

    def apply_ready(self, wait: bool = False) -> ActiveSet:
        """Admit the candidates of every finished retrieval (``wait``: of every queued one) into the cache; returns
        the set after them."""
        ready, self._ready = self._ready, []
        while self._pending and (wait or self._pending[0].done()):
            future = self._pending[0]
            try:
                ready.append(future.result(timeout=60))
            except Exception:  # a failed retrieval only costs coverage, never correctness; it is counted
                if not future.done():
                    break  # still running after a minute: it stays pending
                ready.append((None, 0.0))
            self._pending.popleft()
        for candidates, seconds in ready:
            if candidates is None:
                self.stats.failed += 1
            else:
                self.stats.retrieval_s += seconds
                self.selector.admit(KEY, candidates)
        return self.selector.row_set(None, self._context(0, None))

    def _submit(self, event: OOVEvent) -> None:
        if self._pool is None:
            if self._closed:
                raise RuntimeError("EvoSpecPolicy is closed")
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="evospec-retrieval")
            self._finalizer = weakref.finalize(self, self._pool.shutdown, cancel_futures=True)
        self._pending.append(self._pool.submit(retrieve, self.selector, self.index, event))

    def _align(self, cycle: CycleReport) -> None:
        """Path B: a rejected draft token whose verified replacement lies inside the active set is a sample."""
        k = cycle.accepted
        if k >= len(cycle.draft_tokens) or k >= len(cycle.emitted):
            return  # everything accepted (no mismatch), or the correction was cut by EOS/length
        if self.selector.holds(KEY, cycle.emitted[k]):
            self.aligner.add(self.tokens[: cycle.position], cycle.emitted[: k + 1], cycle.target_logits[: k + 1])

    def summary(self) -> dict:
        """Counters of this generation, JSON-ready."""
        s, cache = self.stats, self.cache
        n = max(s.retrievals, 1)  # no retrieval: no seconds and no candidates either
        out = {"cycles": s.cycles, "oov_events": s.oov_events, "retrievals": s.retrievals,
               "mean_retrieval_ms": round(1000 * s.retrieval_s / n, 4),
               "candidates_per_event": round(s.candidates / n, 2),
               "inserted": s.inserted, "evicted": cache.stats.evicted, "blocked": cache.stats.blocked,
               "dynamic_size": len(cache), "t1": len(cache.t1), "t2": len(cache.t2), "arc_p": round(cache.p, 2),
               "dropped": s.dropped, "failed": s.failed}
        if self.aligner is not None:
            a = self.aligner.stats
            out["align"] = {"samples": a.samples, "updates": a.updates, "update_s": round(a.update_s, 3),
                            "losses": a.losses}
        return out

    def close(self) -> None:
        """Stop the retrieval thread and remove the alignment adapter (idempotent). Call after each generation."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self.stats.dropped += len(self._pending)
            self._finalizer()
        if self.aligner is not None:
            self.aligner.close()

    def __enter__(self) -> "EvoSpecPolicy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
