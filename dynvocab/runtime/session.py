"""A loaded target/draft pair and the entry point that runs one strategy on one prompt."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

from dynvocab.errors import DynvocabError
from dynvocab.models import (
    default_device,
    default_dtype,
    load_model,
    load_tokenizer,
    resolve_model,
    tokenizer_fingerprint,
)
from dynvocab.models.demo import check_demo_pair
from dynvocab.models.prepack import prepack_linears, prepack_supported
from dynvocab.models.vocab import end_token_ids
from dynvocab.runtime.decoding.loop import DecodeConfig, Decoding, Generation, check_tree_draft
from dynvocab.runtime.decoding.ngram import split_ngram
from dynvocab.runtime.drafts.draft import Proposer
from dynvocab.runtime.drafts.kinds import LoadRequest, find_kind
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.selection.base import VocabPolicy
from dynvocab.runtime.strategies import PolicyContext, StrategyOptions, lookup, make_policy
from dynvocab.runtime.trees.mode import TreeMemory
from dynvocab.runtime.trees.shape import TREE_AUTO, TREE_OFF, TREE_SUFFIX, split_tree


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


def eos_token_ids(tokenizer, model) -> set[int]:
    """EOS ids from the generation config and the tokenizer (chat models often end turns with their own)."""
    return end_token_ids(tokenizer, getattr(getattr(model, "generation_config", None), "eos_token_id", None))


class Session:
    """Target and draft loaded once; ``generate`` runs any strategy on them. ``tree_memory``: what ``--tree auto``
    learns over the session's generations (:class:`~dynvocab.runtime.trees.mode.TreeMemory`)."""

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
        self.draft: Proposer | None = None
        self.draft_weights = None
        self.draft_bytes: dict | None = None
        self.match = None
        self.tree_memory = TreeMemory()
        draft_fp = None
        if draft_spec is not None:
            kind, found = find_kind(draft_spec)
            say(f"loading {kind.label} {cfg.draft}")
            loaded = kind.load(LoadRequest(
                cfg.draft, draft_spec, found, target_model, self.target, self.tokenizer, self.device, self.dtype,
                self.prepacked, cfg.draft_weights, say,
            ))
            self.draft, self.draft_weights, self.draft_bytes = loaded.proposer, loaded.weights, loaded.bytes
            self.match, draft_fp = loaded.match, loaded.fingerprint
        self.bundle = None
        if bundle is not None:
            from dynvocab.artifacts import ModelFingerprint, load_bundle

            say(f"loading bundle {bundle}")
            self.bundle = load_bundle(bundle)
            target_fp = ModelFingerprint.of_model(self.tokenizer, target_model, cfg.target)
            self.bundle.check_models(target_fp, None if draft_fp is None else draft_fp())

    def _wants_prepack(self, wanted: bool | None) -> bool:
        supported = prepack_supported(self.device, self.dtype)
        if wanted and not supported:
            raise DynvocabError("--prepack needs float32 on a CPU whose torch has oneDNN; drop --prepack")
        return supported and wanted is not False

    @functools.cached_property
    def tokenizer_sha256(self) -> str:
        """Fingerprint of the shared tokenizer (selects the embedded demo ranking when it fits)."""
        return tokenizer_fingerprint(self.tokenizer)

    def policy_context(self) -> PolicyContext:
        """What a policy may read from this session (models, EOS ids, bundle, tokenizer fingerprint)."""
        info = None if self.draft is None else self.draft.info
        return PolicyContext(
            vocab_size=self.target.vocab_size if info is None else info.vocab_size, eos_ids=self.eos_ids,
            device=self.target.device if info is None else info.device, bundle=self.bundle, draft=info,
            target=self.target, tokenizer_sha256=self.tokenizer_sha256,
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

    def decoding(
        self,
        prompt_ids: list[int],
        strategy: str,
        decode: DecodeConfig,
        options: StrategyOptions = StrategyOptions(),
        wrap_policy: Callable[[VocabPolicy], VocabPolicy] | None = None,
        timing: bool = False,
    ) -> Decoding:
        """``strategy`` on ``prompt_ids`` as a :class:`~dynvocab.runtime.decoding.loop.Decoding`: each ``next`` runs
        one cycle and returns the token ids it committed; the output is the target's own (greedy: token for token).
        ``X+ngram`` runs strategy ``X`` with n-gram lookup first in each cycle
        (:mod:`dynvocab.runtime.decoding.ngram`); ``X@tree`` runs it drafting a tree of ``decode.tree`` (``auto``
        where that is ``off``); ``X@auto``, ``X@DxKxN`` that tree.

        ``wrap_policy`` may wrap the strategy's policy (bench records active sets this way); the wrapper's
        ``close()``, if any, runs when the decoding ends or is closed, as the policy's own does. ``timing``: measure
        the loop's sections too (bench does).
        """
        if not prompt_ids:
            raise DynvocabError("the prompt is empty; pass some text")
        if self.draft is None and lookup(strategy).drafts:
            raise DynvocabError(f"strategy '{strategy}' needs a draft model; pass --draft")
        strategy, tree = split_tree(strategy)
        if tree is not None:
            asked = decode.tree if decode.tree != TREE_OFF else TREE_AUTO
            decode = replace(decode, tree=asked if tree == TREE_SUFFIX[1:] else tree)
        if split_ngram(strategy)[1]:
            decode = replace(decode, ngram=True)
        if decode.tree != TREE_OFF and self.draft is not None and lookup(strategy).drafts:
            check_tree_draft(self.draft)
        policy = make_policy(strategy, options, self.policy_context())
        if policy is None:  # the strategy decodes with the target alone (``ar``; ``ar+ngram`` speculates by lookup)
            return Decoding(self.target, prompt_ids, decode, self.eos_ids, timing=timing)
        if wrap_policy is not None:
            policy = wrap_policy(policy)
        return Decoding(self.target, prompt_ids, decode, self.eos_ids, self.draft, policy, timing, on_end=policy.close,
                        memory=self.tree_memory)

    def generate(
        self,
        prompt_ids: list[int],
        strategy: str,
        decode: DecodeConfig,
        options: StrategyOptions = StrategyOptions(),
        wrap_policy: Callable[[VocabPolicy], VocabPolicy] | None = None,
        timing: bool = False,
    ) -> Generation:
        """:meth:`decoding` run to the end: the whole generation."""
        return self.decoding(prompt_ids, strategy, decode, options, wrap_policy, timing).run()
