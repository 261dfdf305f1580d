"""A loaded target/draft pair and the entry point that runs one strategy on one prompt."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from dynvocab.errors import DynvocabError
from dynvocab.models import (
    default_device,
    default_dtype,
    load_model,
    load_tokenizer,
    match_vocabularies,
    parse_dtype,
    resolve_model,
    tokenizer_fingerprint,
)
from dynvocab.models.demo import check_demo_pair
from dynvocab.models.eagle import eagle_checkpoint
from dynvocab.models.prepack import (
    INT8,
    default_draft_weights,
    int8_supported,
    prepack_linears,
    prepack_supported,
    quantize_linears,
    step_weight_bytes,
)
from dynvocab.models.vocab import end_token_ids
from dynvocab.runtime.draft import Draft
from dynvocab.runtime.lm import CausalLM
from dynvocab.runtime.loop import DecodeConfig, Generation, speculative_generate
from dynvocab.runtime.policies.base import VocabPolicy
from dynvocab.runtime.strategies import PolicyContext, StrategyOptions, make_policy


@dataclass(frozen=True)
class ModelConfig:
    """Which models to load and how; ``None`` device/dtype pick the defaults for the machine.

    ``prepack``: give the target's and the draft's linears a oneDNN-packed weight copy for their few-row passes
    (verification; the draft catching up on accepted tokens); ``None`` does it where it is supported (float32 on
    CPU). ``draft_weights``: what the draft's steps read — ``"int8"`` (int8 copies of its linears and head rows with
    per-row scales, every pass; a CPU with fbgemm) or a dtype (a copy in that dtype for its one-token steps; equal
    to ``dtype``: no copy). The draft only proposes, so this never changes the output. ``None``: the default by
    measurement (docs/bench.md): int8 on a CPU with fbgemm, whatever ``dtype`` (AVX2 and AVX-512 BF16 measured),
    else ``dtype``. See
    :mod:`dynvocab.models.prepack`.
    """

    target: str = "demo:target"
    draft: str = "demo:draft"
    device: str | None = None
    dtype: str | None = None
    prepack: bool | None = None
    draft_weights: str | None = None


def draft_bytes(model, extra: int = 0) -> dict:
    """What the draft holds in memory: ``weights`` (its own parameters; an EAGLE-1 head's shared embeddings
    included), ``prepared`` (the copies its steps read: int8 rows and packs, one-row dtype copies, oneDNN packs,
    plus ``extra``), and ``total``."""
    seen, weights = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    prepared = step_weight_bytes(model) + extra
    return {"weights": weights, "prepared": prepared, "total": weights + prepared}


def eos_token_ids(tokenizer, model) -> set[int]:
    """EOS ids from the generation config and the tokenizer (chat models often end turns with their own)."""
    return end_token_ids(tokenizer, getattr(getattr(model, "generation_config", None), "eos_token_id", None))


class Session:
    """Target and draft loaded once; ``generate`` runs any strategy on them."""

    def __init__(
        self,
        cfg: ModelConfig,
        need_draft: bool = True,
        status: Callable[[str], None] | None = None,
        bundle: str | None = None,
    ):
        say = status or (lambda msg: None)
        self.device = cfg.device or default_device()
        self.dtype = cfg.dtype or default_dtype(self.device)
        if need_draft:
            check_demo_pair(cfg.target, cfg.draft)
        target_spec = resolve_model(cfg.target)
        draft_spec = resolve_model(cfg.draft) if need_draft else None
        self.prepacked = self._wants_prepack(cfg.prepack)  # refused before anything is loaded
        say(f"loading target {cfg.target}")
        self.tokenizer = load_tokenizer(target_spec)
        target_model = load_model(target_spec, self.device, self.dtype)
        if self.prepacked:
            prepack_linears(target_model)
        self.target = CausalLM(target_model)
        self.context_length: int | None = getattr(target_model.config, "max_position_embeddings", None)
        self.eos_ids = eos_token_ids(self.tokenizer, target_model)
        self.draft: Draft | None = None
        self.draft_weights = None
        self.draft_bytes: dict | None = None
        self.match = None
        eagle = None if draft_spec is None else eagle_checkpoint(draft_spec)
        if eagle is not None:
            say(f"loading EAGLE head {cfg.draft}")
            self._load_eagle(eagle, target_model, cfg.draft_weights)
            draft_spec = None  # no draft model (and no draft fingerprint for a bundle)
        if draft_spec is not None:
            say(f"loading draft {cfg.draft}")
            draft_tokenizer = load_tokenizer(draft_spec)
            draft_model = load_model(draft_spec, self.device, self.dtype)
            rows_t = target_model.get_output_embeddings().weight.shape[0]
            rows_d = draft_model.get_output_embeddings().weight.shape[0]
            self.match = match_vocabularies(self.tokenizer, draft_tokenizer, rows_t, rows_d)
            self.draft_weights = self._prepare_draft_steps(
                draft_model, cfg.draft_weights, draft_model.get_output_embeddings()
            )
            self.draft = CausalLM(draft_model, vocab_rows=self.match.shared, one_token_steps=True)
            self.draft_bytes = draft_bytes(draft_model, self.draft.fused_bytes)
        self.bundle = None
        if bundle is not None:
            from dynvocab.artifacts import ModelFingerprint, load_bundle

            say(f"loading bundle {bundle}")
            self.bundle = load_bundle(bundle)
            target_fp = ModelFingerprint.of_model(self.tokenizer, target_model, cfg.target)
            draft_fp = None if draft_spec is None else ModelFingerprint.of_model(draft_tokenizer, draft_model, cfg.draft)
            self.bundle.check_models(target_fp, draft_fp)

    def _load_eagle(self, folder, target_model, weights: str | None) -> None:
        """Load an EAGLE head for the target (refused in one line if it was built for another) as the draft; its
        linears get the draft's prepared copies, and its LM head rows the step dtype."""
        from dynvocab.models.eagle import EAGLE1, LayerTap, check_target, load_eagle, read_config
        from dynvocab.runtime.eagle_draft import EagleDraft

        config = target_model.config.get_text_config()
        embeddings = target_model.get_input_embeddings().weight.detach()  # [V, d]
        eagle_cfg = read_config(folder)
        check_target(eagle_cfg, config.hidden_size, embeddings.shape[0], config.num_hidden_layers)
        model = load_eagle(folder, embeddings, self.device, parse_dtype(self.dtype)).pair_with(target_model)
        tap = None if eagle_cfg.kind == EAGLE1 else LayerTap(target_model, eagle_cfg.target_layers(config.num_hidden_layers))
        self.draft_weights = self._prepare_draft_steps(model, weights, getattr(model, "lm_head", None))
        step = INT8 if self.draft_weights == INT8 else parse_dtype(self.draft_weights)
        self.draft = EagleDraft(model, self.target, tap, step)
        own_rows = self.draft.step_rows[0]  # EAGLE-1's int8 copy of the target's head is the draft's own
        extra = getattr(own_rows, "nbytes", 0) if eagle_cfg.kind == EAGLE1 else 0
        self.draft_bytes = draft_bytes(model, extra)

    def _wants_prepack(self, wanted: bool | None) -> bool:
        supported = prepack_supported(self.device, self.dtype)
        if wanted and not supported:
            raise DynvocabError("--prepack needs float32 on a CPU whose torch has oneDNN; drop --prepack")
        return supported and wanted is not False

    def _prepare_draft_steps(self, model, weights: str | None, head) -> str:
        """Give the draft's linears (body and head, so ``hf-assisted`` steps the same way) their prepared copies:
        int8 (``head`` keeps its int8 rows for gathering), or a one-row copy in a dtype; returns the draft-weights
        value in force."""
        if weights is None:
            weights = default_draft_weights(self.device, self.dtype)
        if weights == INT8:
            if not int8_supported(self.device):
                raise DynvocabError("--draft-weights int8 needs a CPU whose torch has fbgemm; pass --draft-weights bfloat16")
            quantize_linears(model, head)
            return weights
        step_dtype = weights
        row_dtype = None if step_dtype == self.dtype else parse_dtype(step_dtype)
        if self.prepacked or row_dtype is not None:
            prepack_linears(model, packed=self.prepacked, row_dtype=row_dtype)
        return step_dtype

    @functools.cached_property
    def tokenizer_sha256(self) -> str:
        """Fingerprint of the shared tokenizer (selects the embedded demo ranking when it fits)."""
        return tokenizer_fingerprint(self.tokenizer)

    def policy_context(self) -> PolicyContext:
        """What a policy may read from this session (models, EOS ids, bundle, tokenizer fingerprint)."""
        return PolicyContext(
            vocab_size=self.draft.vocab_size, eos_ids=self.eos_ids, device=self.draft.device, bundle=self.bundle,
            draft=self.draft, target=self.target, tokenizer_sha256=self.tokenizer_sha256,
        )

    def check_fits(self, prompt_tokens: int, max_new_tokens: int, where: str = "the prompt") -> None:
        """Refuse a prompt that, with ``max_new_tokens`` after it, would not fit in the target's context."""
        if self.context_length is None:
            return
        if prompt_tokens >= self.context_length:
            raise DynvocabError(
                f"{where} is {prompt_tokens:,} tokens, longer than the target's context of {self.context_length:,}; "
                "shorten it"
            )
        if prompt_tokens + max_new_tokens > self.context_length:
            room = self.context_length - prompt_tokens
            raise DynvocabError(
                f"{where} is {prompt_tokens:,} tokens and leaves room for {room:,} new tokens in the target's "
                f"context of {self.context_length:,}; pass --max-new-tokens {room} or less, or shorten it"
            )

    def generate(
        self,
        prompt_ids: list[int],
        strategy: str,
        decode: DecodeConfig,
        options: StrategyOptions = StrategyOptions(),
        on_tokens: Callable[[list[int]], None] | None = None,
        wrap_policy: Callable[[VocabPolicy], VocabPolicy] | None = None,
        timing: bool = False,
    ) -> Generation:
        """Run ``strategy`` on ``prompt_ids``; the output is the target's own (greedy: token for token).

        ``wrap_policy`` may wrap the strategy's policy (bench records active sets this way); the wrapper's
        ``close()``, if any, runs after the generation, as the policy's own does. ``timing``: measure the loop's
        sections too (bench does; see :func:`~dynvocab.runtime.loop.speculative_generate`).
        """
        if not prompt_ids:
            raise DynvocabError("the prompt is empty; pass some text")
        if strategy == "ar":
            return speculative_generate(
                self.target, prompt_ids, decode, self.eos_ids, on_tokens=on_tokens, timing=timing
            )
        if self.draft is None:
            raise DynvocabError(f"strategy '{strategy}' needs a draft model; pass --draft")
        policy = make_policy(strategy, options, self.policy_context())
        if wrap_policy is not None:
            policy = wrap_policy(policy)
        try:
            return speculative_generate(
                self.target, prompt_ids, decode, self.eos_ids, self.draft, policy, on_tokens=on_tokens, timing=timing
            )
        finally:
            if policy is not None:
                policy.close()
