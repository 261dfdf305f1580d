"""MicroSpec: a training-free in-context vocabulary, the distinct ids of the last W entries of the request's stream,
and the per-request state that keeps them for every host (:class:`RequestWindows`).

One selector (:class:`WindowSelector`), one state; each host pushes the stream it sees:

- **dynvocab's loop** (:class:`StreamPolicy`) pushes the paper's stream: the prompt's tokens and the target's top-K_pre
  at the last prompt positions, then each cycle the draft's tokens (with chain drafting also its top alternatives
  per step) and the target's top-K_ver at the verified positions (paper §4.1: K_pre = K_ver = 3, W_max = 3072);
- **a batched host** (the vLLM plugin, :mod:`dynvocab.serving.vllm.context`) folds in each request's token record
  (prompt and verified output) once per engine step: its engine hands a draft neither the draft's alternatives nor
  the target's logits.

A window is rebuilt from its last W entries only where its stream grew: its distinct ids sorted, packed first, the
rest padded by repeating the last token (a padded id's logits equal the id's own, so the argmax and the scattered row
are the same as with one copy). The loop's packed head gets the same tensor while the set is unchanged, a new one
(whose changed rows the head copies) where it changed.

A window holds its distinct ids first, so a batched host may hand a step only the columns its batch fills
(:meth:`RequestWindows.width`): a bucket of a few widths, so that the shapes a step sees stay few.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dynvocab.artifacts.bundle import Bundle
from dynvocab.errors import DynvocabError
from dynvocab.runtime.heads.active_set import ActiveSet, NodeSets, Prefix
from dynvocab.runtime.heads.selected_head import BatchSets
from dynvocab.runtime.host import to_host_tensor
from dynvocab.runtime.selection.base import CycleReport, SelectorPolicy
from dynvocab.runtime.selection.batch_select import ContextSelector, StepContext, bundle_eos

MIN_WIDTH = 64  # the narrowest bucket :meth:`RequestWindows.width` gives; the others double up to the window


@dataclass(frozen=True)
class MicroSpecConfig:
    """MicroSpec's knobs (paper §4.1 defaults)."""

    k_pre: int = 3
    k_ver: int = 3
    window: int = 3072
    draft_alternatives: int = 3  # chain drafting: the draft's top-k at each step join the stream
    prefill_positions: int | None = None  # the last prompt positions whose top-K_pre join (None: window / K_pre)

    def prefill_rows(self) -> int:
        """The prompt positions (the last) whose target top-K_pre join the stream: ``prefill_positions``, else as
        many as the window holds (``window / k_pre``); 0 seeds the window with the prompt's own tokens only."""
        if self.prefill_positions is not None:
            return self.prefill_positions
        return max(1, self.window // max(1, self.k_pre))


def unique_in_order(ids: torch.Tensor) -> torch.Tensor:
    """Distinct ids of a 1-D tensor, in order of first appearance."""
    uniq, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((uniq.numel(),), ids.numel(), dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(ids.numel(), device=ids.device), reduce="amin")
    return uniq[first.argsort()]


class RequestWindows:
    """``slots`` windows of ``size`` tokens; ``ids`` [slots, size] holds each request's distinct ids, padded by
    repeating its last token (a slot with no tokens holds ``fill``)."""

    def __init__(self, slots: int, size: int, vocab_size: int, fill: int = 0, device: torch.device | str = "cpu"):
        if slots < 1 or size < 1:
            raise DynvocabError(f"request windows need at least 1 slot of 1 token (got {slots} × {size})")
        self.size, self.vocab_size, self.fill = size, vocab_size, fill
        self.ids = torch.full((slots, size), fill, dtype=torch.long, device=device)  # [slots, size]
        self._slot: dict[object, int] = {}  # request key -> its slot
        self._seen: dict[object, int] = {}  # request key -> tokens of its record folded in
        self._distinct = [0] * slots  # each slot's distinct ids (its columns before the padding)
        self._free = list(range(slots - 1, -1, -1))
        self._streams: dict[object, np.ndarray] = {}  # request key -> the last ``size`` entries pushed (:meth:`push`)

    def __len__(self) -> int:
        """Requests that hold a slot."""
        return len(self._slot)

    def keys(self) -> set:
        """The requests that hold a slot."""
        return set(self._slot)

    def update(self, key, record: np.ndarray | torch.Tensor) -> int:
        """Fold request ``key``'s whole token record [n] in (only where it changed) and return its slot."""
        record = np.asarray(record)
        return self.update_many([key], record[None], [record.shape[0]])[0]

    def update_many(self, keys: Sequence, tokens: np.ndarray | torch.Tensor, counts) -> list[int]:
        """Fold in the token record of each request ``keys[i]``, the first ``counts[i]`` entries of ``tokens[i]``,
        and return their slots: the same as :meth:`update` for each key in order, but the windows whose records
        changed are rebuilt together (:meth:`_rebuild`), the others left alone.

        ``tokens`` [R, L] host ints with a row for each key (R >= len(keys); in vLLM ``input_batch.token_ids_cpu``),
        ``counts`` [>= len(keys)] host ints (``input_batch.num_tokens_no_spec``)."""
        counts = np.asarray(counts)[: len(keys)].tolist()
        if len(counts) < len(keys):
            raise DynvocabError(f"request windows got {len(keys)} requests but {len(counts)} record lengths")
        slots: list[int] = []
        changed: dict[int, tuple[int, int]] = {}  # slot -> (row of tokens, record length) it is rebuilt from
        try:
            for row, (key, n) in enumerate(zip(keys, counts)):
                slot = self._slot.get(key)
                if slot is None:
                    slot = self._claim(key)
                elif self._seen[key] == n:
                    slots.append(slot)
                    continue
                self._seen[key] = n
                changed[slot] = (row, n)
                slots.append(slot)
        finally:  # the keys folded in before a full table refused one hold their windows, as with update
            if changed:
                self._rebuild(np.asarray(tokens), changed)
        return slots

    def push(self, key, entries: np.ndarray) -> torch.Tensor:
        """Append ``entries`` [n] to the stream of request ``key`` that the windows keep (for a host that keeps no
        record: dynvocab's loop, whose stream is MicroSpec's) and return the window's distinct ids [m], ascending
        (a view of :attr:`ids`, overwritten by the next rebuild of the slot)."""
        slot = self._slot[key] if key in self._slot else self._claim(key)
        stream = np.concatenate([self._streams.get(key, np.empty(0, np.int64)), entries.astype(np.int64)])
        self._streams[key] = stream = stream[-self.size :]
        self._seen[key] = -1  # a pushed stream is no host's record
        self._rebuild(stream[None], {slot: (0, stream.shape[0])})
        return self.ids[slot, : self._distinct[slot]]

    def _claim(self, key) -> int:
        """A free slot for the new request ``key``."""
        if not self._free:
            raise DynvocabError(f"request windows are full ({self.ids.shape[0]} requests); free finished ones")
        slot = self._slot[key] = self._free.pop()
        return slot

    def _rebuild(self, tokens: np.ndarray, changed: dict[int, tuple[int, int]]) -> None:
        """Rebuild each window ``slot`` of ``changed`` from its record, the first ``n`` of ``tokens[row]``, all at
        once (:meth:`_windows`): one write of the rows, one read of their distinct counts."""
        slots = list(changed)
        rows, ends = (np.array(x, dtype=np.int64) for x in zip(*changed.values()))
        out, distinct = self._windows(tokens, rows, ends)
        device = self.ids.device
        self.ids[torch.tensor(slots, device=device)] = torch.from_numpy(out).to(device)
        for slot, count in zip(slots, distinct.tolist()):
            self._distinct[slot] = count

    def _windows(self, tokens: np.ndarray, rows: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The windows [m, size] of the records ``tokens[rows[i], :ends[i]]`` and their distinct counts [m]: the last
        ``size`` tokens gathered [m, w] (w the window, or the longest record if shorter), those before the record's
        start or outside the vocabulary sorted past every id, each row sorted, its first occurrences packed to its
        front in order, and the rest padded with the record's last valid token (``fill`` where it has none). On the
        host in numpy: its row sort of a few thousand ints was ~9x faster than torch's (0.06 against 0.5 ms, 8 rows
        of 3,000)."""
        width = min(self.size, int(ends.max()))
        if width == 0:  # every record empty
            return np.full((len(rows), self.size), self.fill, dtype=np.int64), np.zeros(len(rows), dtype=np.int64)
        at = ends[:, None] - width + np.arange(width)  # [m, w] the positions of each record's last w tokens
        tail = tokens[rows[:, None], np.maximum(at, 0)]
        if tail.dtype != np.int32:  # vLLM's int32 as it is (a faster sort), any other as int64
            tail = tail.astype(np.int64)
        valid = (at >= 0) & (tail >= 0) & (tail < self.vocab_size)
        keyed = np.sort(np.where(valid, tail, self.vocab_size), axis=1)  # the invalid ones last
        first = keyed < self.vocab_size
        first[:, 1:] &= keyed[:, 1:] != keyed[:, :-1]
        distinct = first.sum(axis=1)
        last = width - 1 - valid[:, ::-1].argmax(axis=1)  # each record's last valid token (where it has one)
        pad = np.where(valid.any(axis=1), tail[np.arange(len(rows)), last], self.fill)
        out = np.repeat(pad.astype(np.int64)[:, None], self.size, axis=1)
        out[np.arange(self.size) < distinct[:, None]] = keyed[first]  # row-major: each row's distinct ids first
        return out, distinct

    def width(self, slots) -> int:
        """The columns of ``ids`` that hold every distinct id of the windows in ``slots`` (host ints): the largest
        one's count rounded up to a power of two times :data:`MIN_WIDTH`, at most the window's size. The columns
        past it are padding (repeats of a window's last token), so ``ids[rows, :width]`` is the same set per row."""
        most = max((self._distinct[s] for s in slots), default=0)
        width = MIN_WIDTH
        while width < most:
            width *= 2
        return min(width, self.size)

    def keep(self, alive) -> None:
        """Give back the slots of every request not in ``alive``."""
        for key in [k for k in self._slot if k not in alive]:
            slot = self._slot.pop(key)
            self._free.append(slot)
            self._distinct[slot] = 0
            del self._seen[key]
            self._streams.pop(key, None)


class WindowSelector(ContextSelector):
    """``microspec``: each row's request window (the distinct ids of its last ``window`` stream entries) and the EOS
    ids (so drafts can end)."""

    name = "microspec"
    reads = frozenset({"window"})

    def __init__(self, window: int, eos: torch.Tensor):
        if window < 1:
            raise DynvocabError(f"microspec needs a window of at least 1 token (got {window})")
        self.window, self.eos = window, eos.long()
        self.k = window + int(self.eos.numel())
        self._kept: tuple | None = None  # (the window row, its ActiveSet) of the last row_set

    def select(self, hidden: torch.Tensor, ctx: StepContext) -> BatchSets:
        if ctx.windows is None:
            raise DynvocabError("microspec reads the request's window; the host keeps none")
        return BatchSets(self.eos if self.eos.numel() else None, ctx.windows)

    def row_set(self, hidden: torch.Tensor | None, ctx: StepContext) -> ActiveSet:
        """The window ``ctx.windows`` [1, n] (distinct, ascending), then the EOS ids it lacks, as one kept segment (one
        product a step): the same object while the host hands the same window tensor."""
        if self._kept is None or self._kept[0] is not ctx.windows:
            ids = ctx.windows[0]
            at = torch.searchsorted(ids, self.eos).clamp(max=max(ids.numel() - 1, 0))
            lacked = self.eos if ids.numel() == 0 else self.eos[ids[at] != self.eos]
            self._kept = (ctx.windows, ActiveSet.of(Prefix.whole(torch.cat([ids, lacked]) if lacked.numel() else ids)))
        return self._kept[1]

    def node_sets(self, hidden: torch.Tensor, ctx: StepContext) -> NodeSets | None:
        """None: every node of a tree depth has its request's one window."""
        return None


def window_from_bundle(bundle: Bundle, budget: int, vocab_size: int, hidden_size: int,
                       device: torch.device) -> WindowSelector:
    """``microspec`` in a batched host: a window of ``budget`` tokens per request and the bundle's EOS ids."""
    return WindowSelector(budget, bundle_eos(bundle, vocab_size, device))


class StreamPolicy(SelectorPolicy):
    """dynvocab's loop as the host of a window selector (``microspec``, ``hybrid``): it pushes MicroSpec's stream
    (``cfg``: a :class:`MicroSpecConfig`) into one request's :class:`RequestWindows` and hands the selector the
    window's distinct ids, the same tensor while they are the same."""

    def __init__(self, selector, cfg: MicroSpecConfig, vocab_size: int, device):
        super().__init__(selector, device=device)
        self.cfg, self.vocab_size = cfg, vocab_size
        self.draft_topk = cfg.draft_alternatives
        # The window keeps the newest ``window`` entries, which the top-K_pre of the last window / K_pre prompt
        # positions fill: earlier positions' logits (a [L, V] product on a long replayed history) are not computed.
        self.prefill_logit_rows = cfg.prefill_rows()
        self.prefill_logits = self.prefill_logit_rows > 0
        self.windows = RequestWindows(1, cfg.window, vocab_size, device=device)
        self.window = self.windows.ids[:, :0]  # [1, n] the window's distinct ids, ascending

    def prefill(self, prompt_ids, target_logits, target_hidden) -> None:
        """S_init = prompt ⊕ ∪_i top-K_pre(z_i) (the last prompt position arrives with the first cycle)."""
        entries = [prompt_ids[prompt_ids < self.vocab_size]]
        if target_logits is not None and target_logits.numel():
            top = target_logits[:, : self.vocab_size].topk(self.cfg.k_pre, dim=-1).indices  # [L-1, K_pre]
            entries.append(unique_in_order(top.flatten()))
        self.push(torch.cat([e.to(self.device) for e in entries]))

    def observe(self, cycle: CycleReport) -> None:
        """S ← S ⊕ (what the strategy adds, :meth:`seen`) ⊕ C_draft ⊕ C_ver."""
        drafted = [torch.tensor(cycle.draft_tokens, dtype=torch.long, device=self.device), *cycle.draft_top]
        c_draft = unique_in_order(torch.cat(drafted)) if cycle.draft_tokens else drafted[0]
        verified = cycle.target_logits[: cycle.accepted + 1, : self.vocab_size]  # [k+1, V] on the accepted path
        c_ver = unique_in_order(verified.topk(self.cfg.k_ver, dim=-1).indices.flatten())
        self.push(torch.cat([t.to(self.device) for t in (*self.seen(cycle), c_draft, c_ver)]))

    def seen(self, cycle: CycleReport) -> list[torch.Tensor]:
        """Entries the strategy pushes before the cycle's own (none here; the hybrid's missed neighbours)."""
        return []

    def push(self, entries: torch.Tensor) -> None:
        """Push stream entries; the window tensor changes only where its distinct ids did."""
        ids = self.windows.push(0, to_host_tensor(entries).numpy())  # the window lives on the host, in every host
        if not torch.equal(ids, self.window[0]):
            self.window = ids.clone()[None]

    def _context(self, step: int, fed: torch.Tensor | None) -> StepContext:
        return StepContext(step, fed, windows=self.window)


class MicroSpecPolicy(StreamPolicy):
    """``microspec`` in dynvocab's loop: the window of MicroSpec's stream and the EOS ids (``pinned``)."""

    def __init__(self, cfg: MicroSpecConfig, vocab_size: int, device, pinned: torch.Tensor | None = None):
        eos = torch.empty(0, dtype=torch.long) if pinned is None else pinned
        super().__init__(WindowSelector(cfg.window, torch.unique(eos).to(device)), cfg, vocab_size, device)
