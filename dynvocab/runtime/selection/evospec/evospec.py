"""EvoSpec: a static frequency core plus a dynamic buffer refilled by retrieval on out-of-vocabulary events.

The draft's active set is ``V_static ∪ V_dyn`` (Eq. 3): the top ``static_size`` ids of the bundle's ``freq``
ranking (plus the EOS ids) and at most ``dynamic_size`` ids kept by an ARC cache. ``active_ids`` returns the
two as disjoint segments ``(core, dynamic)``; the core is the same tensor object at every step, so the packed
draft head packs its 32k rows once and only the small dynamic segment changes.

Out-of-vocabulary (OOV) event: an emitted token outside the active set the cycle was drafted with (only the
correction or the bonus token can be; accepted tokens were drafted from the set). For each event the
candidates are (paper appendix A.3):

    seeds = {x} ∪ target top-10 at that position ∪ HNSW top-10 for the target's hidden state there,
    candidates = seeds, then up to 8 bigram-graph successors of each seed (round-robin by rank),

deduplicated, restricted to the draft's vocabulary and to ids outside the core (they need no slot), and
offered to the ARC cache, which admits at most 32 new ids per event. (``x`` itself heads the list; under
greedy decoding it is the target's top-1 anyway.)

Retrieval (HNSW search + graph look-ups) runs off the critical path: ``observe`` queues the event for a
worker thread, and the cache takes every finished result at the start of the next cycle
(``active_ids(0)``). ``synchronous=True`` computes candidates inside ``observe`` instead, which makes runs
reproducible for tests; either way the cache only changes between cycles. The ARC residency clock ticks
once per draft-verify cycle, so "min residency 8 decoding steps" means 8 cycles.

With ``online_align`` the draft also gets a temporary LoRA adapter trained on mismatched cycles
(:mod:`.evospec_align`); call :meth:`EvoSpecPolicy.close` after the generation to remove it.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from dynvocab.errors import DynvocabError
from dynvocab.runtime.heads.active_set import ActiveSet, Prefix
from dynvocab.runtime.host import to_host, to_host_tensor
from dynvocab.runtime.selection.base import CycleReport, VocabPolicy
from dynvocab.runtime.selection.evospec.evospec_align import AlignConfig, Aligner
from dynvocab.runtime.selection.evospec.arc import ARCCache
from dynvocab.runtime.selection.candidates import assemble_candidates

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
    """An emitted token that lay outside the active set, with what retrieval needs from that position."""

    token: int
    target_top: tuple[int, ...]  # the target's top-k ids at that position, best first
    hidden: torch.Tensor  # [d_target] the target's final hidden state there (the MIPS query)
    cycle: int


@dataclass
class EvoSpecStats:
    """What the policy did in one generation."""

    cycles: int = 0
    oov_events: int = 0
    retrievals: int = 0  # events whose candidates reached the cache
    retrieval_s: float = 0.0  # total worker time (HNSW + graph + assembly)
    candidates: int = 0  # candidates offered to the cache (after dedup and core filtering)
    inserted: int = 0  # ids newly admitted into the dynamic buffer
    dropped: int = 0  # events still pending at close()
    failed: int = 0  # retrievals that raised (the worker carries on)

    @property
    def mean_retrieval_ms(self) -> float:
        return 1000 * self.retrieval_s / self.retrievals if self.retrievals else 0.0


class Retriever:
    """HNSW search + graph expansion for OOV events; safe to call from one worker thread."""

    def __init__(self, index, graph, in_core: np.ndarray, cfg: EvoSpecConfig):
        self.index = index  # from load_hnsw: MIPS over the target's LM-head rows (labels = token ids)
        self.indptr = graph.indptr.numpy()  # [V_graph + 1]
        self.indices = graph.indices.numpy()  # [E]
        self.in_core = in_core  # [V_draft] bool, read-only
        self.cfg = cfg

    def semantic(self, hidden: torch.Tensor) -> list[int]:
        """HNSW top-``hnsw_topk`` ids for one target hidden state [d]."""
        from dynvocab.artifacts.hnsw import mips_search

        return to_host(mips_search(self.index, hidden, self.cfg.hnsw_topk, num_threads=self.cfg.hnsw_threads)[0])

    def candidates(self, event: OOVEvent) -> tuple[list[int], float]:
        """(ordered candidate ids, seconds spent)."""
        start = time.perf_counter()
        out = assemble_candidates(
            event.token,
            event.target_top,
            self.semantic(event.hidden),
            self.indptr,
            self.indices,
            self.cfg.graph_fanout,
            self.in_core,
        )
        return out, time.perf_counter() - start


class _Worker:
    """One daemon thread answering OOV events in order; holds no reference to the policy."""

    def __init__(self, retriever: Retriever):
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.stop = threading.Event()
        self.pending = 0
        self.thread = threading.Thread(
            target=_serve, args=(retriever, self.inbox, self.outbox, self.stop), name="evospec-retrieval", daemon=True
        )
        self.thread.start()

    def submit(self, event: OOVEvent) -> None:
        self.pending += 1
        self.inbox.put(event)

    def drain(self, wait: bool = False) -> list[tuple[OOVEvent, list[int], float]]:
        """Finished results in event order (all pending ones when ``wait``)."""
        done = []
        while self.pending:
            try:
                done.append(self.outbox.get(block=wait, timeout=60 if wait else None))
            except queue.Empty:
                break
            self.pending -= 1
        return done

    def close(self) -> int:
        """Stop the thread; returns how many events were still pending."""
        self.stop.set()
        self.inbox.put(None)
        self.thread.join(timeout=10)
        return self.pending


def _serve(retriever: Retriever, inbox, outbox, stop: threading.Event) -> None:
    while True:
        event = inbox.get()
        if event is None or stop.is_set():
            return
        try:
            outbox.put((event, *retriever.candidates(event)))
        except Exception:  # a failed retrieval only costs coverage, never correctness; it is counted
            outbox.put((event, None, 0.0))


def _bundle_tables(bundle, head: torch.Tensor) -> tuple:
    """(freq ranking [V], MipsIndex, HnswParams, GraphTable) of a bundle, the index searching the target's
    ``head`` [V, d]; each is loaded once per bundle object."""
    from dynvocab.artifacts import FreqTable, GraphTable, load_hnsw

    index, params = load_hnsw(bundle, head)
    return FreqTable.from_bundle(bundle).ranking, index, params, GraphTable.from_bundle(bundle)


class EvoSpecPolicy(VocabPolicy):
    """Static core ∪ an ARC-managed dynamic buffer filled by retrieval on OOV events (optionally + LoRA)."""

    name = "evospec"

    def __init__(
        self,
        cfg: EvoSpecConfig,
        core: torch.Tensor,
        index,
        graph,
        vocab_size: int,
        device: torch.device | str = "cpu",
        draft=None,
    ):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.core = core.to(self.device)  # [K] the same object at every step
        self.in_core = np.zeros(vocab_size, dtype=bool)
        self.in_core[core.cpu().numpy()] = True
        self.dynamic = torch.empty(0, dtype=torch.long, device=self.device)  # [n ≤ dynamic_size]
        self._dynamic_np = np.empty(0, dtype=np.int64)  # the same ids on the host
        self.active = self._active_set()
        self.cache = cfg.new_cache()
        self.retriever = Retriever(index, graph, self.in_core, cfg)
        self.stats = EvoSpecStats()
        self._ready: list[tuple[OOVEvent, list[int], float]] = []
        self._version = self.cache.version
        self._worker: _Worker | None = None
        self._closed = False
        self.aligner = None
        if cfg.online_align:
            if draft is None:
                raise DynvocabError("EvoSpec --online-align needs the draft model")
            self.aligner = Aligner(draft, cfg.align)
        self.tokens: list[int] = []  # the sequence so far (context of alignment samples)

    @classmethod
    def from_context(cls, cfg: EvoSpecConfig, ctx) -> "EvoSpecPolicy":
        """Build from a :class:`~dynvocab.runtime.registry.PolicyContext` whose bundle has the freq, hnsw and
        graph stages (:func:`~dynvocab.runtime.registry.make_policy` checks them)."""
        bundle = ctx.bundle
        if cfg.online_align and ctx.draft is not None and ctx.draft.adaptable is None:
            raise DynvocabError("--online-align adapts a draft model's q/v projections, not an EAGLE head; drop it")
        if cfg.static_size < 1 or cfg.dynamic_size < 1:
            raise DynvocabError("evospec needs a static size and a dynamic size of at least 1")
        target = ctx.target
        if target is None:
            raise DynvocabError("strategy 'evospec' needs the target model: the HNSW vectors are rebuilt from its LM head")
        ranking, index, _, graph = _bundle_tables(bundle, target.weight)  # a head of another shape is refused
        ranking = ranking[ranking < ctx.vocab_size][: cfg.static_size]
        eos = ctx.eos
        core = torch.cat([ranking, eos[~torch.isin(eos, ranking)]])  # EOS stays draftable so drafts can end
        return cls(cfg, core, index, graph, ctx.vocab_size, ctx.device, draft=ctx.draft.adaptable if cfg.online_align else None)

    # -- the policy interface -----------------------------------------------------------------------------
    def prefill(self, prompt_ids: torch.Tensor, target_logits, target_hidden) -> None:
        """Remember the prompt (the context of alignment samples); the dynamic buffer starts empty."""
        self.tokens = to_host(prompt_ids)

    def active_ids(self, step: int, hidden=None, token=None) -> ActiveSet:
        """Two segments, the core and the dynamic ids; at step 0 the cache first takes every retrieval that has
        finished."""
        if step == 0:
            self.apply_ready()
        return self.active

    def observe(self, cycle: CycleReport) -> None:
        """Tick the residency clock, raise OOV events for emitted tokens outside the active set, align."""
        self.stats.cycles += 1
        self.cache.tick()
        for j, tok in enumerate(cycle.emitted):
            if tok >= self.vocab_size:
                continue  # a target-only id: no draft row can ever propose it
            if self.active.contains(tok):
                if self.cfg.hit_on_use and not self.in_core[tok]:
                    self.cache.touch(tok)
                continue
            top = cycle.target_logits[j, : self.vocab_size].topk(self.cfg.target_topk).indices  # [k]
            hidden = to_host_tensor(cycle.target_hidden[j].float()).clone()  # the worker's own copy
            event = OOVEvent(tok, tuple(to_host(top)), hidden, self.stats.cycles)
            self.stats.oov_events += 1
            if self.cfg.synchronous:
                self._ready.append((event, *self.retriever.candidates(event)))
            else:
                self._start_worker().submit(event)
        if self.aligner is not None:
            self._align(cycle)
        self.tokens.extend(cycle.emitted)

    # -- cache updates --------------------------------------------------------------------------------------
    def apply_ready(self, wait: bool = False) -> None:
        """Admit the candidates of every finished retrieval (``wait``: of every queued one) into the cache."""
        ready, self._ready = self._ready, []
        if self._worker is not None:
            ready += self._worker.drain(wait)
        for event, candidates, seconds in ready:
            if candidates is None:
                self.stats.failed += 1
                continue
            self.stats.retrievals += 1
            self.stats.retrieval_s += seconds
            self.stats.candidates += len(candidates)
            self.stats.inserted += len(self.cache.admit(candidates, self.cfg.max_insert))
        if self.cache.version != self._version:
            self._version = self.cache.version
            self._dynamic_np = np.asarray(self.cache.resident(), dtype=np.int64)
            self.dynamic = torch.from_numpy(self._dynamic_np).to(self.device)
            self.active = self._active_set()

    def _active_set(self) -> ActiveSet:
        """The core and the dynamic ids, each a set kept until it is replaced: the core for the whole generation,
        the dynamic ids until the cache admits or evicts (a new tensor, a new key: the head copies changed rows)."""
        return ActiveSet.of(Prefix.whole(self.core), Prefix.whole(self.dynamic))

    def _start_worker(self) -> _Worker:
        if self._worker is None:
            if self._closed:
                raise RuntimeError("EvoSpecPolicy is closed")
            self._worker = _Worker(self.retriever)
            self._finalizer = weakref.finalize(self, self._worker.close)
        return self._worker

    def _align(self, cycle: CycleReport) -> None:
        """Path B: a rejected draft token whose verified replacement lies inside the active set is a sample."""
        k = cycle.accepted
        if k >= len(cycle.draft_tokens) or k >= len(cycle.emitted):
            return  # everything accepted (no mismatch), or the correction was cut by EOS/length
        x = cycle.emitted[k]
        if x < self.vocab_size and self.active.contains(x):
            self.aligner.add(self.tokens[: cycle.position], cycle.emitted[: k + 1], cycle.target_logits[: k + 1])

    # -- reporting and tear-down ----------------------------------------------------------------------------
    def summary(self) -> dict:
        """Counters of this generation, JSON-ready."""
        s, c = self.stats, self.cache.stats
        out = {
            "cycles": s.cycles,
            "oov_events": s.oov_events,
            "retrievals": s.retrievals,
            "mean_retrieval_ms": round(s.mean_retrieval_ms, 4),
            "candidates_per_event": round(s.candidates / s.retrievals, 2) if s.retrievals else 0.0,
            "inserted": s.inserted,
            "evicted": c.evicted,
            "blocked": c.blocked,
            "dynamic_size": len(self.cache),
            "t1": len(self.cache.t1),
            "t2": len(self.cache.t2),
            "arc_p": round(self.cache.p, 2),
            "dropped": s.dropped,
            "failed": s.failed,
        }
        if self.aligner is not None:
            a = self.aligner.stats
            out["align"] = {"samples": a.samples, "updates": a.updates, "update_s": round(a.update_s, 3), "losses": a.losses}
        return out

    def close(self) -> None:
        """Stop the retrieval thread and remove the alignment adapter (idempotent). Call after each generation."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self.stats.dropped += self._finalizer() or 0
        if self.aligner is not None:
            self.aligner.close()

    def __enter__(self) -> "EvoSpecPolicy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
