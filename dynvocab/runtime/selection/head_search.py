"""The search of a head's rows nearest a hidden state (largest inner product), by a bundle's HNSW index: the hybrid's
per-step candidates (the draft head's rows, stage ``draft_hnsw``) and EvoSpec's semantic seeds (the target head's,
stage ``hnsw``), in every host; and whether the per-step search pays for a draft, decided by measuring it.

A per-step search buys acceptance with a small active set, but it runs at every draft step. Measured on the demo
pair (AMD EPYC, 2 threads, int8 draft): 4.1 ms a step against 3.75 ms for the whole int8 head it was meant to
shrink; with a bfloat16 draft (a ~15 ms head) it hid inside the step. So the loop searches per step where it costs
less than :data:`SEARCH_SHARE` of the draft's full head, timed once per draft and index on this machine
(:func:`search_pays`).
"""

from __future__ import annotations

import time

import torch

from dynvocab.artifacts.hnsw import MipsIndex, mips_search
from dynvocab.errors import DynvocabError
from dynvocab.runtime.host import to_host_tensor

# HNSW ef of the per-step search in a batched host: on the demo pair in vLLM-CPU (bfloat16, one request) ef 32 kept
# 97.2% of the full head's MAL and ef 64 and 128 98.3% (docs/measurements/2026-11-27-vllm-demo-context-strategies.md);
# one query took ~0.45 / 0.58 / 0.85 ms outside the engine
ENGINE_EF = 64
SEARCH_SHARE = 0.25  # the per-step search may cost at most this share of the draft's full head
_MEASURED: dict = {}  # (id(draft), id(index), k) -> (draft, index, search ms, head ms)


class HeadSearch:
    """Each row's ``neighbours`` head rows of the largest inner product with its hidden state
    (:func:`~dynvocab.artifacts.hnsw.mips_search`). Over a stored index (:class:`~dynvocab.artifacts.hnsw.StoredIndex`)
    the index is laid over the head the host hands it, once per head, and a head of another shape (a shard, another
    model) gets no search: smaller sets, the same output; over a built index (:meth:`over`) it searches that one.
    It reads the hidden state on the host, so hosts run it on CPU devices only."""

    def __init__(self, stored, neighbours: int, ef: int):
        if neighbours < 1 or ef < 1:
            raise DynvocabError(f"the per-step search needs at least 1 neighbour and ef 1 (got {neighbours}, {ef})")
        self.stored, self.neighbours, self.ef = stored, neighbours, max(ef, neighbours)
        self._over: tuple | None = None  # (the head's data pointer, its MipsIndex)

    @classmethod
    def over(cls, index: MipsIndex, neighbours: int, ef: int) -> HeadSearch:
        """A search of the built ``index`` whatever head the host hands (dynvocab's loop: the index it loaded)."""
        search = cls(None, neighbours, ef)
        index.set_ef(search.ef)
        search._over = (None, index)
        return search

    def prepare(self, head: torch.Tensor | None) -> MipsIndex | None:
        """The index over ``head`` [V, d] (its first ``num_elements`` rows; rows past them are padding), built on
        the first call for that head (about 6 s for 151,936 rows of 896), or None where the head is not the indexed
        one."""
        if self.stored is None:
            return self._over[1]
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


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


@torch.inference_mode()
def search_costs(draft, index, neighbours: int, repeats: int = 7) -> tuple[float, float]:
    """``(search ms, full head ms)`` per draft step for ``draft`` (a :class:`~dynvocab.runtime.drafts.draft.DraftInfo`)
    and its head's HNSW ``index`` (the search of ``neighbours`` rows for one hidden state, the product over every
    row of the draft's head, ``draft.rows``), measured once and kept."""
    key = (id(draft), id(index), neighbours)
    if key not in _MEASURED:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(repeats, 1, draft.hidden_size, generator=gen)
        queries = iter(hidden.repeat(2, 1, 1))
        search = _median_ms(lambda: mips_search(index, next(queries), neighbours), repeats)
        h = hidden[0].to(draft.device, draft.rows.dtype)
        head = _median_ms(lambda: draft.rows.linear(h), max(3, repeats // 2))
        _MEASURED[key] = (draft, index, search, head)
    return _MEASURED[key][2:]


def search_pays(draft, index, neighbours: int) -> bool:
    """Whether a per-step search of ``neighbours`` rows costs less than :data:`SEARCH_SHARE` of ``draft``'s full
    head (see :func:`search_costs`)."""
    search, head = search_costs(draft, index, neighbours)
    return search < SEARCH_SHARE * head
