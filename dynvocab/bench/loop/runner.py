"""Run several strategies over several prompts on one loaded session; results as data.

Rows are our strategies (through the one speculative loop) and transformers' own decoders (``hf-assisted``,
``hf-lookup``, see :mod:`dynvocab.bench.engines.hf`), all on the same loaded models and timed the same way; with
``--llamacpp``, llama.cpp's plain and speculative decoding on the same GGUF files and prompt ids (``llama.cpp``,
``llama.cpp-spec``, see :mod:`dynvocab.bench.engines.llamacpp`), compared with ``ar`` by their text.
Replayed conversations (multiturn, topic-switch) feed an answer back before each next user turn: ``ar``'s
answer when ``ar`` is in the run (so every row sees the same context), else each row's own.

Each draft step's active set is recorded by :class:`dynvocab.bench.loop.recorder.PolicyRecorder`; the results are
aggregated by :mod:`dynvocab.bench.loop.summary`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from dynvocab.bench import stability
from dynvocab.bench.engines.hf import HF_ROWS, LOOKUP_TOKENS, hf_generate
from dynvocab.bench.engines.llamacpp import LLAMA_ROWS, LlamaCpp, prompt_text
from dynvocab.bench.engines.llamacpp import generate as llama_generate
from dynvocab.bench.loop.items import HISTORY_CHARS, BenchItem
from dynvocab.bench.loop.prompts import PromptRow
from dynvocab.bench.loop.recorder import PolicyRecorder
from dynvocab.bench.loop.summary import EXTRA_KEYS, RECALL_KS, oracle_summary, summarize_bench
from dynvocab.bench.loop.tasks import as_item
from dynvocab.errors import DynvocabError
from dynvocab.prompts import encode_prompt
from dynvocab.runtime.decoding.loop import DecodeConfig, drafts_trees
from dynvocab.runtime.session import Session
from dynvocab.runtime.strategies import StrategyOptions, lookup, make_policy, parse_strategies
from dynvocab.runtime.trees.shape import TREE_OFF, asks_for_trees, chains_only, split_tree


@dataclass(frozen=True)
class BenchConfig:
    """What a bench run covers."""

    strategies: tuple[str, ...] = ("ar", "full")
    decode: DecodeConfig = DecodeConfig()
    options: StrategyOptions = StrategyOptions()
    chat_template: bool = True
    seeds: tuple[int, ...] = ()  # several seeds: every row once per seed (default: decode.seed only)
    coverage: bool = False  # record target mass and Recall@k of the active sets (costs analysis time, subtracted)
    recall_ks: tuple[int, ...] = RECALL_KS
    lookup_tokens: int = LOOKUP_TOKENS
    history_chars: int = HISTORY_CHARS
    llamacpp: LlamaCpp | None = None  # --llamacpp: the binaries and GGUF files of the llama.cpp rows
    warmup_tokens: int = 8  # each row once on the first prompt, this many tokens, untimed, before the timed rows


def parse_rows(text: str) -> list[str]:
    """Split ``a,b,c`` into bench rows: runtime strategies (checked by the runtime), the hf and llama.cpp rows."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    ours = [n for n in names if n not in HF_ROWS and n not in LLAMA_ROWS]
    if ours or not names:
        parse_strategies(",".join(ours))
    if len(set(names)) != len(names):
        raise DynvocabError(f"--strategies names a row twice: {text}")
    return names


def with_llama_rows(names: list[str], llamacpp: LlamaCpp | None) -> list[str]:
    """``names`` and, with ``--llamacpp``, the llama.cpp rows not named already (last); without it, a llama.cpp row
    named is refused before anything loads."""
    if llamacpp is not None:
        return names + [r for r in LLAMA_ROWS if r not in names]
    for name in names:
        if name in LLAMA_ROWS:
            raise DynvocabError(f"the {name} row runs llama.cpp's binaries; pass --llamacpp BIN_DIR")
    return names


def bench_items(prompts) -> list[BenchItem]:
    """Bench items of the API's prompts: bench items as they are, strings, chat messages, or ``(id, text)`` pairs
    (ids ``p0``, ``p1``, … where none is given); an empty prompt, or none, is refused."""
    items = [_bench_item(index, prompt) for index, prompt in enumerate(prompts)]
    if not items:
        raise DynvocabError("no prompts to bench; pass at least one")
    return items


def _bench_item(index: int, prompt) -> BenchItem:
    """A bench item of one prompt (see :func:`bench_items`)."""
    if isinstance(prompt, tuple) and len(prompt) == 2 and isinstance(prompt[1], str):
        pid, text = prompt
    elif isinstance(prompt, (str, list)):
        pid, text = f"p{index}", prompt
    else:
        return as_item(prompt)
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
    if not messages or not any(str(m.get("content", "")).strip() for m in messages):
        raise DynvocabError(f"prompt {pid} is empty; pass some text")
    return as_item(PromptRow(str(pid), "custom", tuple(messages)))


def needs_draft(strategies) -> bool:
    """Whether any row needs the draft model loaded (llama.cpp loads its own GGUF files)."""
    return any(
        s == "hf-assisted" if s in HF_ROWS else s not in LLAMA_ROWS and lookup(s).drafts for s in strategies
    )


def runnable_strategies(session: Session, cfg: BenchConfig, skip: bool) -> tuple[BenchConfig, list[str]]:
    """Build each strategy's policy once before the run; one that cannot be built fails now, or is dropped with a
    note when ``skip`` (``--quick``). Returns the config to run and the notes."""
    keep, notes = [], []
    chains = session.draft is not None and not drafts_trees(session.draft)
    if chains and asks_for_trees(cfg.decode.tree, cfg.strategies):
        refusal = chains_only(session.draft.info.label)
        if not skip:
            raise refusal
        notes.append(f"{refusal}: this table's rows draft chains")
        dropped = [s for s in cfg.strategies if split_tree(s)[1] is not None]
        notes += [f"skipped {s}: {refusal}" for s in dropped]
        cfg = replace(cfg, strategies=tuple(s for s in cfg.strategies if s not in dropped),
                      decode=replace(cfg.decode, tree=TREE_OFF))
    for name in cfg.strategies:
        if name in LLAMA_ROWS and cfg.llamacpp is None:
            raise DynvocabError(f"the {name} row runs llama.cpp's binaries; pass --llamacpp BIN_DIR")
        if name in LLAMA_ROWS and cfg.decode.temperature > 0:
            raise DynvocabError(f"the {name} row decodes greedily; drop --temperature or --llamacpp")
        if name == "hf-assisted" and session.draft is not None and session.draft.info.hf_model is None:
            msg = f"hf-assisted needs a draft model; transformers cannot assist with an {session.draft.info.label}"
            if not skip:
                raise DynvocabError(msg)
            notes.append(f"skipped {name}: {msg}")
            continue
        if name in HF_ROWS or name in LLAMA_ROWS or session.draft is None or not lookup(name).drafts:
            keep.append(name)
            continue
        try:
            policy = make_policy(name, cfg.options, session.policy_context())
            if policy is not None:
                policy.close()
            keep.append(name)
        except DynvocabError as exc:
            if not skip:
                raise
            notes.append(f"skipped {name}: {exc}")
    return replace(cfg, strategies=tuple(keep)), notes


def generate_row(
    session: Session, strategy: str, prompt_ids: list[int], decode: DecodeConfig, cfg: BenchConfig
) -> tuple[list[int], dict]:
    """One row on one prompt: ``(new token ids, metrics dict)`` with every metrics key present (a llama.cpp
    row's ids are its text re-tokenized)."""
    if strategy in LLAMA_ROWS:
        text, metrics = llama_generate(
            cfg.llamacpp, strategy, prompt_text(session.tokenizer, prompt_ids), len(prompt_ids),
            decode.max_new_tokens, torch.get_num_threads(), decode.gamma, decode.stop_below,
        )
        token_ids = session.tokenizer(text, add_special_tokens=False)["input_ids"][: decode.max_new_tokens]
        return token_ids, {**metrics, **{key: None for key in EXTRA_KEYS}}
    if strategy in HF_ROWS:
        token_ids, metrics = hf_generate(session, strategy, prompt_ids, decode, cfg.lookup_tokens)
        return token_ids, {**metrics, **{key: None for key in EXTRA_KEYS}}
    if asks_for_trees(TREE_OFF, cfg.strategies) and split_tree(strategy)[1] is None:
        decode = replace(decode, tree=TREE_OFF)  # --tree names its rows (X@tree): the others draft chains
    if not lookup(strategy).drafts:
        result = session.generate(prompt_ids, strategy, decode, cfg.options, timing=True)
        return result.token_ids, {**result.metrics.as_dict(), **{key: None for key in EXTRA_KEYS}}
    recorders: list[PolicyRecorder] = []

    def record(policy):
        recorders.append(PolicyRecorder(policy, cfg.coverage, cfg.recall_ks, decode.temperature))
        return recorders[-1]

    result = session.generate(prompt_ids, strategy, decode, cfg.options, wrap_policy=record, timing=True)
    recorder = recorders[0]
    metrics = {**result.metrics.as_dict(), **recorder.metrics()}
    if recorder.coverage and recorder.analysis_s:
        # Scoring ran inside the loop's clock; take it out so --coverage timings stay comparable.
        wall = max(metrics["wall_s"] - recorder.analysis_s, 1e-9)
        metrics["wall_s"] = round(wall, 5)
        metrics["policy_s"] = round(max(metrics["policy_s"] - recorder.analysis_s, 0.0), 5)
        metrics["tokens_per_s"] = round(metrics["new_tokens"] / wall, 5)
    return result.token_ids, metrics


def warm_up(session: Session, items: list[BenchItem], order: list[str], cfg: BenchConfig,
            on_start: Callable[[str, str], None] | None = None) -> None:
    """Each row once on the first item's first turn, ``cfg.warmup_tokens`` tokens, neither timed nor recorded, so
    no timed row pays for first-call work (kernel selection, packed rows, a selector's index, the allocator's first
    blocks). llama.cpp rows start a process of their own each time and are not warmed; every policy is made anew
    for each generation (EvoSpec's adapter is removed at its end), so a warm-up changes no row's output."""
    if not cfg.warmup_tokens or not items:
        return
    prompt_ids = encode_prompt(session.tokenizer, items[0].context(0, [], cfg.history_chars), cfg.chat_template)
    decode = replace(cfg.decode, max_new_tokens=cfg.warmup_tokens)
    for strategy in order:
        if strategy in LLAMA_ROWS:
            continue
        if on_start is not None:
            on_start("warm-up", strategy)
        generate_row(session, strategy, prompt_ids, decode, cfg)


def run_bench(
    session: Session,
    prompts: list[PromptRow | BenchItem],
    cfg: BenchConfig,
    on_result: Callable[[dict], None] | None = None,
    on_start: Callable[[str, str], None] | None = None,
) -> dict:
    """Every row on every prompt (prompt-major, so a slow machine drifts evenly over strategies).

    Replayed items run turn by turn, ``ar`` first in each turn. Returns ``{"config", "generations", "summary",
    "oracle"}``: ``summary[strategy][task]`` aggregates the rows (``"all"``: every task), with speed-ups and
    exact-match rates against ``ar`` where it ran; ``oracle[task]`` is the ``full`` row without its head time.
    """
    items = [as_item(p) for p in prompts]
    order = sorted(cfg.strategies, key=lambda s: s != "ar")  # ar first: its answers are the replayed context
    seeds = cfg.seeds or (cfg.decode.seed,)
    generations = []
    warm_up(session, items, order, cfg, on_start)
    probe = stability.Probe()
    for item in items:
        for seed in seeds:
            decode = replace(cfg.decode, seed=seed)
            answers: dict[str, list[str]] = {s: [] for s in order}
            for turn in range(item.turns):
                row_id = item.row_id(turn)
                for strategy in order:
                    history = answers["ar"] if "ar" in answers else answers[strategy]
                    messages = item.context(turn, history, cfg.history_chars)
                    prompt_ids = encode_prompt(session.tokenizer, messages, cfg.chat_template)
                    if on_start is not None:
                        on_start(row_id, strategy)
                    probe.start()
                    token_ids, metrics = generate_row(session, strategy, prompt_ids, decode, cfg)
                    row_load = probe.stop()
                    text = session.tokenizer.decode(token_ids, skip_special_tokens=True)
                    answers[strategy].append(text)
                    record = {
                        "id": row_id,
                        "task": item.task,
                        "strategy": strategy,
                        "token_ids": token_ids,
                        "text": text,
                        "metrics": metrics,
                        "item": item.id,
                        "turn": turn + 1,
                        "seed": seed,
                        "prompt_tokens": len(prompt_ids),
                        "load": row_load,
                    }
                    if item.segment(turn) is not None:
                        record["segment"] = item.segment(turn)
                    if strategy in LLAMA_ROWS:
                        record["compare"] = "text"  # llama.cpp prints text; = ar compares it with ar's
                    generations.append(record)
                    if on_result is not None:
                        on_result(record)
    return bench_results(session, cfg, generations)


def bench_results(session: Session, cfg: BenchConfig, generations: list[dict]) -> dict:
    """``run_bench``'s result for the rows in ``generations`` (all of them, or those finished before a Ctrl-C)."""
    seeds = cfg.seeds or (cfg.decode.seed,)
    return {
        "config": {
            "strategies": list(cfg.strategies),
            "gamma": cfg.decode.gamma,
            "stop_below": cfg.decode.stop_below,
            "branch_below": cfg.decode.branch_below,
            "tree": cfg.decode.tree,
            "tree_sets": cfg.decode.tree_sets,
            "max_new_tokens": cfg.decode.max_new_tokens,
            "temperature": cfg.decode.temperature,
            "top_p": cfg.decode.top_p,
            "seed": cfg.decode.seed,
            "seeds": list(seeds),
            "device": session.device,
            "dtype": session.dtype,
            "draft_weights": session.draft_weights,
            "draft_bytes": session.draft_bytes,
            "draft": None if session.draft is None else session.draft.info.label,
            "prepacked": session.prepacked,
            "coverage": cfg.coverage,
            "recall_ks": list(cfg.recall_ks) if cfg.coverage else [],
            "lookup_tokens": cfg.lookup_tokens,
            "chat_template": cfg.chat_template,
            "history_chars": cfg.history_chars,
            "warmup_tokens": cfg.warmup_tokens,
            "threads": torch.get_num_threads(),
            "llamacpp": None if cfg.llamacpp is None else cfg.llamacpp.describe(),
        },
        "generations": generations,
        "summary": summarize_bench(generations, cfg.strategies, greedy=cfg.decode.temperature == 0),
        "oracle": oracle_summary(generations),
        "machine": stability.machine([g.get("load") for g in generations]),
        "warnings": stability.bench_warnings(generations),
    }
