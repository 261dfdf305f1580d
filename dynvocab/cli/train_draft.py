"""``dynvocab train-draft``: build an EAGLE draft head for a target (features, then training; both resumable)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from dynvocab.builders.draft import OptimConfig, TrainDraftConfig
from dynvocab.builders.draft.distill import DistillConfig
from dynvocab.builders.draft.ranks import env_rank
from dynvocab.cli.common import Device, Target, Threads, check_dtype_device, err_console, one_line_errors, set_threads
from dynvocab.errors import DynvocabError
from dynvocab.models.eagle.layouts import describe_families
from dynvocab.progress import SilentReporter, make_reporter

_DEFAULTS = TrainDraftConfig()
_DISTILL = DistillConfig()
DISTILL_ROOM = 16  # --max-tokens beyond a self-distilled prompt and answer: the BOS and the chat template's turn markers


def _override(cfg, **values):
    """The frozen config ``cfg`` with the options the user gave (None = keep the default)."""
    return replace(cfg, **{k: v for k, v in values.items() if v is not None})


@one_line_errors
def train_draft(
    out: Annotated[Optional[Path], typer.Option("--out", help="Folder of the head (config.json, model.safetensors, training.json); rerun to resume. Required unless --features-only names --features.")] = None,
    target: Target = "demo:target",
    corpus: Annotated[
        Optional[List[str]],
        typer.Option(help="sharegpt (training split, chat-template encoded), slimpajama, python-stubs (code prompts from this Python's standard library), debian-faq (the Debian FAQ's training split in nine languages, from Debian's debian-faq packages), debian-faq-translate (its English training sections asked into each other language), licences (the training split of /usr/share/common-licenses), or .txt/.jsonl/.json/.parquet files; repeatable."),
    ] = None,
    arch: Annotated[str, typer.Option(help="eagle3 (own lm_head over a draft vocabulary, three target layers) or eagle1 (the target's head).")] = _DEFAULTS.arch,
    draft_vocab: Annotated[Optional[int], typer.Option(help=f"EAGLE-3: draft vocabulary size K (default {_DEFAULTS.draft_vocab:,}).")] = None,
    bundle: Annotated[Optional[str], typer.Option("--bundle", help="EAGLE-3: take the draft vocabulary from this bundle's freq stage (default: count the training data).")] = None,
    max_docs: Annotated[Optional[int], typer.Option(help=f"Documents to compute features for (default {_DEFAULTS.corpus.max_docs}).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help=f"Tokens per document (default {_DEFAULTS.features.max_tokens}; with --self-distill and turn prompts, --distill-prompt-tokens + --distill-new-tokens + {DISTILL_ROOM}: room for a whole answer).")] = None,
    epochs: Annotated[Optional[int], typer.Option(help=f"Training epochs (default {OptimConfig.epochs}).")] = None,
    lr: Annotated[Optional[float], typer.Option(help=f"AdamW peak learning rate (default {OptimConfig.lr:g}).")] = None,
    ttt_steps: Annotated[Optional[int], typer.Option(min=1, help="Chained training-time-test steps per document (default: 1 for eagle1, 3 for eagle3).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the batch order and the feature noise.")] = None,
    eval_every: Annotated[Optional[int], typer.Option(min=1, help=f"Steps between held-out evaluations (default {OptimConfig.eval_every}); each scores the full head at every held-out position of every chained step.")] = None,
    batch_docs: Annotated[Optional[int], typer.Option(help=f"Documents per optimizer step over all ranks (default {OptimConfig.batch_docs}); the same head for any number of ranks.")] = None,
    micro_docs: Annotated[Optional[int], typer.Option(help=f"Documents per forward pass on one rank (default {OptimConfig.micro_docs}); gradients accumulate up to --batch-docs.")] = None,
    feature_batch: Annotated[Optional[int], typer.Option(help="Documents per target pass when computing features (default: 8 on a GPU, 1 on CPU).")] = None,
    feature_dtype: Annotated[Optional[str], typer.Option(help="The target's dtype in the feature pass (default: bfloat16 on a GPU, float32 on CPU; bfloat16 is ~3x faster on CPUs with AVX-512 BF16).")] = None,
    features: Annotated[
        Optional[Path],
        typer.Option("--features", help="Feature cache folder (default OUT/work/features). Heads may share one: fewer --max-docs read its first documents, more extend it, an eagle3 cache serves eagle1."),
    ] = None,
    extra_features: Annotated[
        Optional[List[Path]],
        typer.Option("--extra-features", help="A finished --features folder of an earlier run for the same target (say chat, beside this run's code), trained on beside this run's documents: all of them, its held-out ones kept out; repeatable."),
    ] = None,
    negatives: Annotated[Optional[int], typer.Option(help=f"EAGLE-1: uniformly sampled head ids its cross-entropy scores beside the target's top-{_DEFAULTS.features.topk} (default {OptimConfig.negatives:,}); 0 scores the whole head.")] = None,
    self_distill: Annotated[bool, typer.Option("--self-distill", help="Train on the target's own continuations of the corpus's prompts (generated in batches, cached, resumable) instead of the corpus text.")] = False,
    distill_prompts: Annotated[str, typer.Option(help="--self-distill: turn (the target answers each conversation's first user turn, encoded as at run time) or text (it continues each document's first tokens).")] = _DISTILL.prompts,
    distill_prompt_tokens: Annotated[int, typer.Option(help="--self-distill: tokens per prompt (turn: of the user's turn, cut beyond; text: of the document).")] = _DISTILL.prompt_tokens,
    distill_new_tokens: Annotated[int, typer.Option(help="--self-distill: tokens the target writes per prompt.")] = _DISTILL.new_tokens,
    distill_temperature: Annotated[float, typer.Option(help="--self-distill: 0 greedy, else sampled from the target's full distribution.")] = _DISTILL.temperature,
    distill_batch: Annotated[int, typer.Option(help="--self-distill: prompts per generation call (and per cache shard); with --distill-engine vllm, requests in flight.")] = _DISTILL.batch,
    distill_engine: Annotated[str, typer.Option(help="--self-distill: who writes the answers: torch (in this process) or vllm (a vLLM engine over the target's local folder, in a child process; the same cache and resume).")] = _DISTILL.engine,
    vllm_python: Annotated[Optional[str], typer.Option(help="--distill-engine vllm: the python of an environment with vLLM and dynvocab (default: this one).")] = None,
    features_only: Annotated[bool, typer.Option("--features-only", help="Build (or resume) the feature cache and stop, writing no head: a cache that later runs name with --features or --extra-features.")] = False,
    init_from: Annotated[Optional[str], typer.Option("--init-from", help="Continue training this EAGLE head (a folder, a hub id or demo:gemma-eagle1) instead of starting from the target's last layer; same --arch and target.")] = None,
    save_dtype: Annotated[Optional[str], typer.Option(help="The head's weights on disk: float32 (default, as trained), bfloat16 or float16 (half the bytes; loading casts).")] = None,
    train_dtype: Annotated[Optional[str], typer.Option(help="The dtype of training's matmuls: bfloat16 (autocast; losses stay float32) or float32 (default: bfloat16 on a GPU and on CPUs with native bf16, float32 elsewhere). On a 2-core AMX CPU bfloat16 trained 1.1x faster, 1.46x with --batch-docs 8, at the same held-out agreement.")] = None,
    fmt: Annotated[str, typer.Option("--format", help=f"The head's layout family. {describe_families()}.")] = _DEFAULTS.layout,
    device: Device = None,
    threads: Threads = None,
) -> None:
    """Train an EAGLE-1 or EAGLE-3 draft head for a target on the training split; `--draft OUT` loads it.

    Runs unchanged under `torchrun --nproc_per_node N` (data-parallel; rank 0 reports progress and writes the head)."""
    from dynvocab.builders.draft import train_draft as run
    from dynvocab.builders.draft.config import check_config

    if out is None:
        if not (features_only and features):
            raise DynvocabError("pass --out, the head's folder (only --features-only with --features needs none)")
        out = features  # nothing is written under it: the cache is the whole output
    check_dtype_device(device, feature_dtype)
    set_threads(threads)
    cfg = TrainDraftConfig(
        arch=arch,
        draft_vocab=draft_vocab if draft_vocab is not None else _DEFAULTS.draft_vocab,
        bundle=bundle,
        corpus=_override(_DEFAULTS.corpus, sources=tuple(corpus) if corpus else None, max_docs=max_docs),
        features=_override(_DEFAULTS.features, max_tokens=_max_tokens(max_tokens, self_distill, distill_prompts,
                                                                      distill_prompt_tokens + distill_new_tokens),
                           batch_docs=feature_batch, dtype=feature_dtype),
        optim=_override(_DEFAULTS.optim, epochs=epochs, lr=lr, ttt_steps=ttt_steps, seed=seed, eval_every=eval_every,
                        batch_docs=batch_docs, micro_docs=micro_docs, negatives=negatives),
        layout=fmt,
        device=device,
        features_dir=str(features) if features else None,
        extra_features=tuple(str(f) for f in extra_features or ()),
        save_dtype=save_dtype,
        train_dtype=train_dtype,
        init_from=init_from,
        features_only=features_only,
        distill=DistillConfig(prompt_tokens=distill_prompt_tokens, new_tokens=distill_new_tokens,
                              temperature=distill_temperature, batch=distill_batch, prompts=distill_prompts,
                              engine=distill_engine) if self_distill else None,
    )
    check_config(cfg)  # refusals before the progress display starts
    writer = None
    if cfg.distill is not None and cfg.distill.engine == "vllm":  # refused before the target loads
        from dynvocab.bench.engines.vllm.answers import VllmWriter

        writer = VllmWriter.for_target(target, vllm_python)
    if env_rank() != 0:  # under torchrun only rank 0 draws and reports; the others print only their errors
        run(target, out, cfg, SilentReporter(), writer)
        return
    with make_reporter(err_console) as reporter:
        report = run(target, out, cfg, reporter, writer)
    info = report.info
    if cfg.features_only:
        err_console.print(f"feature cache {report.path} · {info['docs']:,} documents · {info['tokens']:,} tokens · "
                          f"{info['seconds']['features']:.0f} s; no head trained (--features-only)", highlight=False, soft_wrap=True)
        return
    held = info["heldout"][-1] if info["heldout"] else None
    agree = (
        f" · held-out top-1 {held['top1'][0]:.1%} (steps {', '.join(f'{a:.0%}' for a in held['top1'])}; "
        f"est. acceptance length {held['est_accept_len']:.2f})" if held else ""
    )
    extract = info["data"]["extract"]
    rate = f" at {extract['tokens_per_s']:,.0f} tok/s" if extract else " (cached)"
    err_console.print(
        f"wrote {report.path} · {info['arch']} · {info['data']['tokens']:,} feature tokens{rate} · "
        f"{info['steps']:,} steps · features {info['seconds']['features']:.0f} s · training {info['seconds']['training']:.0f} s · "
        f"peak memory {info['peak_memory_mb'] / 1024:.1f} GiB{agree}",
        highlight=False, soft_wrap=True,
    )


def _max_tokens(given: int | None, self_distill: bool, prompts: str, prompt_and_answer: int) -> int | None:
    """--max-tokens as given, else room for a whole self-distilled answer after a turn prompt (None: the default)."""
    if given is not None or not self_distill or prompts != "turn":
        return given
    return prompt_and_answer + DISTILL_ROOM
