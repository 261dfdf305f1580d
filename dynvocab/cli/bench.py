"""``dynvocab bench``: strategies side by side on the same loaded models. (The microbenchmarks it used to run
behind ``--kernels``, ``--policy-steps`` and ``--eagle-step`` are ``dynvocab microbench``'s commands.)"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dynvocab.cli.common import (
    Draft,
    LoadFlags,
    StrategyFlags,
    Target,
    check_out,
    one_line_errors,
    set_threads,
    with_strategy_flags,
)
from dynvocab.errors import DynvocabError

# Flags that turned bench into another program; refused for one version with the command that replaced them.
MOVED = {
    "kernels": ("--kernels", "microbench kernels"),
    "policy_steps": ("--policy-steps", "microbench policy-steps"),
    "eagle_step": ("--eagle-step", "microbench eagle-step"),
    "draft_kind": ("--draft-kind", "microbench policy-steps --draft-kind"),
}
MovedFlag = Annotated[bool, typer.Option(hidden=True)]


def refuse_moved(**given) -> None:
    """Refuse a flag of :data:`MOVED` that was given, naming the command that replaced it."""
    for name, value in given.items():
        if value:
            flag, command = MOVED[name]
            raise DynvocabError(f"bench {flag} moved: run `dynvocab {command}`")


def refuse_beside_vllm(given: dict) -> None:
    """Refuse, in one line, the flags of dynvocab's own rows that ``--vllm`` would otherwise ignore (flag -> its
    value, None where not given)."""
    named = [flag for flag, value in given.items() if value is not None]
    if named:
        raise DynvocabError(f"{', '.join(named)} {'does' if len(named) == 1 else 'do'} not apply to --vllm rows: vLLM "
                            "places, threads and packs the models itself, each row runs once per round, and the "
                            "table and --json are the output; drop it or run without --vllm")


@one_line_errors
@with_strategy_flags
def bench(
    prompts: Annotated[
        Optional[str],
        typer.Option(
            "--prompts",
            help="JSONL prompt file (rows: id, task, prompt or messages; or a Spec-Bench question.jsonl). "
            "Default: the embedded tasks.",
        ),
    ] = None,
    strategies: Annotated[
        Optional[str],
        typer.Option(help="Comma-separated rows: strategies (ar,full,fr,…), each also as X+ngram (n-gram lookup in the "
                          "request first; ar+ngram: lookup alone), and hf-assisted, hf-lookup. [default: ar,full]"),
    ] = None,
    ids: Annotated[Optional[str], typer.Option(help="Comma-separated prompt ids to run (default: all).")] = None,
    tasks: Annotated[
        Optional[str],
        typer.Option(help="Comma-separated tasks: code, chat, multiturn, topic-switch; shifted traffic from Debian's "
            "documentation (apt-get install debian-faq debian-faq-{de,fr,it,pt,ru,ja,zh-cn,ko}): multilingual "
            "(or multilingual:ru, …), translation (translation:en-ja, translation:ja-en, …), lang-switch, legal, "
            "code-legal; or a prompt file's tasks. [default: the first four]"),
    ] = None,
    num_prompts: Annotated[
        Optional[int], typer.Option("--num-prompts", min=1, help="Prompts per task (a shifted task: per language or direction; topic-switch: N code + N chat turns). [default: 5]")
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Small run: 1 code + 1 chat prompt, 32 tokens, ar,full,microspec,fr,hybrid and "
                           "ar+ngram,full+ngram,hybrid+ngram. On the "
                           "default models it then runs the 262k demo (Gemma-3-270M, the shipped head demo:gemma-eagle1: "
                           "2 + 2 prompts, 64 tokens); its --json/--csv/--plot files get '.gemma' before the suffix.")
    ] = False,
    target: Target = "demo:target",
    draft: Draft = "demo:draft",
    max_new_tokens: Annotated[
        Optional[int], typer.Option("--max-new-tokens", min=1, help="Stop after this many new tokens. [default: 64]")
    ] = None,
    seeds: Annotated[
        Optional[str], typer.Option(help="Comma-separated seeds (e.g. 0,1,2): every row once per seed; mean ± std over seeds.")
    ] = None,
    flags: StrategyFlags = StrategyFlags(),
    load: LoadFlags = LoadFlags(),
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template", help="Encode prompts as plain text.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the full results (generations, summary) here.")] = None,
    csv_path: Annotated[Optional[Path], typer.Option("--csv", help="Write one row per strategy × task here.")] = None,
    plot_path: Annotated[
        Optional[Path], typer.Option("--plot", help="Write a figure (tokens/s, MAL, active vocabulary vs MAL) here, e.g. bench.png.")
    ] = None,
    score_sets: Annotated[
        bool, typer.Option("--coverage", help="Also score each active set: target probability mass and Recall@k of the target's top-k.")
    ] = False,
    llamacpp: Annotated[
        Optional[Path],
        typer.Option(
            "--llamacpp",
            metavar="BIN_DIR",
            help="Also run llama.cpp on the same GGUF files and prompts: rows llama.cpp (llama-completion) and "
            "llama.cpp-spec (llama-speculative-simple, the --draft GGUF as its draft). BIN_DIR holds both "
            "binaries (scripts/build_llamacpp.sh builds them); --target/--draft must be .gguf files or demo:*.",
        ),
    ] = None,
    vllm: Annotated[
        bool,
        typer.Option("--vllm", help="Instead: run the prompts through vLLM: rows vllm, vllm-spec:ngram (vLLM's own "
                     "prompt lookup, suffixes of --ngram-min to --ngram-max tokens; 'ngram' in --strategies), vllm-spec:suffix "
                     "(vLLM's suffix decoding, with arctic-inference beside vLLM; 'suffix' in --strategies), vllm-spec (the "
                     "draft's full head) and vllm-spec:<strategy> per plugin strategy (every strategy with a batched selector: "
                     "fr, fr-pa, dynaspec, lowrank, centroids, microspec, hybrid; evospec and X+ngram with an EAGLE head) in one engine. Greedy acceptance must repeat in every round: "
                     "a row whose rounds differ ends the run non-zero, naming it."),
    ] = False,
    vllm_python: Annotated[
        Optional[str], typer.Option("--vllm-python", metavar="PATH", help="With --vllm: the python of an environment "
                                    "with vLLM (default: this one, where it imports vLLM).")
    ] = None,
    rounds: Annotated[
        Optional[int], typer.Option(min=1, help="With --vllm: interleaved rounds per row; medians reported. [default: 3]")
    ] = None,
    tensor_parallel_size: Annotated[
        int, typer.Option("--tensor-parallel-size", min=1, help="With --vllm: vLLM's tensor-parallel ranks.")
    ] = 1,
    concurrency: Annotated[
        Optional[str], typer.Option("--concurrency", metavar="N[,N…]", help="With --vllm: requests in flight, e.g. "
                                    "1,4,8 (each of N clients sends its next prompt when its last one ends); every row "
                                    "runs at each level. [default: 1]")
    ] = None,
    schedule: Annotated[
        Optional[str], typer.Option("--schedule", metavar="START:K,…|auto", help="With --vllm: every speculative row "
                                    "again with this batch-size schedule (speculative_config's "
                                    "num_speculative_tokens_per_batch_size; e.g. 1:4,4:0 = γ tokens at 1-3 requests, none "
                                    "from 4); auto picks it from this run's rows at each --concurrency level and says "
                                    "what it picked.")
    ] = None,
    kernels: MovedFlag = False,
    policy_steps: MovedFlag = False,
    eagle_step: MovedFlag = False,
    draft_kind: Annotated[Optional[str], typer.Option("--draft-kind", hidden=True)] = None,
) -> None:
    """Run every strategy on every prompt with the models loaded once; print a table, optionally write JSON/CSV/plot.

    One part of a draft step timed alone (head kernels, policy steps, a draft step): `dynvocab microbench`."""
    from dynvocab.cli.bench_run import BenchRequest, run_command
    from dynvocab.runtime.session import ModelConfig

    refuse_moved(kernels=kernels, policy_steps=policy_steps, eagle_step=eagle_step, draft_kind=draft_kind)
    load.check()
    for path, flag in ((json_path, "--json"), (csv_path, "--csv"), (plot_path, "--plot")):
        check_out(path, flag)
    flags.check()
    if not vllm and (schedule is not None or concurrency is not None):
        raise DynvocabError(f"{'--schedule' if schedule is not None else '--concurrency'} applies to --vllm rows only; "
                            "add --vllm")
    if vllm:
        from dynvocab.cli.bench_run import BenchRequest, VllmRequest, run_vllm_command

        refuse_beside_vllm({"--csv": csv_path, "--plot": plot_path, "--seeds": seeds, "--device": load.device,
                            "--draft-weights": load.draft_weights, "--prepack": load.prepack, "--threads": load.threads,
                            "--coverage": score_sets or None, "--llamacpp": llamacpp})

        request = BenchRequest(
            models=ModelConfig(target, draft, dtype=load.dtype), prompts=prompts, strategies=strategies, ids=ids,
            tasks=tasks, num_prompts=num_prompts, quick=quick, max_new_tokens=max_new_tokens,
            chat_template=not no_chat_template, json_path=json_path,
        )
        run_vllm_command(request, flags, VllmRequest(vllm_python, rounds, tensor_parallel_size, concurrency,
                                                                schedule))
        return
    set_threads(load.threads)
    llama = None
    if llamacpp is not None:
        from dynvocab.bench.engines.llamacpp import prepare

        if flags.temperature > 0:
            raise DynvocabError("--llamacpp rows decode greedily; drop --temperature")
        llama = prepare(llamacpp, target, draft)
    request = BenchRequest(
        models=ModelConfig(target, draft, load.device, load.dtype, prepack=load.prepack,
                           draft_weights=load.draft_weights),
        prompts=prompts, strategies=strategies, ids=ids, tasks=tasks, num_prompts=num_prompts, quick=quick,
        max_new_tokens=max_new_tokens, seeds=seeds, score_sets=score_sets, chat_template=not no_chat_template,
        json_path=json_path, csv_path=csv_path, plot_path=plot_path, llamacpp=llama,
    )
    if quick:
        from dynvocab.cli.bench_run import run_quick

        run_quick(request, flags)
        return
    run_command(request, flags)
