"""``dynvocab generate``: run one strategy on one prompt."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated

import typer

from dynvocab.cli.common import (
    Draft,
    LoadFlags,
    MaxNew,
    StrategyFlags,
    Target,
    err_console,
    one_line_errors,
    status_printer,
    with_strategy_flags,
)
from dynvocab.errors import DynvocabError, Interrupted
from dynvocab.runtime.strategies import check_bundle_stages, check_strategy, lookup, strategy_names
from dynvocab.runtime.trees.shape import asks_for_trees


@one_line_errors
@with_strategy_flags
def generate(
    prompt: Annotated[str, typer.Argument(help="The user message (the chat template is applied unless --no-chat-template).")],
    target: Target = "demo:target",
    draft: Draft = "demo:draft",
    strategy: Annotated[str, typer.Option(help=f"One of: {', '.join(strategy_names())}; X+ngram also drafts what followed the text's "
                                                   "latest suffix earlier in the request (ar+ngram: that alone).")] = "full",
    max_new_tokens: MaxNew = 128,
    flags: StrategyFlags = StrategyFlags(),
    load: LoadFlags = LoadFlags(),
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template", help="Encode the prompt as plain text.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (text, token_ids, strategy, metrics) as the last line.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No loading messages.")] = False,
) -> None:
    """Generate a reply with speculative decoding.

    Greedy: each token is the argmax of the target's own verification pass.
    Sampling (--temperature > 0): exact rejection sampling from the target.
    Equality with `ar` is measured, not guaranteed (bench's `= ar` column): a multi-position pass may round apart.
    """
    from dynvocab import api

    if not prompt.strip():
        raise DynvocabError("the prompt is empty; pass some text")
    check_strategy(strategy)
    load.check()
    flags.check()
    check_bundle_stages([strategy], flags.bundle)
    if lookup(strategy).drafts and asks_for_trees(flags.tree, [strategy]):
        from dynvocab.models.loading import resolve_model
        from dynvocab.runtime.drafts.registry import check_tree_kind

        check_tree_kind(resolve_model(draft))  # before anything loads
    pair = api.load(
        target, draft if lookup(strategy).drafts else None, flags.bundle, load.device, load.dtype, load.draft_weights,
        load.prepack, load.threads, status_printer(quiet),
    )
    shown, reply = api.TextStream(pair.tokenizer), None
    try:
        reply = pair.start(
            prompt, strategy, chat_template=not no_chat_template, options=flags.options(), timing=json_out,
            **dataclasses.asdict(flags.decode(max_new_tokens)),
        )
        for new in reply:
            if not json_out:  # the JSON line carries the text: no decoding between cycles
                _write(shown.push(new))
    except KeyboardInterrupt:
        raise _interrupted(reply, strategy, shown, json_out) from None
    result, session = reply.result, pair.session
    m = result.metrics
    looked = (f" · lookup drafted {m.lookup_cycles} of {m.cycles} cycles, {m.lookup_accepted}/{m.lookup_drafted} "
              "tokens accepted") if m.lookup_cycles else ""
    tree = (f" · tree {m.tree}: {m.tree_tokens / max(m.tree_cycles, 1):.1f} tokens verified a cycle, "
            f"{m.off_main} accepted off the main path") if m.tree_cycles else ""
    summary = (
        f"[{strategy}] {m.new_tokens} tokens in {m.wall_s:.2f}s · {m.tokens_per_s:.2f} tokens/s · "
        f"mean accepted length {m.mean_accepted_length:.2f}{looked}{tree} · {session.dtype} on {session.device}"
    )
    if m.tree_auto:
        summary += f"\n{m.tree_auto['why']} (median N {m.tree_auto['median_tokens']}, depth {m.tree_auto['median_depth']})"
    if json_out:
        err_console.print(summary, highlight=False)
        print(json.dumps(result.as_dict(), ensure_ascii=False))
    else:
        sys.stdout.write(shown.tail(result.text, final=True) + "\n")
        print(summary)


def _write(piece: str) -> None:
    """Print a piece of the streamed reply as it comes."""
    if piece:
        sys.stdout.write(piece)
        sys.stdout.flush()


def _interrupted(reply, strategy: str, shown, json_out: bool) -> Interrupted:
    """After a Ctrl-C: close the reply (the tokens committed so far are its result), print the rest of their text
    or their JSON marked ``interrupted``; the error to raise."""
    ids, text = [], ""
    if reply is not None:
        reply.close()
        partial = reply.result
        ids, text = partial.token_ids, partial.text
    if json_out:
        partial_json = {"text": text, "token_ids": ids, "strategy": strategy, "interrupted": True}
        print(json.dumps(partial_json, ensure_ascii=False))
    else:
        sys.stdout.write(shown.tail(text, final=True) + "\n")
    return Interrupted(f"interrupted after {len(ids)} new tokens")
