"""Speculation that steps aside under load: a batch-size schedule for vLLM's ``speculative_config``
(``num_speculative_tokens_per_batch_size``: ``[[start, end, k], …]``, inclusive batch-size ranges, ``k`` draft
tokens for a batch in that range and ``0`` for none; vllm 0.32.0 ``config/speculative.py``, read by the scheduler).

A schedule is written ``1:3,4:0``: from batch size 1, 3 draft tokens; from 4, none (the last range runs to the
engine's ``max_num_seqs``). No vLLM import: ``export`` and ``bench`` use it where vLLM is not installed.
Model Runner V2 (vLLM 0.33's default on GPUs) ignores ``k = 0`` (vLLM issue #51510, fix #51575 open), so on a GPU
engine there a schedule can lower ``k`` but not turn speculation off.
"""

from __future__ import annotations

import json
from pathlib import Path

from dynvocab.errors import DynvocabError

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
# The end of a schedule's last range where no engine size is known: vLLM carries the last range's k on to its
# max_num_seqs whatever the end (``v1/spec_decode/dynamic/utils.py:build_dynamic_sd_schedule_lookup``)
OPEN_END = 4096


def parse_schedule(text: str, gamma: int, max_num_seqs: int) -> list[list[int]]:
    """``START:K,START:K,…`` as vLLM's ranges ``[[start, end, k], …]`` covering 1 … ``max_num_seqs``; each k at
    most ``gamma`` (the folder's ``num_speculative_tokens``), starts rising from 1. Refused in one line."""
    steps: list[tuple[int, int]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        start, sep, k = part.partition(":")
        try:
            if not sep:
                raise ValueError
            steps.append((int(start), int(k)))
        except ValueError:
            raise DynvocabError(f"a schedule is START:K pairs, e.g. 1:3,4:0 (batch size from which K draft tokens); "
                                f"got '{part}'") from None
    if not steps or steps[0][0] != 1:
        raise DynvocabError(f"a schedule starts at batch size 1, e.g. 1:{gamma},4:0 (got {text!r})")
    starts = [s for s, _ in steps]
    if starts != sorted(set(starts)):
        raise DynvocabError(f"a schedule's batch sizes rise, each once (got {text!r})")
    for _, k in steps:
        if not 0 <= k <= gamma:
            raise DynvocabError(f"a schedule's draft tokens are 0 … {gamma} (the γ the engine speculates with); "
                                f"got {k} in {text!r}")
    if starts[-1] > max_num_seqs:
        raise DynvocabError(f"a schedule's batch sizes stay within max_num_seqs {max_num_seqs} (got {starts[-1]})")
    ends = [s - 1 for s in starts[1:]] + [max_num_seqs]
    return [[s, e, k] for (s, k), e in zip(steps, ends)]


def schedule_ranges(text: str, gamma: int, max_num_seqs: int = OPEN_END) -> list[list[int]]:
    """``--schedule``: ``START:K,…`` (:func:`parse_schedule`), or the path of a ``bench --vllm --schedule`` JSON,
    whose picked schedule is taken (its γ must be ``gamma``)."""
    path = Path(text).expanduser()
    if text.endswith(".json") or path.is_file():
        if not path.is_file():
            raise DynvocabError(f"--schedule {text}: no such file (give START:K pairs or a bench --vllm JSON)")
        try:
            config = json.loads(path.read_text())["config"]
            picked, their_gamma = config["schedule"]["text"], int(config["gamma"])
        except (ValueError, KeyError, TypeError):
            raise DynvocabError(f"--schedule {text} is not a `dynvocab bench --vllm --schedule` JSON") from None
        if their_gamma != gamma:
            raise DynvocabError(f"--schedule {text} was measured at γ {their_gamma}; export with --gamma {their_gamma}")
        text = picked
    return parse_schedule(text, gamma, max_num_seqs)


def format_schedule(ranges: list[list[int]]) -> str:
    """The ``START:K,…`` form of vLLM's ranges (what :func:`parse_schedule` reads back)."""
    return ",".join(f"{s}:{k}" for s, _, k in ranges)


def pick_schedule(speedups: dict[int, float], gamma: int, max_num_seqs: int, margin: float = 1.0) -> list[list[int]]:
    """The schedule ``auto`` picks from measured speed-ups (batch size -> speculative tok/s over plain tok/s at that
    many requests in flight): speculate at ``gamma`` up to the largest measured size where it paid (> ``margin``)
    with every smaller measured size paying too, none from the next measured size on; between measured sizes the
    step is at the first size that did not pay. Speculation that never paid gives ``[[1, max, 0]]``."""
    if not speedups:
        raise DynvocabError("auto needs at least one measured level of requests in flight")
    off = next((size for size in sorted(speedups) if speedups[size] <= margin), None)
    if off is None:
        return [[1, max_num_seqs, gamma]]
    if off == 1:
        return [[1, max_num_seqs, 0]]
    return [[1, off - 1, gamma], [off, max_num_seqs, 0]]
