"""Where a proposal begins: the plugin's one hook into vLLM's model runner, which tells a draft that reads the
request's context which requests its batch rows are, before the drafter runs.

vLLM hands a draft model hidden states only. Its V1 model runner starts every proposal in
``GPUModelRunner.propose_draft_token_ids(scheduler_output, sampled_token_ids, …)`` (vllm 0.32.0
``v1/worker/gpu_model_runner.py``; vLLM's CPU runner inherits it), which calls the proposer's ``propose``. The
plugin's :func:`register <dynvocab.serving.vllm.register>` wraps that method once per process (:func:`install`);
each call tells the draft's :class:`~dynvocab.serving.vllm.context.EngineContext` (:meth:`begin
<dynvocab.serving.vllm.context.EngineContext.begin>`), before the drafter runs:

- the batch's request ids in row order (``input_batch.req_ids``);
- each row's verified tokens through this step: the runner's record (``token_ids_cpu`` up to
  ``num_tokens_no_spec``) and this step's sampled tokens (``sampled_token_ids``: on the device before the runner's
  bookkeeping, where a rejected draft is -1; a row whose tokens are discarded, a chunk of a prompt, gets none). Under
  async scheduling the record holds -1 placeholders where earlier steps' tokens go (the runner writes the real ones
  to the device only): :class:`RequestTokens` fills them from what the plugin saw at those steps;
- k for this step (``scheduler_output.num_spec_tokens_to_schedule``: a batch-size schedule changes it per step).

The step's sampled tokens are read to the host once per proposal (one device sync on a GPU), only for a draft whose
strategy follows requests. Nothing else is read off the runner, and the draft's passes are counted from this call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
ENTRY = "propose_draft_token_ids"  # the runner's method wrapped: (self, scheduler_output, sampled_token_ids, …)
_MARK = "__dynvocab_proposal__"  # set on the wrapper, so a process installs it once


@dataclass(frozen=True)
class Proposal:
    """One proposal's batch as the runner announced it: ``requests`` [B] request ids in row order, ``tokens`` [B]
    each row's verified tokens through this step (host int64 arrays; None where earlier tokens are placeholders the
    plugin never saw), ``k`` the draft tokens asked for."""

    requests: tuple
    tokens: list
    k: int

    @property
    def rows(self) -> int:
        """The batch's rows."""
        return len(self.requests)


class RequestTokens:
    """Each request's tokens as the last proposal announced them, for the requests of the last batch only (so at
    most ``max_num_seqs`` requests): what fills the record's async-scheduling placeholders at the next step."""

    def __init__(self):
        self._known: dict[object, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._known)

    def through_step(self, requests, record: np.ndarray, counts, sampled: list[list[int]]) -> list:
        """Each row's tokens: the first ``counts[i]`` of ``record[i]``, placeholders (< 0) filled from the tokens
        this request had at the last proposal, then ``sampled[i]``; None where a placeholder cannot be filled."""
        out: list[np.ndarray | None] = []
        for row, request in enumerate(requests):
            mine = np.asarray(record[row, : int(counts[row])], dtype=np.int64)
            holes = np.flatnonzero(mine < 0)
            if holes.size:
                known = self._known.get(request)
                if known is None or holes[-1] >= known.shape[0]:
                    out.append(None)
                    continue
                mine = mine.copy()
                mine[holes] = known[holes]
            out.append(np.concatenate([mine, np.asarray(sampled[row], dtype=np.int64)]))
        self._known = {r: t for r, t in zip(requests, out) if t is not None}
        return out


def sampled_lists(sampled, rows: int, discarded=None) -> list[list[int]]:
    """This step's sampled tokens per row, as the runner hands them to the proposer: a device tensor [B, ≤ k + 1]
    (before the runner's bookkeeping; a rejected draft and what follows it is -1) gives each row's leading valid
    tokens; a list (after the bookkeeping, which already wrote them to the record) gives none. ``discarded`` [B]:
    rows whose sample the runner throws away (a prompt chunk)."""
    if isinstance(sampled, (list, tuple)):
        return [[] for _ in range(rows)]
    values = sampled[:rows].tolist()  # the proposal's one host read
    out = []
    for row, tokens in enumerate(values):
        valid = []
        for token in tokens:
            if token < 0:
                break
            valid.append(int(token))
        out.append([] if discarded is not None and bool(discarded[row]) else valid)
    return out


def announce(runner, scheduler_output, sampled) -> None:
    """Tell the runner's draft (where it reads the request's context) which requests this proposal's rows are."""
    model = getattr(getattr(runner, "drafter", None), "model", None)
    unwrap = getattr(model, "unwrap", None)  # a draft captured as a CUDA graph is wrapped; the state lives outside it
    model = unwrap() if callable(unwrap) else model
    context = getattr(model, "dynvocab_context", None)
    policy = getattr(model, "dynvocab", None)
    if context is None or policy is None or not policy.follows_requests:
        return
    batch = runner.input_batch
    rows = int(batch.num_reqs)
    discard = getattr(getattr(runner, "discard_request_mask", None), "np", None)
    context.begin(tuple(batch.req_ids[:rows]), batch.token_ids_cpu, batch.num_tokens_no_spec[:rows],
                  sampled_lists(sampled, rows, None if discard is None else discard[:rows]),
                  int(scheduler_output.num_spec_tokens_to_schedule))


def install() -> bool:
    """Wrap the runner's proposal entry once in this process (True: installed, now or before; False: this vLLM has
    no such runner method, so no draft can follow its requests)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    original = getattr(GPUModelRunner, ENTRY, None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        announce(self, scheduler_output, sampled_token_ids)
        return original(self, scheduler_output, sampled_token_ids, *args, **kwargs)

    setattr(propose_draft_token_ids, _MARK, True)
    setattr(GPUModelRunner, ENTRY, propose_draft_token_ids)
    return True


def installed() -> bool:
    """Whether this process's runner announces its proposals (:func:`install` ran and found the method)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return False
    return bool(getattr(getattr(GPUModelRunner, ENTRY, None), _MARK, False))
