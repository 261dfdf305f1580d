"""The plugin's head: the draft folder's selector applied to vLLM's own head rows, per row of vLLM's batch.

The selection maths is dynvocab's (:mod:`dynvocab.runtime.selection.batch_select`); this module only maps vLLM's
objects onto it: the draft folder (``speculative_config.draft_model_config.model``) and its ``config.json`` section,
the head's weight (``lm_head.weight``, rows padded past the vocabulary), the logits processor's scale and soft cap,
and EAGLE-3's draft-to-target id map (``draft_id_to_target_id``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dynvocab.artifacts.bundle import load_bundle
from dynvocab.errors import DynvocabError
from dynvocab.models.eagle.config import head_rows
from dynvocab.runtime.batched import SelectorSpec, build_selector, refusal
from dynvocab.runtime.decoding.ngram import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, NgramLookup
from dynvocab.runtime.heads.selected_head import SelectedHead, scatter_logits
from dynvocab.runtime.selection.batch_select import BatchSelector
from dynvocab.serving.vllm import NO_HOOK, ON_RUNNER_V2, proposal
from dynvocab.serving.vllm.contract import runs_model_runner_v2
from dynvocab.serving.vllm.kinds import kind_of_method
from dynvocab.serving.vllm.names import CONFIG_KEY, POLICY_FILE


class DraftHeadPolicy:
    """A selected head for one vLLM draft: ``select_and_score`` per row, ``scatter`` and ``top_tokens`` views.

    At tensor_parallel_size > 1 the head is vLLM's vocab-parallel ``ParallelLMHead``: each rank holds a shard of the
    rows (``lm_head.shard_indices``), computes the same set from the replicated hidden state, and scores only its
    shard's ids (``-inf`` for the others). ``top_tokens`` then reduces through vLLM's own local-argmax exchange
    (``LogitsProcessor.get_top_tokens``: a (value, id) pair per row crosses ranks); ``scatter`` fills each rank's
    shard of a full row and gathers the shards as vLLM's ``LogitsProcessor`` does."""

    def __init__(self, selector: BatchSelector, vocab: int, strategy: str, lookup: NgramLookup | None = None):
        """``vocab``: the width of the rows ``compute_logits`` returns (the target's vocabulary); ``lookup``: a
        ``+ngram`` strategy's lookup, which drafts first where a request's own tokens match."""
        self.head = SelectedHead(selector, pack=engine_linear)
        self.vocab = vocab
        self.strategy = strategy
        self.lookup = lookup

    @property
    def selector(self) -> BatchSelector:
        """The batched selector (``hidden [T, d] -> ids [T, k]``, or a context selector)."""
        return self.head.selector

    @property
    def reads_context(self) -> bool:
        """Whether the selector reads the request's context (draft position, fed token, window)."""
        return bool(getattr(self.head.selector, "reads_context", False))

    @property
    def follows_requests(self) -> bool:
        """Whether the draft's passes are recorded: the selector reads the request's context, or a lookup reads
        its tokens."""
        return self.reads_context or self.lookup is not None

    def prepare(self, weight: torch.Tensor) -> None:
        """Build what the selector lays over the head's rows ``weight`` (hybrid's per-step search index), ahead of
        the first draft step."""
        prepare = getattr(self.head.selector, "prepare", None)
        if prepare is not None:
            prepare(weight)

    def select_and_score(self, hidden: torch.Tensor, lm_head, logits_processor,
                         to_target: torch.Tensor | None = None, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [T, k], ids [T, k])``: each row's logits over its set, as vLLM's logits processor would give
        them at those ids (scale, soft cap; ``-inf`` at ids of another rank's shard), and the ids in the target's
        vocabulary (``to_target`` [V_d]: EAGLE-3's ``draft_id + d2t[draft_id]``); ``ctx``: the draft step's context,
        for a context selector."""
        tp = getattr(lm_head, "tp_size", 1)
        if tp > 1:
            if to_target is not None:
                raise DynvocabError("an EAGLE-3 head with a draft vocabulary (d2t) runs the plugin's sets at "
                                    "tensor_parallel_size 1 only")
            shard = lm_head.shard_indices
            logits, ids = self.head.select_and_score(hidden, lm_head.weight, shard.org_vocab_start_index,
                                                     shard.org_vocab_end_index, ctx)
        else:
            if self.head.whole is None:
                self.head.whole = engine_head(lm_head)
            logits, ids = self.head.select_and_score(hidden, lm_head.weight, ctx=ctx)
        cap = getattr(logits_processor, "soft_cap", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        scale = getattr(logits_processor, "scale", 1.0)
        if scale != 1.0:
            logits = logits * scale
        if to_target is not None:
            ids = ids + to_target[ids]
        return logits, ids

    def scatter(self, logits: torch.Tensor, ids: torch.Tensor, lm_head, logits_processor) -> torch.Tensor | None:
        """Full rows [T, vocab]: ``logits`` at ``ids``, ``-inf`` elsewhere (q = 0 outside the set). At
        tensor_parallel_size > 1, each rank fills its shard and the shards are gathered as vLLM gathers logits
        (None on ranks that a gather leaves without them, as vLLM's ``compute_logits`` returns)."""
        if getattr(lm_head, "tp_size", 1) == 1:
            return scatter_logits(logits, ids, self.vocab)
        shard = lm_head.shard_indices
        start, end = shard.org_vocab_start_index, shard.org_vocab_end_index
        rows = lm_head.weight.shape[0]  # the shard's rows, padding included
        local = _scatter_inside(logits, ids, (ids >= start) & (ids < end), start, rows)
        full = logits_processor._gather_logits(local)
        return None if full is None else full[..., : self.vocab]

    @staticmethod
    def top_tokens(logits: torch.Tensor, ids: torch.Tensor, lm_head=None) -> torch.Tensor:
        """The argmax id [T] of each row over its set, without a full row; at tensor_parallel_size > 1 each rank's
        (value, id) pair is exchanged as vLLM's local-argmax reduction does, 2 floats per row and rank."""
        values, best = logits.max(dim=-1, keepdim=True)  # [T, 1]
        local = ids.gather(1, best)[:, 0]
        tp = getattr(lm_head, "tp_size", 1) if lm_head is not None else 1
        if tp == 1:
            return local
        from vllm.distributed import tensor_model_parallel_all_gather

        pair = torch.stack([values[:, 0].float(), local.float()], dim=-1)  # [T, 2]
        gathered = tensor_model_parallel_all_gather(pair, dim=-1).view(logits.shape[0], tp, 2)
        rank = gathered[:, :, 0].argmax(dim=-1, keepdim=True)
        return gathered[:, :, 1].gather(1, rank)[:, 0].to(torch.int64)


def _scatter_inside(logits: torch.Tensor, ids: torch.Tensor, inside: torch.Tensor, start: int,
                    rows: int) -> torch.Tensor:
    """A shard's row [T, rows] of ``-inf`` holding the ``logits`` of its own ``ids`` (``inside``) at ``id - start``;
    ids of other shards fall on column 0 as ``-inf``, which a max leaves as it was."""
    local = torch.where(inside, ids - start, 0)
    out = torch.full((logits.shape[0], rows), float("-inf"), dtype=logits.dtype, device=logits.device)
    return out.scatter_reduce_(1, local, logits.masked_fill(~inside, float("-inf")), "amax")


def engine_linear(rows: torch.Tensor):
    """``x -> x @ rows.T`` through the GEMM vLLM's own layers use on this platform: on a CPU its oneDNN handle on
    prepacked rows (``model_executor/layers/utils.py:dispatch_cpu_unquantized_gemm``, what its full head runs; a
    32k-row bfloat16 ``F.linear`` took ~4× the whole 151,936-row head there), elsewhere ``F.linear``."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return lambda x: torch.nn.functional.linear(x, rows)
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(rows.contiguous(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
    return lambda x: holder.cpu_linear(x, holder.weight, None)


def engine_head(lm_head):
    """``x -> x @ weight.T`` over all of ``lm_head``'s rows (padding included) through vLLM's own head GEMM (its
    quant method's ``apply``: on a CPU the oneDNN handle packed at load), the cost of vLLM's full head."""
    return lambda x: lm_head.quant_method.apply(lm_head, x)


def draft_section(hf_config) -> dict:
    """The folder's ``dynvocab`` section from the draft's config (vLLM keeps unknown keys as attributes)."""
    section = getattr(hf_config, CONFIG_KEY, None)
    if not isinstance(section, dict) or "strategy" not in section:
        raise DynvocabError(
            f"the draft's config.json has no '{CONFIG_KEY}' section; make the folder with "
            "`dynvocab export BUNDLE --format vllm --strategy S --draft D --out DIR`"
        )
    return section


def load_policy(vllm_config) -> DraftHeadPolicy:
    """The selected head of the draft vLLM is building: its folder's section and policy file, checked against the
    draft's config; every mismatch is one line. A strategy that follows requests is refused where the proposal hook
    is absent, and where the engine runs Model Runner V2 (whose proposals never pass the hook)."""
    spec_config = vllm_config.speculative_config
    model_config = spec_config.draft_model_config if spec_config is not None else vllm_config.model_config
    hf_config = model_config.hf_config
    section = draft_section(hf_config)
    kind = kind_of_method(getattr(spec_config, "method", None))
    why = refusal(section["strategy"], kind.name if kind is not None else None)
    if why:
        raise DynvocabError(why)
    path = Path(model_config.model) / section.get("policy_file", POLICY_FILE)
    if not path.is_file():
        raise DynvocabError(f"{path} is missing; make the folder again with `dynvocab export --format vllm`")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    bundle = load_bundle(path, verify=True)
    try:
        spec = SelectorSpec(section["strategy"], section.get("budget"),
                            int(section.get("ngram_max", DEFAULT_NGRAM_MAX)),
                            int(section.get("ngram_min", DEFAULT_NGRAM_MIN)))
        policy = policy_from_bundle(bundle, spec, text, vllm_config.device_config.device)
    finally:
        bundle.close()
    if policy.follows_requests and not proposal.installed():
        raise DynvocabError(NO_HOOK.format(f"{proposal.RUNNER}.{proposal.ENTRY}") + f" ({spec.strategy} is one)")
    if policy.follows_requests and runs_model_runner_v2(vllm_config):  # the hook is on a runner this engine lacks
        raise DynvocabError(ON_RUNNER_V2.format(spec.strategy))
    return policy


def policy_from_bundle(bundle, spec: SelectorSpec, text_config, device) -> DraftHeadPolicy:
    """The selected head of ``spec`` from ``bundle`` for a draft whose (text) config is ``text_config``: the
    selector over the head's rows (:func:`~dynvocab.models.eagle.config.head_rows`), rows as wide as the target's
    vocabulary, and a ``+ngram`` strategy's lookup."""
    selector = build_selector(bundle, spec, head_rows(text_config), int(text_config.hidden_size), device)
    return DraftHeadPolicy(selector, int(text_config.vocab_size), spec.strategy, spec.lookup)
