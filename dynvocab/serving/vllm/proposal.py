"""Where a proposal begins: the plugin's one hook into vLLM's model runner, which tells a draft that reads the
request's context which requests its batch rows are, before the drafter runs.

vLLM hands a draft model hidden states only. Its V1 model runner starts every proposal in
``GPUModelRunner.propose_draft_token_ids(scheduler_output, sampled_token_ids, …)`` (vllm 0.32.0
``v1/worker/gpu_model_runner.py``; vLLM's CPU runner inherits it), which calls the proposer's ``propose``. The
plugin's :func:`register <dynvocab.serving.vllm.register>` wraps that method once per process (:func:`install`);
each call tells the draft's :class:`~dynvocab.serving.vllm.context.EngineContext` (:meth:`begin
<dynvocab.serving.vllm.context.EngineContext.begin>`), before the drafter runs:

- the batch's request ids in row order (``input_batch.req_ids``);
- each row's verified tokens through this step (:class:`RequestTokens`): the tokens through the request's last
  proposal, as the plugin announced them, and this step's sampled tokens (``sampled_token_ids``: on the device
  before the runner's bookkeeping, where a rejected draft is -1; a row whose tokens are discarded, a chunk of a
  prompt, gets none). The runner's host record (``token_ids_cpu``, ``num_tokens_no_spec``) is the history only where
  it schedules synchronously; under async scheduling it holds placeholders and its count is not the history's length
  (:class:`RunnerRecord`), so it only checks what the plugin announced, and a row whose history cannot be known is
  counted (:mod:`.without_context`), never truncated;
- k for this step (``scheduler_output.num_spec_tokens_to_schedule``: a batch-size schedule changes it per step).

The step's sampled tokens reach the host by a non-blocking copy started here (:class:`HostSampled`), waited on only
at the proposal's first head call, once the drafter's first pass is queued; only for a draft whose strategy follows
requests. Nothing else is read off the runner, and the draft's passes are counted from this call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
ENTRY = "propose_draft_token_ids"  # the runner's method wrapped: (self, scheduler_output, sampled_token_ids, …)
_MARK = "__dynvocab_proposal__"  # set on the wrapper, so a process installs it once


@dataclass(frozen=True)
class Proposal:
    """One proposal's batch as the runner announced it: ``requests`` [B] request ids in row order, ``tokens`` [B]
    each row's verified tokens through this step (host int64 arrays; None where the plugin cannot know them, counted
    by ``missing``), ``k`` the draft tokens asked for."""

    requests: tuple
    tokens: list
    k: int
    missing: dict = field(default_factory=dict)  # reason -> rows whose tokens are None for it

    @property
    def rows(self) -> int:
        """The batch's rows."""
        return len(self.requests)


# Why a row's verified tokens cannot be known (each counted as a row drafted without its request's context).
UNANNOUNCED = "earlier tokens the runner keeps as async-scheduling placeholders, in a request no proposal announced"
UNPROPOSED = "tokens verified at a step that proposed nothing (the runner holds more than the last proposal announced)"
DROPPED = "the runner holds fewer verified tokens than the last proposal announced"
DISAGREES = "the runner's record disagrees with the prompt the last proposal announced"
PLACEHOLDERS = "placeholders in the record of a runner that schedules synchronously"
UNSAMPLED = "this step's sampled tokens are not on the host (async scheduling drafting after the bookkeeping)"


@dataclass(frozen=True)
class RunnerRecord:
    """The runner's host record of a proposal's rows (vllm 0.32.0 ``v1/worker/gpu_input_batch.py``, ``InputBatch``):
    ``tokens`` [B, L] (``token_ids_cpu``), ``counts`` [B] (``num_tokens_no_spec``), ``prompts`` [B]
    (``num_prompt_tokens``), ``computed`` [B] (``num_computed_tokens_cpu``: the tokens in the KV cache before this
    step; under async scheduling corrected for the last step's rejected drafts before the forward,
    ``gpu_model_runner.py`` ``_update_states``' deferred ``correct_spec_decode_token_counts``), and ``lagging``: the
    runner schedules asynchronously (``use_async_scheduling``).

    Under async scheduling (vllm 0.32.0 ``v1/worker/gpu_model_runner.py``) the bookkeeping after each step writes one
    -1 per row into ``token_ids_cpu`` and advances ``num_tokens_no_spec`` by one (``_bookkeeping_sync``:
    ``sampled_ids = [-1]``), whatever the step accepted; the next step's ``_update_states`` extends the request's
    outputs by the drafts it scheduled, optimistically, and may then set ``num_tokens_no_spec`` to the prompt plus
    the scheduler's output count (``del req_state.output_token_ids[num_output_tokens:]``). So the count runs behind
    or ahead of the verified tokens, and the positions past the prompt hold placeholders or whatever an earlier
    request in the row left. Only the prompt is certain there; ``computed`` + 1 is the verified length before this
    step, once the prompt is in the cache (the last verified token is the step's first input)."""

    tokens: np.ndarray
    counts: np.ndarray
    prompts: np.ndarray
    computed: np.ndarray
    lagging: bool = False

    def verified_before(self, row: int) -> int:
        """Row ``row``'s verified tokens before this step under async scheduling: its prompt, or the tokens in the
        cache and the step's first input once the prompt is in."""
        return max(int(self.computed[row]) + 1, int(self.prompts[row]))

    def held(self, row: int) -> np.ndarray:
        """The record's first ``counts[row]`` tokens of ``row``."""
        return np.asarray(self.tokens[row, : int(self.counts[row])], dtype=np.int64)


class RequestTokens:
    """Each request's tokens as the last proposal announced them, for the requests of the last batch only (so at
    most ``max_num_seqs`` requests): the history that async scheduling's record does not hold."""

    def __init__(self):
        self._known: dict[object, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._known)

    def before_step(self, requests, record: RunnerRecord) -> tuple[list, list]:
        """Each row's verified tokens before this step's sampled ones, and for a row where they cannot be known,
        None and the reason (one of this module's reasons).

        Synchronously, the record is the history (the bookkeeping wrote each step's verified tokens before this
        proposal). Under async scheduling a request the last proposal announced continues from what it announced,
        checked against the runner: as many tokens as the runner verified before this step
        (:meth:`RunnerRecord.verified_before`), and the same prompt; a request it did not announce (new, or resumed
        after preemption: vLLM writes its tokens whole, ``gpu_input_batch.py`` ``add_request``) is taken from the
        record where it holds no placeholder."""
        tokens: list[np.ndarray | None] = []
        reasons: list[str | None] = []
        for row, request in enumerate(requests):
            held, known = record.held(row), self._known.get(request)
            found, why = held, None
            if not record.lagging:
                why = PLACEHOLDERS if (held < 0).any() else None
            elif known is None:
                why = UNANNOUNCED if (held < 0).any() else None
            else:
                found, prompt, before = known, int(record.prompts[row]), record.verified_before(row)
                if known.shape[0] != before:
                    why = UNPROPOSED if known.shape[0] < before else DROPPED
                elif not np.array_equal(record.tokens[row, :prompt], known[:prompt]):
                    why = DISAGREES
            tokens.append(None if why else found)
            reasons.append(why)
        return tokens, reasons

    def through_step(self, requests, before: list, sampled: list[list[int]] | None) -> tuple[list, list]:
        """Each row's tokens through this step: ``before`` (:meth:`before_step`) and its ``sampled`` tokens (None:
        not on the host, so no row's are known); remembered for the next step, for these requests only. Returns
        the tokens and each unknown row's reason (None for the known ones and the ones ``before`` lacked)."""
        out: list[np.ndarray | None] = []
        reasons: list[str | None] = []
        for row, base in enumerate(before):
            if base is None or sampled is None:
                out.append(None)
                reasons.append(None if base is None else UNSAMPLED)
                continue
            out.append(np.concatenate([base, np.asarray(sampled[row], dtype=np.int64)]))
            reasons.append(None)
        self._known = {r: t for r, t in zip(requests, out) if t is not None}
        return out, reasons


class HostSampled:
    """This step's sampled tokens on their way to the host: a device tensor [B, ≤ k + 1] (before the runner's
    bookkeeping; a rejected draft and what follows it is -1) is copied by a non-blocking copy into ``buffer`` (pinned
    host memory) and waited on at :meth:`lists` only; a list (handed over after the bookkeeping) holds nothing new:
    synchronously the record has the step's tokens already, under async scheduling they are unknown. ``discarded``
    [B]: rows whose sample the runner throws away (a prompt chunk)."""

    def __init__(self, sampled, rows: int, discarded=None, lagging: bool = False, buffer=None):
        self._rows, self._discarded, self._event = rows, discarded, None
        self._host = None
        if isinstance(sampled, (list, tuple)):
            self._lists = None if lagging else [[] for _ in range(rows)]
            return
        self._lists = None
        device = sampled[:rows]
        if device.device.type == "cpu":
            self._host = device
            return
        import torch

        host = buffer(device.shape, device.dtype) if buffer is not None else torch.empty(
            device.shape, dtype=device.dtype, pin_memory=True)
        host.copy_(device, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        self._host = host

    def lists(self) -> list[list[int]] | None:
        """Each row's leading valid tokens (None: the step's tokens are not on the host); waits for the copy."""
        if self._host is None:
            return self._lists
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        values = self._host.tolist()
        out = []
        for row, tokens in enumerate(values):
            valid = []
            for token in tokens:
                if token < 0:
                    break
                valid.append(int(token))
            out.append([] if self._discarded is not None and bool(self._discarded[row]) else valid)
        self._lists, self._host = out, None
        return out


def sampled_lists(sampled, rows: int, discarded=None) -> list[list[int]] | None:
    """This step's sampled tokens per row, as the runner hands them to the proposer (:class:`HostSampled`, read
    now)."""
    return HostSampled(sampled, rows, discarded).lists()


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
    lagging = bool(getattr(runner, "use_async_scheduling", False))
    discard = getattr(getattr(runner, "discard_request_mask", None), "np", None)
    record = RunnerRecord(batch.token_ids_cpu, batch.num_tokens_no_spec[:rows], batch.num_prompt_tokens[:rows],
                          batch.num_computed_tokens_cpu[:rows], lagging)
    context.begin(tuple(batch.req_ids[:rows]), record, sampled, None if discard is None else discard[:rows],
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
