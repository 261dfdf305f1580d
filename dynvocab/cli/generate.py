"""``dynvocab generate``: run one strategy on one prompt."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from dynvocab.cli.common import (
    BundleOpt,
    KMax,
    OnlineAlign,
    CoreSize,
    HybridWindow,
    StepNeighbours,
    Threads,
    Device,
    Draft,
    DraftStepDtype,
    Dtype,
    Prepack,
    StopBelow,
    FrSize,
    BranchBelow,
    Gamma,
    MaxNew,
    KPre,
    KVer,
    PaKMax,
    Window,
    Target,
    TokenMap,
    check_dtype_device,
    err_console,
    one_line_errors,
    set_threads,
    strategy_options,
    status_printer,
)
from dynvocab.errors import DynvocabError
from dynvocab.runtime.loop import DEFAULT_BRANCH_BELOW, DEFAULT_GAMMA, DEFAULT_STOP_BELOW, DecodeConfig
from dynvocab.runtime.policies.dynaspec import DynaSpecConfig
from dynvocab.runtime.policies.hybrid import HybridConfig
from dynvocab.runtime.policies.microspec import MicroSpecConfig
from dynvocab.runtime.prompts import encode_prompt
from dynvocab.runtime.strategies import AVAILABLE, check_strategy


@one_line_errors
def generate(
    prompt: Annotated[str, typer.Argument(help="The user message (the chat template is applied unless --no-chat-template).")],
    target: Target = "demo:target",
    draft: Draft = "demo:draft",
    strategy: Annotated[str, typer.Option(help=f"One of: {', '.join(AVAILABLE)}.")] = "full",
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy; > 0 samples (exact rejection sampling).")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0, help="Nucleus sampling threshold, applied to target and draft alike.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Random seed for sampling.")] = 0,
    max_new_tokens: MaxNew = 128,
    gamma: Gamma = DEFAULT_GAMMA,
    stop_below: StopBelow = DEFAULT_STOP_BELOW,
    branch_below: BranchBelow = DEFAULT_BRANCH_BELOW,
    token_map: TokenMap = None,
    fr_size: FrSize = None,
    pa_k_max: PaKMax = None,
    k_pre: KPre = MicroSpecConfig.k_pre,
    k_ver: KVer = MicroSpecConfig.k_ver,
    window: Window = MicroSpecConfig.window,
    core_size: CoreSize = HybridConfig.core_size,
    hybrid_window: HybridWindow = HybridConfig.window,
    step_neighbours: StepNeighbours = HybridConfig.step_neighbours,
    k_max: KMax = DynaSpecConfig.k_max,
    online_align: OnlineAlign = False,
    bundle: BundleOpt = None,
    device: Device = None,
    dtype: Dtype = None,
    draft_step_dtype: DraftStepDtype = None,
    prepack: Prepack = None,
    threads: Threads = None,
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template", help="Encode the prompt as plain text.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (text, token_ids, strategy, metrics) as the last line.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No loading messages.")] = False,
) -> None:
    """Generate a reply with speculative decoding.

    Greedy: each token is the argmax of the target's own verification pass.
    Sampling (--temperature > 0): exact rejection sampling from the target.
    Equality with `ar` is measured, not guaranteed (bench's `= ar` column): a multi-position pass may round apart.
    """
    from dynvocab.runtime.session import ModelConfig, Session

    if not prompt.strip():
        raise DynvocabError("the prompt is empty; pass some text")
    check_strategy(strategy)
    check_dtype_device(device, dtype, draft_step_dtype)
    if top_p <= 0.0:
        raise DynvocabError("--top-p must be in (0, 1]")
    options = strategy_options(
        token_map, fr_size, pa_k_max, k_pre, k_ver, window, core_size, hybrid_window, step_neighbours, k_max,
        online_align,
    )
    set_threads(threads)
    session = Session(
        ModelConfig(target, draft, device, dtype, prepack=prepack, draft_step_dtype=draft_step_dtype),
        need_draft=strategy != "ar",
        status=status_printer(quiet),
        bundle=bundle,
    )
    prompt_ids = encode_prompt(session.tokenizer, [{"role": "user", "content": prompt}], not no_chat_template)
    decode = DecodeConfig(
        gamma=gamma, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
        stop_below=stop_below, branch_below=branch_below,
    )

    shown: list[int] = []
    printed = ""

    def stream(new: list[int]) -> None:
        nonlocal printed
        shown.extend(new)
        text = session.tokenizer.decode(shown, skip_special_tokens=True)
        if text.startswith(printed) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text

    result = session.generate(prompt_ids, strategy, decode, options, on_tokens=None if json_out else stream)
    text = session.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    m = result.metrics
    summary = (
        f"[{strategy}] {m.new_tokens} tokens in {m.wall_s:.2f}s · {m.tokens_per_s:.2f} tokens/s · "
        f"mean accepted length {m.mean_accepted_length:.2f} · {session.dtype} on {session.device}"
    )
    if json_out:
        err_console.print(summary, highlight=False)
        payload = {"text": text, "token_ids": result.token_ids, "strategy": strategy, "metrics": m.as_dict()}
        print(json.dumps(payload, ensure_ascii=False))
    else:
        if text.startswith(printed):
            sys.stdout.write(text[len(printed):])
        sys.stdout.write("\n")
        print(summary)
