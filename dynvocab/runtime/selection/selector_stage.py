"""A bundle's trained selector stage (``lowrank``, ``centroids``) as the selector policies read it: checked against
the draft in one line, and prepared once per session (:mod:`.lowrank`, :mod:`.centroids`)."""

from __future__ import annotations

from dynvocab.artifacts.selectors import SelectorTable
from dynvocab.errors import DynvocabError

_PREPARED: dict = {}  # (id(bundle), kind, vocab_size, device) -> (bundle, prepared): built once per session


def prepared(ctx, kind: str, build):
    """``build(table)`` for the bundle's selector ``kind``, made once per bundle, vocabulary and device and kept:
    each prompt's policy then starts from the same scorer and order (quantized and packed once; the head keeps the
    rows of the same order)."""
    key = (id(ctx.bundle), kind, ctx.vocab_size, str(ctx.device))
    hit = _PREPARED.get(key)
    if hit is None or hit[0] is not ctx.bundle:
        hit = _PREPARED[key] = (ctx.bundle, build(selector_table(ctx, kind)))
    return hit[1]


def selector_table(ctx, kind: str) -> SelectorTable:
    """The bundle's selector stage ``kind``, checked against the draft (hidden size) in one line."""
    if ctx.draft is None:
        raise DynvocabError(f"strategy '{kind}' needs a draft model; pass --draft")
    table = SelectorTable.from_bundle(ctx.bundle, kind)
    hidden = ctx.draft.hidden_size
    if int(table.config["hidden_dim"]) != hidden:
        raise DynvocabError(
            f"the {kind} selector in {ctx.bundle.path} reads hidden size {table.config['hidden_dim']}, the draft has "
            f"{hidden}; retrain it with `dynvocab train-router --selector {kind} --bundle {ctx.bundle.path} --draft …`"
        )
    return table
