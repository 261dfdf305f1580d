"""dynvocab's Python API: load a target/draft pair once, then generate, stream and bench on it; build, train and
export the offline artifacts. The CLI is a thin layer over these calls (each default lives here or in the config
dataclasses they take), so the CLI and the API give the same tokens and the same metrics.

Nothing here exits the process or prints: failures raise :class:`~dynvocab.errors.DynvocabError` with the one-line
message the CLI prints; progress goes to the ``progress`` callback when one is given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from dynvocab.errors import DynvocabError
from dynvocab.reply import GenerationResult, Reply, TextStream
from dynvocab.runtime.decoding.loop import DecodeConfig
from dynvocab.runtime.registry import StrategyOptions

Prompt = "str | Sequence[dict]"  # a user message, or chat messages ({"role": …, "content": …})
ProgressCallback = Callable[[str, int, "int | None"], None]  # (stage, done, total or None)

DECODING = tuple(f.name for f in dataclasses.fields(DecodeConfig))


@dataclass(frozen=True)
class BenchResult:
    """A bench run: ``rows`` (one dict per strategy over all prompts, the figures the CLI's table prints, with
    ``strategy`` first), the per-generation records, the config, and the whole result (``raw``) as
    ``dynvocab bench --json`` writes it."""

    rows: list[dict]
    generations: list[dict]
    config: dict
    raw: dict = field(repr=False)

    def to_pandas(self):
        """The rows as a pandas DataFrame indexed by strategy (needs pandas installed)."""
        try:
            import pandas as pd
        except ImportError as exc:
            raise DynvocabError("to_pandas needs pandas: pip install pandas") from exc
        return pd.DataFrame(self.rows).set_index("strategy")


def decode_config(**decoding) -> DecodeConfig:
    """A :class:`DecodeConfig` from keyword decoding settings (``max_new_tokens``, ``gamma``, ``temperature``,
    ``top_p``, ``seed``, ``stop_below``, ``branch_below``, ``tree``); an unknown one is refused in one line."""
    unknown = sorted(set(decoding) - set(DECODING))
    if unknown:
        raise DynvocabError(f"unknown decoding setting {', '.join(unknown)}; use {', '.join(DECODING)}")
    cfg = DecodeConfig(**decoding)
    if cfg.max_new_tokens < 1:
        raise DynvocabError("max_new_tokens must be at least 1")
    if cfg.gamma < 0:
        raise DynvocabError("gamma must be 0 or more")
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1:
        raise DynvocabError("temperature must be >= 0 and top_p in (0, 1]")
    return cfg


def strategy_options(
    options: StrategyOptions | None = None, configs: Sequence = (), token_map: str | None = None,
    fr_size: int | None = None,
) -> StrategyOptions:
    """The strategies' options: ``options`` as given, else one built from the strategies' frozen ``configs``
    (e.g. ``HybridConfig(window=1024)``), a ``token_map`` file and an ``fr_size``."""
    if options is not None:
        if configs or token_map is not None or fr_size is not None:
            raise DynvocabError("pass options, or configs / token_map / fr_size, not both")
        return options
    return StrategyOptions(token_map=token_map, fr_size=fr_size, configs=tuple(configs))


class Pair:
    """A loaded target/draft pair (and bundle): generate, stream, start (iterate cycle by cycle) and bench any
    strategy on it.

    Build it with :func:`load`. ``session`` is the runtime's :class:`~dynvocab.runtime.session.Session` (models,
    tokenizer, EOS ids, bundle) for what this class does not wrap.
    """

    def __init__(self, session):
        self.session = session

    @property
    def tokenizer(self):
        """The target's tokenizer (shared with a draft model)."""
        return self.session.tokenizer

    @property
    def draft_label(self) -> str | None:
        """What the draft is (``"draft model"``, ``"EAGLE-1 head"``, …), or None when none was loaded."""
        return None if self.session.draft is None else self.session.draft.info.label

    def encode(self, prompt, chat_template: bool = True) -> list[int]:
        """Token ids of a user message or chat messages, with the chat template (and its assistant opener)
        unless ``chat_template`` is False."""
        from dynvocab.prompts import encode_prompt

        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return encode_prompt(self.session.tokenizer, messages, chat_template)

    def start(
        self,
        prompt,
        strategy: str = "full",
        *,
        chat_template: bool = True,
        options: StrategyOptions | None = None,
        configs: Sequence = (),
        token_map: str | None = None,
        fr_size: int | None = None,
        timing: bool = False,
        **decoding,
    ) -> Reply:
        """A generation after ``prompt`` (a user message or chat messages) with ``strategy``, as a
        :class:`~dynvocab.reply.Reply`: iterating it runs one cycle per step and yields the token ids it committed;
        ``reply.result`` is the :class:`GenerationResult` once it has ended (at the end, or after ``close()``). The
        output is the target's own (greedy: the argmax of its verification pass at every position). Bad arguments
        are refused here, before anything runs.

        ``decoding``: :class:`DecodeConfig` fields (``max_new_tokens=128``, ``gamma``, ``temperature``, ``top_p``,
        ``seed``, ``stop_below``, ``branch_below``, ``tree``: ``"off"``, ``"auto"`` or ``"5x8x60"``). Strategy
        knobs: ``configs`` (their frozen config dataclasses), ``token_map``, ``fr_size``, or a whole ``options``.
        ``timing`` also measures the loop's sections (prefill, draft, head, policy, verify) in the metrics.
        """
        from dynvocab.runtime.strategies import check_strategy

        check_strategy(strategy)
        cfg = decode_config(**decoding)
        opts = strategy_options(options, configs, token_map, fr_size)
        ids = self.encode(prompt, chat_template)
        self.session.check_fits(len(ids), cfg.max_new_tokens)
        return Reply(self.session.decoding(ids, strategy, cfg, opts, timing=timing), self.tokenizer, strategy)

    def generate(
        self, prompt, strategy: str = "full", *, on_tokens: Callable[[list[int]], None] | None = None, **kwargs,
    ) -> GenerationResult:
        """Generate after ``prompt`` (a user message or chat messages) with ``strategy``, to the end; the output is
        the target's own (greedy: the argmax of its verification pass at every position). The arguments are
        :meth:`start`'s (``chat_template``, ``options``, ``configs``, ``token_map``, ``fr_size``, ``timing``, and
        decoding settings such as ``max_new_tokens=128``); ``on_tokens`` receives each cycle's new token ids."""
        reply = self.start(prompt, strategy, **kwargs)
        for new in reply:
            if on_tokens is not None:
                on_tokens(new)
        return reply.result

    def stream(self, prompt, strategy: str = "full", **kwargs) -> Iterator[str]:
        """Yield the reply's text piece by piece as cycles finish (the arguments of :meth:`start`). Pieces never
        split a character. A plain generator on the caller's thread: each cycle runs when the next piece is asked
        for, so closing it early (or breaking out of a loop over it) runs no further cycle."""
        reply = self.start(prompt, strategy, **kwargs)
        text = TextStream(self.tokenizer)
        try:
            for new in reply:
                if piece := text.push(new):
                    yield piece
        finally:
            reply.close()
        if piece := text.tail(text.text(), final=True):
            yield piece

    def bench(
        self,
        prompts,
        strategies: Sequence[str] = ("ar", "full"),
        *,
        chat_template: bool = True,
        seeds: Sequence[int] = (0,),
        coverage: bool = False,
        options: StrategyOptions | None = None,
        configs: Sequence = (),
        token_map: str | None = None,
        fr_size: int | None = None,
        skip_unrunnable: bool = False,
        llamacpp=None,
        progress=None,
        **decoding,
    ) -> BenchResult:
        """Run every row on every prompt, timed as ``dynvocab bench`` runs them (it runs this); returns the rows
        its table prints.

        ``prompts``: user messages (strings), chat message lists, ``(id, text)`` pairs, or bench items.
        ``strategies``: registered strategies and the ``hf-assisted`` / ``hf-lookup`` rows (and the llama.cpp rows
        with ``llamacpp``, a :class:`~dynvocab.bench.engines.llamacpp.LlamaCpp`). ``decoding`` and the strategy
        knobs as in :meth:`start` (``max_new_tokens`` defaults to 128); every row runs once per seed in ``seeds``.
        ``skip_unrunnable``: drop a row whose policy cannot be built here, with a note, instead of refusing.
        ``progress``: a callback ``(stage, done, total)`` or a reporter. A Ctrl-C raises
        :class:`~dynvocab.errors.Interrupted` whose ``result`` holds the rows finished so far.
        """
        from dynvocab.bench.loop.runner import (BenchConfig, bench_items, parse_rows, runnable_strategies,
                                                with_llama_rows)

        rows = with_llama_rows(parse_rows(",".join(strategies)), llamacpp)
        if not seeds:
            raise DynvocabError("seeds is empty; pass at least one seed")
        cfg = BenchConfig(
            strategies=tuple(rows), decode=decode_config(**{"seed": seeds[0], **decoding}),
            options=strategy_options(options, configs, token_map, fr_size), chat_template=chat_template,
            seeds=tuple(seeds), coverage=coverage, llamacpp=llamacpp,
        )
        items = bench_items(prompts)
        for item in items:  # a prompt that leaves no room for the new tokens is refused before any row runs
            ids = self.encode(item.context(0, [], 0), chat_template)
            self.session.check_fits(len(ids), cfg.decode.max_new_tokens, where=f"prompt '{item.id}'")
        cfg, notes = runnable_strategies(self.session, cfg, skip=skip_unrunnable)
        return _run_rows(self.session, items, cfg, notes, progress)


def _run_rows(session, items: list, cfg, notes: list[str], progress) -> BenchResult:
    """Run the bench's rows with a progress task over rows × prompts; a Ctrl-C raises
    :class:`~dynvocab.errors.Interrupted` holding the rows finished so far."""
    from dynvocab.bench.loop.runner import bench_results, run_bench
    from dynvocab.errors import Interrupted
    from dynvocab.progress import as_reporter

    total = sum(item.turns for item in items) * len(cfg.strategies) * len(cfg.seeds)
    finished: list[dict] = []
    with as_reporter(progress).task("bench (rows·prompts)", total=total) as advance:

        def on_result(record: dict) -> None:
            finished.append(record)
            advance(1)

        try:
            results = run_bench(
                session, items, cfg, on_result=on_result,
                on_start=lambda row, strategy: advance(0, description=f"bench · {row} · {strategy}"),
            )
        except KeyboardInterrupt:
            results = _with_notes(bench_results(session, cfg, finished), notes, items, interrupted=True)
            raise Interrupted(f"interrupted after {len(finished)} of {total} rows", _bench_result(results)) from None
    return _bench_result(_with_notes(results, notes, items))


def _with_notes(results: dict, notes: list[str], items, interrupted: bool = False) -> dict:
    """A bench result with its notes, its tasks and, after a Ctrl-C, ``interrupted``."""
    results["notes"] = notes
    results["config"]["tasks"] = sorted({item.task for item in items})
    if interrupted:
        results["interrupted"] = True
    return results


def _bench_result(results: dict) -> BenchResult:
    """The :class:`BenchResult` of a bench result dict: one row per strategy over all prompts."""
    summary = results["summary"]
    table = [{"strategy": name, **summary[name]["all"]} for name in summary]
    return BenchResult(table, results["generations"], results["config"], results)


def load(
    target: str = "demo:target",
    draft: str | None = "demo:draft",
    bundle: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    draft_weights: str | None = None,
    prepack: bool | None = None,
    threads: int | None = None,
    status: Callable[[str], None] | None = None,
) -> Pair:
    """Load a target and its draft once (a hub id, a local folder, a ``.gguf`` file, ``demo:*``, or an EAGLE head
    folder for the draft; ``draft=None``: the target alone, for ``ar``), and the ``bundle`` the strategies read.

    ``device``/``dtype``: default cuda if available else cpu, and bfloat16 where the hardware runs it natively,
    else float32. ``draft_weights``: what the draft's steps read (``"int8"`` or a dtype; default by measurement).
    ``prepack``: oneDNN-packed copies for few-row passes (default: where supported). ``threads``: torch's CPU
    threads. ``status`` receives loading messages.
    """
    from dynvocab.models.loading import check_device_options
    from dynvocab.runtime.session import ModelConfig, Session

    check_device_options(device, dtype, draft_weights)
    if threads is not None:
        if threads < 1:
            raise DynvocabError("threads must be at least 1")
        import torch

        torch.set_num_threads(threads)
    models = ModelConfig(target, draft or target, device, dtype, prepack=prepack, draft_weights=draft_weights)
    session = Session(models, need_draft=draft is not None, status=status,
                      bundle=None if bundle is None else str(bundle))
    return Pair(session)


def build_index(
    out: str | Path, target: str = "demo:target", draft: str = "demo:draft", config=None, progress=None,
):
    """Build the offline tables (``config.stages``: freq, clusters, hnsw, graph, draft_hnsw) for a target/draft
    pair into the bundle ``out``, written whole; stages already there for the same models are kept, and a build
    stopped half-way resumes after its last finished stage. ``config``: a
    :class:`~dynvocab.builders.pipeline.BuildConfig` (default: its defaults). ``progress``: a callback
    ``(stage, done, total)`` or a reporter. Returns the build report (path, bytes, seconds, stages kept)."""
    from dynvocab.builders.pipeline import BuildConfig, build_bundle

    return build_bundle(target, draft, out, config or BuildConfig(), _reporter(progress))


def train_router(
    bundle: str | Path, draft: str = "demo:draft", target: str | None = None, config=None,
    out: str | Path | None = None, progress=None,
):
    """Train the vocabulary selectors ``config.selectors`` (DynaSpec's cluster router, the lowrank and centroids
    candidate selectors) on one data pass of ``draft`` and write them into ``bundle`` (or ``out``), whole.
    ``config``: a :class:`~dynvocab.builders.router.TrainRouterConfig`. Returns the report (held-out recall per
    selector, documents, timings)."""
    from dynvocab.builders.router import TrainRouterConfig
    from dynvocab.builders.router import train_router as run

    return run(bundle, draft, target, config or TrainRouterConfig(), out, _reporter(progress))


def export(bundle: str | Path, out: str | Path, format: str = "sglang", size: int | None = None, *,
           strategy: str | None = None, draft: str | None = None, budget: int | None = None,
           copy: bool = False) -> Path:
    """Export the bundle in ``format``, one of :data:`dynvocab.artifacts.export.FORMATS`; returns ``out``.

    ``dynvocab export --help`` lists the formats and the stages each reads. ``size``, ``strategy``, ``draft``,
    ``budget`` and ``copy`` go to the format that takes them (:class:`~dynvocab.artifacts.export.ExportRequest`);
    one it does not take is refused in one line.
    """
    from dynvocab.artifacts.export import ExportRequest, export_bundle

    request = ExportRequest(size=size, strategy=strategy, draft=draft, budget=budget, copy=copy)
    return export_bundle(bundle, out, format, request).path


def _reporter(progress):
    """A builders' reporter for ``progress``: None reports nothing, a reporter is used as it is, a callable
    ``(stage, done, total)`` is called as work advances (:func:`dynvocab.progress.as_reporter`)."""
    from dynvocab.progress import as_reporter

    return as_reporter(progress)
