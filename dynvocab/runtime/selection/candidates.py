"""The candidates of one out-of-vocabulary event, EvoSpec's retrieval: the emitted token, the target's top
ids and the HNSW neighbours as seeds, then each seed's graph successors. One function for the loop's ``evospec`` and
``hybrid`` policies (:mod:`dynvocab.runtime.selection`) and ``evospec`` in a batched host
(:mod:`dynvocab.runtime.selection.evospec.evospec`)."""

from __future__ import annotations

import numpy as np


def assemble_candidates(
    token: int,
    target_top: list[int] | tuple[int, ...],
    semantic: list[int] | np.ndarray,
    indptr: np.ndarray,
    indices: np.ndarray,
    fanout: int,
    in_core: np.ndarray,
) -> list[int]:
    """The ordered candidate list of one OOV event.

    Seeds are ``token``, then ``target_top``, then ``semantic`` (HNSW) ids, deduplicated; then up to
    ``fanout`` graph successors of every seed, taken round-robin by rank (every seed's best successor first).
    Ids outside the draft's vocabulary (``in_core`` has one entry per draft row) and ids in the core are dropped.
    ``indptr`` [V_graph + 1] / ``indices`` [E] are the CSR successor lists, best first.
    """
    vocab = in_core.shape[0]
    seeds: list[int] = []
    for t in (token, *target_top, *semantic):
        t = int(t)
        if t not in seeds:
            seeds.append(t)
    rows = [
        indices[indptr[s] : min(indptr[s + 1], indptr[s] + fanout)] if 0 <= s < indptr.shape[0] - 1 else indices[:0]
        for s in seeds
    ]
    out: list[int] = []
    seen: set[int] = set()
    for t in (*seeds, *_round_robin(rows, fanout)):
        if t in seen or not 0 <= t < vocab or in_core[t]:
            continue
        seen.add(t)
        out.append(t)
    return out


def _round_robin(rows: list[np.ndarray], width: int) -> list[int]:
    return [int(r[i]) for i in range(width) for r in rows if i < r.shape[0]]
