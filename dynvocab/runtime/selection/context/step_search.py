"""Whether the hybrid's per-step candidate search pays for a draft: decided by measuring it, not by the draft's kind.

A per-step search (the top rows of an HNSW index over the draft head for the hidden state, and graph successors)
buys acceptance with a small active set, but it runs at every draft step. Measured on the demo pair (AMD EPYC,
2 threads, int8 draft): 4.1 ms a step against 3.75 ms for the whole int8 head it was meant to shrink; with a
bfloat16 draft (a ~15 ms head) it hid inside the step. So the search runs where it costs less than
:data:`SEARCH_SHARE` of the draft's full head, timed once per draft and index on this machine.
"""

from __future__ import annotations

import time

import torch

from dynvocab.artifacts import mips_search
from dynvocab.runtime.drafts.draft import DraftInfo

SEARCH_SHARE = 0.25  # the per-step search may cost at most this share of the draft's full head
_MEASURED: dict = {}  # (id(draft), id(index), k) -> (draft, index, search ms, head ms)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


@torch.inference_mode()
def search_costs(draft: DraftInfo, index, neighbours: int, repeats: int = 7) -> tuple[float, float]:
    """``(search ms, full head ms)`` per draft step for ``draft`` and its head's HNSW ``index`` (the search of
    ``neighbours`` rows for one hidden state, the product over every row of the draft's head, ``draft.rows``),
    measured once and kept."""
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


def search_pays(draft: DraftInfo, index, neighbours: int) -> bool:
    """Whether a per-step search of ``neighbours`` rows costs less than :data:`SEARCH_SHARE` of ``draft``'s full
    head (see :func:`search_costs`)."""
    search, head = search_costs(draft, index, neighbours)
    return search < SEARCH_SHARE * head
