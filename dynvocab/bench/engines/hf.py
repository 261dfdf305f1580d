"""transformers' own speculative decoders as bench rows, on the session's already-loaded models.

* ``hf-assisted`` — ``model.generate(assistant_model=draft)``: the draft proposes up to γ tokens per cycle
  (``num_assistant_tokens = γ``, schedule ``constant``) and stops early at the same confidence as our loop
  (``assistant_confidence_threshold = stop_below``), so it is comparable with our ``full`` strategy drafting a
  chain (transformers verifies no tree leaves).
* ``hf-lookup`` — prompt lookup decoding, ``generate(prompt_lookup_num_tokens=10)``: candidates are copied from
  an n-gram match in the context; no draft model.

They are timed like our loop (wall time of the whole call, prefill included, loading excluded). Forward hooks
count the target's passes (cycles; transformers merges prefill with the first verification) and time the
target (``verify_s``), the draft (``draft_s``) and the draft's LM head (``head_s``); the accepted length per
cycle is read from the target's KV-cache length at each pass. Metrics that do not exist for them are ``None``.
"""

from __future__ import annotations

import time

import torch

from dynvocab.errors import DynvocabError
from dynvocab.runtime.decoding.loop import DecodeConfig
from dynvocab.runtime.decoding.metrics import Metrics

HF_ROWS = ("hf-assisted", "hf-lookup")
LOOKUP_TOKENS = 10  # prompt_lookup_num_tokens


class _Timed:
    """Forward hooks on a module: number of calls, total seconds, and an optional per-call record."""

    def __init__(self, module: torch.nn.Module, cuda: bool, record_inputs: bool = False):
        self.calls = 0
        self.seconds = 0.0
        self.passes: list[tuple[int, int]] = []  # (cached length, new input length) per call
        self._cuda = cuda
        self._start = 0.0
        self._record = record_inputs
        self._handles = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True),
            module.register_forward_hook(self._post),
        ]

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre(self, module, args, kwargs):
        if self._record:
            ids = kwargs.get("input_ids", args[0] if args else None)
            cache = kwargs.get("past_key_values")
            past = cache.get_seq_length() if cache is not None and hasattr(cache, "get_seq_length") else -1
            self.passes.append((int(past), int(ids.shape[-1]) if ids is not None else -1))
        self._start = self._now()

    def _post(self, module, args, output):
        self.seconds += self._now() - self._start
        self.calls += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def accepted_per_cycle(passes: list[tuple[int, int]], prompt_len: int, new_tokens: int) -> list[tuple[int, int]] | None:
    """``(drafted γ_i, accepted k_i)`` per target pass, from ``(cached length, input length)`` at each pass.

    Before pass i the committed sequence has ``c_i`` tokens: ``c_0`` = the prompt (fed whole), later
    ``c_i = cached_i + 1`` (the last committed token is fed again, then the candidates). So
    ``γ_i = input_i − (c_i − cached_i)`` and the pass emitted ``c_{i+1} − c_i = k_i + 1`` tokens.
    Returns None when the hooks could not read the cache.
    """
    if not passes or any(past < 0 or n < 0 for past, n in passes):
        return None
    committed = [prompt_len] + [past + 1 for past, _ in passes[1:]] + [prompt_len + new_tokens]
    out = []
    for i, (past, n) in enumerate(passes):
        gamma = max(0, n - (committed[i] - past))
        emitted = committed[i + 1] - committed[i]
        out.append((gamma, max(0, min(gamma, emitted - 1))))
    return out


def hf_metrics(
    new_tokens: int, wall_s: float, target: _Timed, draft: _Timed | None, head: _Timed | None, prompt_len: int
) -> dict:
    """The metrics dict of an hf row: every key of :class:`Metrics`, ``None`` where the row has no such figure."""
    m = Metrics().as_dict()
    m.update(
        new_tokens=new_tokens,
        cycles=target.calls,
        mean_accepted_length=round(new_tokens / target.calls, 5) if target.calls else 0.0,
        tokens_per_s=round(new_tokens / wall_s, 5) if wall_s > 0 else 0.0,
        wall_s=round(wall_s, 5),
        prefill_s=None,  # merged with the first verification pass
        verify_s=round(target.seconds, 5),
        draft_s=None if draft is None else round(draft.seconds, 5),
        head_s=None if head is None else round(head.seconds, 5),
        policy_s=None,
        mean_active_vocab=None,
        coverage=None,
        head_rows_copied=None,
        leaves=None,
        leaf_hits=None,
        lookup_cycles=None,
        lookup_drafted=None,
        lookup_accepted=None,
    )
    cycles = accepted_per_cycle(target.passes, prompt_len, new_tokens)
    if cycles is None:
        m.update(accept_by_position=[], draft_steps=None)
        return m
    width = max((g for g, _ in cycles), default=0)
    drafted, accepted = [0] * width, [0] * width
    for gamma, k in cycles:
        for j in range(gamma):
            drafted[j] += 1
            accepted[j] += j < k
    m["accept_by_position"] = [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)]
    m["draft_steps"] = sum(g for g, _ in cycles)
    return m


def hf_generate(session, row: str, prompt_ids: list[int], decode: DecodeConfig, lookup_tokens: int = LOOKUP_TOKENS):
    """Run ``hf-assisted`` or ``hf-lookup`` on the session's models; returns ``(new token ids, metrics dict)``."""
    from transformers import GenerationConfig

    target, draft = _hf_models(session, row, prompt_ids)
    cfg = _generation_config(row, decode, sorted(session.eos_ids), lookup_tokens)
    cuda = session.target.device.type == "cuda"
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=session.target.device)  # [1, prompt]
    # The checkpoints' own generation configs (sampling defaults, repetition penalties, the assistant's
    # heuristic schedule) must not leak in: swap in blank ones for the call.
    saved = [(m, m.generation_config) for m in (target, draft) if m is not None]
    hooks: list[_Timed] = []
    try:
        target.generation_config = GenerationConfig()
        hooks.append(_Timed(target, cuda, record_inputs=True))
        kwargs = {}
        if row == "hf-assisted":
            draft.generation_config = GenerationConfig(
                num_assistant_tokens=decode.gamma, num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=decode.stop_below,
            )
            hooks += [_Timed(draft, cuda), _Timed(draft.get_output_embeddings(), cuda)]
            kwargs["assistant_model"] = draft
        out, wall = _timed_generate(target, ids, cfg, row, decode.seed, cuda, kwargs)
    finally:
        for hook in hooks:
            hook.remove()
        for model, gen_cfg in saved:
            model.generation_config = gen_cfg
    new = _to_first_eos([int(t) for t in out[0, len(prompt_ids):]], session.eos_ids)
    t_hook, *draft_hooks = hooks  # the target's; the draft's and its head's (hf-assisted)
    d_hook, h_hook = draft_hooks or (None, None)
    return new, hf_metrics(len(new), wall, t_hook, d_hook, h_hook, len(prompt_ids))


def _hf_models(session, row: str, prompt_ids: list[int]):
    """The target's and (``hf-assisted``) the draft's transformers models; refuses what transformers cannot run."""
    if row not in HF_ROWS:
        raise DynvocabError(f"unknown hf row '{row}'; use one of {', '.join(HF_ROWS)}")
    if not prompt_ids:
        raise DynvocabError("the prompt is empty; pass some text")
    draft = session.draft.info.hf_model if session.draft is not None else None
    if row == "hf-assisted" and session.draft is None:
        raise DynvocabError("hf-assisted needs a draft model; pass --draft")
    if row == "hf-assisted" and draft is None:
        label = session.draft.info.label
        raise DynvocabError(f"hf-assisted needs a draft model; transformers cannot assist with an {label}")
    return session.target.model, draft


def _generation_config(row: str, decode: DecodeConfig, eos: list[int], lookup_tokens: int):
    """The call's whole generation config: our decoding settings in transformers' words."""
    from transformers import GenerationConfig

    sampling = decode.temperature > 0
    return GenerationConfig(
        max_new_tokens=decode.max_new_tokens,
        do_sample=sampling,
        temperature=decode.temperature if sampling else 1.0,
        top_p=decode.top_p,
        top_k=0,  # our loop has no top-k; 0 turns transformers' default of 50 off
        repetition_penalty=1.0,
        eos_token_id=eos,
        pad_token_id=eos[0] if eos else None,
        num_assistant_tokens=decode.gamma,
        num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=decode.stop_below,
        prompt_lookup_num_tokens=lookup_tokens if row == "hf-lookup" else None,
    )


def _timed_generate(target, ids: torch.Tensor, cfg, row: str, seed: int, cuda: bool, kwargs: dict):
    """``target.generate`` seeded and timed (wall seconds, the device drained); its errors as one DynvocabError."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    try:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **kwargs)
    except (ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DynvocabError(f"{row} failed in transformers' generate: {first}") from exc
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _to_first_eos(new: list[int], eos_ids) -> list[int]:
    """``new`` up to and including its first EOS, as our loop stops."""
    for i, tok in enumerate(new):
        if tok in eos_ids:
            return new[: i + 1]
    return new
