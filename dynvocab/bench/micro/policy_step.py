"""Per-draft-step cost of each dynamic vocabulary policy, set against one EAGLE-1 draft step with a 3k-row head.

An EAGLE draft step is one decoder layer plus the LM head over the active rows: a few milliseconds on a CPU, well
under one on a GPU. What a policy does per step (``active_ids``, and its share of ``observe`` per drafted token)
must stay a small part of that (issue 15: ≤ 10% of a 3k-row step). This module times, at the demo target's
shapes (d = 1,536, V = 151,936):

- ``eagle_step``: EAGLE-1's draft step with random weights — ``fc`` over ``cat(embedding, feature)`` [2d → d],
  one ``Qwen2DecoderLayer`` decoding one token after ``context`` cached ones, and a contiguous 3,072-row head;
- per policy, over a scripted run of draft-verify cycles: the policy's own time per draft step (``active_ids``
  plus ``observe`` divided by the cycle's steps) and the draft head's time per step over the sets it returns
  (``DraftHead.logits``, slot-table upkeep included).

Each policy is built by its strategy's registry factory (:func:`~dynvocab.runtime.registry.make_policy`), as
``generate`` builds it, from a context over a bundle and stand-in models with random weights. The bundle: the one
given (``freq``, ``clusters``, ``router``, ``hnsw``, ``graph``, ``draft_hnsw``), else synthetic tables of demo
sizes written as one (each registered stage builder's random stand-in: a frequency ranking, 1,024 clusters with a
router, a 64-successor graph, an HNSW index over 4,096 rows for retrieval, the selectors). Cycles draw drafted
tokens mostly from the 4k most frequent ids and accept a random prefix, so sets change as they do in a run.
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import torch
import torch.nn.functional as F

from dynvocab.artifacts import FreqTable, HnswParams, ModelFingerprint, load_bundle, write_bundle
from dynvocab.bench.micro.scripted import ScriptedCycle, ScriptedDraft, run_script
from dynvocab.bench.micro.timing import CacheFlusher, cpu_threads, resolve_dtype, time_ms
from dynvocab.errors import DynvocabError
from dynvocab.models.int8 import INT8
from dynvocab.models.rows import FloatRows, Int8Rows
from dynvocab.runtime.decoding.cycle import Sections
from dynvocab.runtime.decoding.timing import SectionTimer
from dynvocab.runtime.drafts.draft import DraftInfo
from dynvocab.runtime.drafts.kinds import lookup_kind
from dynvocab.runtime.heads.head import DraftHead
from dynvocab.runtime.selection.context.hybrid import HybridConfig
from dynvocab.runtime.strategies import PolicyContext, StrategyOptions, make_policy, strategies

DEMO_TARGET = {  # Qwen2.5-Coder-1.5B: the demo target, whose head an EAGLE-1 draft shares
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}
VARIANTS = {  # bench-only rows: a registered strategy with other options
    # the hybrid without its per-step draft-head HNSW search (its default on GPUs)
    "hybrid-nosearch": ("hybrid", StrategyOptions(configs=(HybridConfig(step_neighbours=0),))),
}
HEAD_ROWS = 3072
SYNTHETIC_KIND = "eagle1"  # the draft whose stand-in reads synthetic tables: EAGLE-1, sharing the target's head


@torch.inference_mode()
def eagle_step_ms(dtype: torch.dtype, context: int = 128, repeats: int = 10, warmup: int = 2, seed: int = 0,
                  target: dict = DEMO_TARGET) -> dict:
    """Median ms of one EAGLE-1 draft step's body (fc + one decoder layer) and of its 3k-row head (M = 1)."""
    from transformers import DynamicCache, Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    cfg = Qwen2Config(**target, num_hidden_layers=1)
    torch.manual_seed(seed)
    d = cfg.hidden_size
    layer = Qwen2DecoderLayer(cfg, layer_idx=0).to(dtype).eval()
    rotary = Qwen2RotaryEmbedding(cfg)
    fc = torch.nn.Linear(2 * d, d, bias=True).to(dtype)
    cache = DynamicCache(config=cfg)
    prefix = torch.randn(1, context, d, dtype=dtype)  # [1, context, d]
    positions = torch.arange(context)[None]  # [1, context]
    layer(prefix, position_ids=positions, past_key_values=cache, use_cache=True,
          position_embeddings=rotary(prefix, positions))
    x = torch.randn(1, 1, 2 * d, dtype=dtype)  # [1, 1, 2d] cat(embedding, feature)
    pos = torch.tensor([[context]])  # [1, 1]
    rope = rotary(prefix[:, :1], pos)
    rows = torch.randn(HEAD_ROWS, d, dtype=dtype)  # [3k, d] packed head rows

    def body() -> torch.Tensor:
        h = layer(fc(x), position_ids=pos, past_key_values=cache, use_cache=True, position_embeddings=rope)
        cache.crop(-1)  # back to the context: every timed step sees the same cache length
        return h[0]  # [1, d]

    cpu = torch.device("cpu")
    body_ms = time_ms(body, cpu, repeats, warmup)
    h = body()
    head_ms = time_ms(lambda: F.linear(h, rows), cpu, repeats, warmup, CacheFlusher(cpu))
    return {"body_ms": body_ms, "head_ms": head_ms, "step_ms": body_ms + head_ms}


@dataclass(frozen=True)
class _Target:
    """What the policies' factories read of the target: its head rows (as the bundle's ``hnsw`` index covers them)."""

    weight: torch.Tensor  # [n, d]


@contextmanager
def bench_context(bundle, vocab: int, dim: int, seed: int, kind: str = SYNTHETIC_KIND) -> Iterator[PolicyContext]:
    """A :class:`PolicyContext` over ``bundle``'s tables, else over synthetic tables of demo sizes written as a
    bundle (kept while the context is open), with stand-in models of random weights shaped as the tables expect:
    for synthetic tables, the stand-in of draft ``kind`` (a registered
    :class:`~dynvocab.runtime.drafts.kinds.DraftKind`)."""
    g = torch.Generator().manual_seed(seed)
    eos = {vocab - 1}
    if bundle is not None:
        target, draft = _stand_ins(bundle, vocab, dim, g)
        yield PolicyContext(vocab, eos, "cpu", bundle, draft, target)
        return
    entry = lookup_kind(kind)
    if entry.stand_in is None:
        raise DynvocabError(f"draft kind '{kind}' offers no stand-in for microbench policy-steps")
    with tempfile.TemporaryDirectory(prefix="dynvocab-policy-step-") as folder:
        rows = torch.randn(min(4096, vocab), dim, generator=g)  # [n, d] a small index: retrieval's cost, not its recall
        path = synthetic_bundle(Path(folder) / "synthetic.safetensors", vocab, rows, g)
        draft = entry.stand_in(vocab, dim, g)
        with load_bundle(path) as synthetic:
            yield PolicyContext(vocab, eos, "cpu", synthetic, draft, _Target(rows))


def synthetic_bundle(path: Path, vocab: int, rows: torch.Tensor, g: torch.Generator) -> Path:
    """Write random tables of demo sizes as a bundle: one stage per registered builder that makes a synthetic one
    (:attr:`~dynvocab.builders.stage_registry.StageBuilder.synthetic`: a frequency ranking, 1,024 clusters with a
    router, a 64-successor graph, an HNSW index over ``rows`` [n, d] standing for the target's head, the
    selectors)."""
    from dynvocab.builders.stages import Synthetic, stage_builders

    spec, made = Synthetic(vocab, rows, g), {}
    for entry in stage_builders():
        if entry.synthetic is not None:
            made[entry.name] = entry.synthetic(spec, made)
    fingerprint = ModelFingerprint(vocab, "synthetic", rows.shape[0], rows.shape[1], "synthetic")
    return write_bundle(path, list(made.values()), fingerprint, None)


def _stand_ins(bundle, vocab: int, dim: int, g: torch.Generator) -> tuple[_Target | None, DraftInfo]:
    """Models with random weights shaped as ``bundle``'s stages expect them: the target's head as its ``hnsw``
    index covers it, the draft's hidden size and embedding as its router reads them, the draft's head rows as its
    ``draft_hnsw`` covers them."""

    def rows(stage: str) -> torch.Tensor:
        params = HnswParams.from_dict(bundle.info(stage)["index"], f"bundle {bundle.path} (stage {stage})")
        return torch.randn(params.num_elements, params.hidden, generator=g)

    router = bundle.config("router") if bundle.has("router") else {"hidden_dim": dim, "embed_dim": dim}
    for stage in ("lowrank", "centroids"):  # a bundle with selectors only: the hidden size they read
        if not bundle.has("router") and bundle.has(stage):
            router = {"hidden_dim": bundle.config(stage)["hidden_dim"], "embed_dim": dim}
    hidden = int(router["hidden_dim"])
    embedding = torch.randn(vocab, int(router["embed_dim"]), generator=g)
    index_rows = rows("draft_hnsw") if bundle.has("draft_hnsw") else None
    head = FloatRows(torch.randn(vocab, hidden, generator=g))  # the draft's own head, as a draft model's
    draft = DraftInfo("stand-in draft model", vocab, hidden, torch.device("cpu"), embedding, head, index_rows=index_rows)
    return (_Target(rows("hnsw")) if bundle.has("hnsw") else None), draft


def policy_rows() -> tuple[str, ...]:
    """The rows ``microbench policy-steps`` times: every registered strategy whose active set follows the context
    (:attr:`~dynvocab.runtime.registry.Strategy.dynamic`), each followed by its variants."""
    rows: list[str] = []
    for entry in strategies():
        if entry.dynamic:
            rows += [entry.name, *(row for row, (base, _) in VARIANTS.items() if base == entry.name)]
    return tuple(rows)


def _policy(row: str, ctx: PolicyContext):
    """The policy of bench row ``row``, built by its strategy's registry factory as ``generate`` builds it."""
    name, options = VARIANTS.get(row, (row, StrategyOptions()))
    return make_policy(name, options, ctx)


def scripted_cycles(ctx: PolicyContext, ranking: torch.Tensor, cycles: int, gamma: int, seed: int) -> list[ScriptedCycle]:
    """A reproducible run of ``cycles`` draft-verify cycles: drafted tokens (mostly frequent ids of ``ranking``),
    the accepted prefix and the next token, target logits [γ+1, V] and hidden states [γ+1, d], the draft's hidden
    states per step and its top alternatives."""
    g = torch.Generator().manual_seed(seed + 1)
    vocab = ctx.vocab_size
    target_dim = ctx.target.weight.shape[1] if ctx.target is not None else ctx.draft.hidden_size
    frequent = ranking[:4096]
    out = []
    for _ in range(cycles):
        pick = torch.randint(frequent.numel(), (gamma + 1,), generator=g)
        tokens = frequent[pick]
        rare = torch.rand(gamma + 1, generator=g) < 0.15
        tokens = torch.where(rare, torch.randint(vocab, (gamma + 1,), generator=g), tokens).tolist()
        accepted = int(torch.randint(gamma + 1, (1,), generator=g))
        logits = torch.randn(gamma + 1, vocab, generator=g)  # [γ+1, V]
        logits[torch.arange(gamma + 1), torch.tensor(tokens)] += 8.0  # the target agrees with the script
        out.append(ScriptedCycle(
            draft_tokens=tokens[:gamma],
            accepted=accepted,
            next_token=tokens[accepted],
            target_logits=logits,
            target_hidden=torch.randn(gamma + 1, target_dim, generator=g),
            draft_hidden=torch.randn(gamma, 1, ctx.draft.hidden_size, generator=g),
            draft_top=[torch.randint(vocab, (3,), generator=g) for _ in range(gamma)],
        ))
    return out


BENCH_SECTIONS = Sections(active="active_s", observe="observe_s")  # active_ids and observe timed apart


def run_policy(policy, script: list[ScriptedCycle], info: DraftInfo, head: DraftHead | None = None,
               prompt: torch.Tensor | None = None, tokens: list[int] | None = None) -> dict:
    """Drive ``policy`` through ``script`` with the loop's own cycle (:func:`~dynvocab.bench.micro.scripted.run_script`)
    after the committed ``tokens`` (default: ``prompt``; they grow in place), a scripted draft reading as ``info``
    does; returns the active sets per step
    (``sets``, lists of sorted ids) and the seconds spent in ``active_ids`` (``active_s``), ``observe``
    (``observe_s``) and the head (``head_s``)."""
    if prompt is not None:
        logits = script[0].target_logits[:1].expand(prompt.numel() - 1, -1) if policy.prefill_logits else None
        policy.prefill(prompt, logits, None)
    if tokens is None:
        tokens = prompt.tolist() if prompt is not None else script[0].draft_tokens[:1]
    times = SimpleNamespace(**{name: 0.0 for name in ("draft_s", "head_s", "active_s", "observe_s", "verify_s")})
    timer = SectionTimer(torch.device("cpu"), True)
    results = run_script(policy, script, tokens, ScriptedDraft(info, head), timer, BENCH_SECTIONS, times)
    sets = [_sorted_ids(active) for r in results for active in r.draft.sets]
    return {"sets": sets, "active_s": times.active_s, "observe_s": times.observe_s, "head_s": times.head_s,
            "steps": len(sets)}


def _sorted_ids(active) -> list[int]:
    return list(range(active.size)) if active.is_full else sorted(active.ids().tolist())


def policy_step_bench(
    bundle=None,
    dtypes: tuple[str, ...] = ("bfloat16", "float32"),
    policies: tuple[str, ...] | None = None,
    cycles: int = 40,
    warmup_cycles: int = 8,
    gamma: int = 6,
    seed: int = 0,
    threads: int | None = None,
    target: dict = DEMO_TARGET,
    kind: str = SYNTHETIC_KIND,
) -> dict:
    """Each policy's own ms per draft step and its head's ms per step, beside the full head (row ``full``) and an
    EAGLE-1 step with a 3k-row head, per dtype of the head's rows (``"int8"``: int8 rows with per-row scales, as an
    int8 draft keeps them) (``policies``: bench rows, default :func:`policy_rows`; ``target``: other shapes, e.g. tiny ones for
    tests; ``kind``: the draft kind whose stand-in the policies read over synthetic tables). Returns ``{"tables", "kind", "target", "cycles", "gamma", "threads", "dtypes": {dtype: {"eagle": {"body_ms",
    "head_ms", "step_ms"}, "policies": {name: {"policy_ms", "active_ms", "observe_ms", "head_ms", "mean_active",
    "share_of_eagle_step", "step_vs_full_head"}}}}}``."""
    policies = policy_rows() if policies is None else policies
    vocab = target["vocab_size"]
    with cpu_threads(threads), bench_context(bundle, vocab, target["hidden_size"], seed, kind) as ctx:
        ranking = FreqTable.from_bundle(ctx.bundle).ranking
        ranking = ranking[ranking < vocab]
        script = scripted_cycles(ctx, ranking, warmup_cycles + cycles, gamma, seed)
        prompt = torch.cat([ranking[:200], ctx.eos])
        out = {"tables": "bundle" if bundle is not None else "synthetic", "kind": ctx.draft.label, "target": target, "cycles": cycles,
               "gamma": gamma, "threads": torch.get_num_threads(), "dtypes": {}}
        for name in dtypes:
            int8 = name == INT8
            dt = torch.float32 if int8 else resolve_dtype(name)  # int8 rows take float32 activations
            eagle = eagle_step_ms(dt, seed=seed, target=target)
            # [V, d] the head an EAGLE-1 draft reads (with a bundle: the width of the draft its tables were built for)
            weight = torch.randn(vocab, ctx.draft.hidden_size).to(dt)
            source = Int8Rows(weight, keep_rows=True) if int8 else weight
            rows = {}
            for p in ("full", *policies):
                policy = _policy(p, ctx)
                head = DraftHead(source)
                tokens = prompt.tolist()
                run_policy(policy, script[:warmup_cycles], ctx.draft, head, prompt, tokens)
                r = run_policy(policy, script[warmup_cycles:], ctx.draft, head, tokens=tokens)
                policy.close()
                steps = max(1, r["steps"])
                policy_ms = 1e3 * (r["active_s"] + r["observe_s"]) / steps
                rows[p] = {
                    "policy_ms": policy_ms,
                    "active_ms": 1e3 * r["active_s"] / steps,
                    "observe_ms": 1e3 * r["observe_s"] / steps,
                    "head_ms": 1e3 * r["head_s"] / steps,
                    "mean_active": sum(len(s) for s in r["sets"]) / steps,
                    "share_of_eagle_step": policy_ms / eagle["step_ms"],
                }
            full_head = rows["full"]["head_ms"]
            for r in rows.values():
                r["step_vs_full_head"] = (r["active_ms"] + r["head_ms"]) / full_head if full_head else None
            out["dtypes"][name] = {"eagle": eagle, "policies": rows}
        return out


def render_policy_table(result: dict):
    """A rich table: per dtype and policy, ms per draft step and the share of a 3k-row EAGLE-1 step."""
    from rich.table import Table

    shape = result["target"]
    table = Table(
        title=f"policy time per draft step · d {shape['hidden_size']:,}, V {shape['vocab_size']:,} · "
              f"{result['tables']} tables · "
              f"γ={result['gamma']} · {result['cycles']} cycles · {result['threads']} threads",
        title_justify="left",
    )
    for col in ("head rows", "policy", "active ids", "policy ms/step", "active_ids", "observe", "head ms/step",
                "selector + head (× full head)", "EAGLE-1 step ms (3k)", "policy / step"):
        table.add_column(col, justify="left" if col in ("dtype", "policy") else "right", no_wrap=True)
    for dtype, res in result["dtypes"].items():
        eagle = res["eagle"]
        for name, r in res["policies"].items():
            table.add_row(
                dtype, name, f"{r['mean_active']:,.0f}", f"{r['policy_ms']:.3f}", f"{r['active_ms']:.3f}",
                f"{r['observe_ms']:.3f}", "–" if r["head_ms"] is None else f"{r['head_ms']:.3f}",
                f"{r['active_ms'] + r['head_ms']:.3f} ({r['step_vs_full_head']:.2f}×)",
                f"{eagle['step_ms']:.2f}", f"{100 * r['share_of_eagle_step']:.1f}%",
            )
    return table
