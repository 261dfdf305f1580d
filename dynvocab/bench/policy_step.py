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

Tables: the bundle's (``freq``, ``clusters``, ``router``, ``hnsw``, ``graph``, ``draft_hnsw``) when one is given,
else synthetic ones of demo sizes (a random frequency ranking, 1,024 random clusters with a random router, a
64-successor random graph, and an HNSW index over 4,096 random rows for retrieval). Cycles draw drafted tokens
mostly from the 4k most frequent ids and accept a random prefix, so sets change as they do in a run.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from dynvocab.bench.timing import CacheFlusher, cpu_threads, resolve_dtype, time_ms
from dynvocab.runtime.head import DraftHead
from dynvocab.runtime.policies.base import CycleReport

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
# "hybrid-nosearch": the hybrid without its per-step draft-head HNSW search (its default on GPUs)
POLICIES = ("microspec", "hybrid", "hybrid-nosearch", "dynaspec", "evospec")
HEAD_ROWS = 3072


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


class _Tables:
    """What the policies are built from: a bundle's tables or synthetic ones of demo sizes."""

    def __init__(self, bundle, vocab: int, dim: int, dtype: torch.dtype, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.eos = torch.tensor([vocab - 1])
        if bundle is not None:
            self._from_bundle(bundle, dtype, g)
        else:
            self._synthetic(vocab, dim, dtype, g)

    def _from_bundle(self, bundle, dtype: torch.dtype, g: torch.Generator) -> None:
        from dynvocab.artifacts import ClusterTable, FreqTable, GraphTable, load_hnsw
        from dynvocab.artifacts.router import RouterTable

        self.ranking = FreqTable.from_bundle(bundle).ranking
        self.graph = GraphTable.from_bundle(bundle)
        self.hnsw = load_hnsw(bundle)[0]
        self.draft_hnsw = load_hnsw(bundle, "draft_hnsw")[0] if bundle.has("draft_hnsw") else None
        self.clusters = ClusterTable.from_bundle(bundle)
        self.router = RouterTable.from_bundle(bundle)
        dim = int(self.router.config["hidden_dim"])
        self.draft_dim = dim
        self.embedding = torch.randn(self.vocab, int(self.router.config["embed_dim"]), generator=g).to(dtype)
        self.target_dim = int(self.hnsw.params.dim) - 1

    def _synthetic(self, vocab: int, dim: int, dtype: torch.dtype, g: torch.Generator) -> None:
        from dynvocab.artifacts import ClusterTable, GraphTable
        from dynvocab.artifacts.router import RouterMLP, RouterTable
        from dynvocab.builders.hnsw import HnswConfig, build_index

        self.ranking = torch.randperm(vocab, generator=g)
        fanout = 64
        self.graph = GraphTable(
            torch.arange(0, (vocab + 1) * fanout, fanout, dtype=torch.long),
            torch.randint(vocab, (vocab * fanout,), generator=g, dtype=torch.int32),
            torch.full((vocab * fanout,), 1.0 / fanout),
        )
        rows = torch.randn(min(4096, vocab), dim, generator=g)  # [n, d] a small index: retrieval's cost, not its recall
        self.hnsw = build_index(HnswConfig(m=8, ef_construction=32, ef_search=64), rows)
        self.draft_hnsw = self.hnsw
        m = 1024
        assign = torch.randint(m, (vocab,), generator=g)
        self.clusters = ClusterTable(assign, F.normalize(torch.randn(m, dim, generator=g), dim=-1))
        mlp = RouterMLP(dim, dim, 128, m)
        config = {"hidden_dim": dim, "embed_dim": dim, "width": 128, "num_clusters": m}
        self.router = RouterTable.from_module(mlp, config)
        self.embedding = torch.randn(vocab, dim, generator=g).to(dtype)
        self.draft_dim = self.target_dim = dim


def _policy(name: str, t: _Tables):
    from dynvocab.runtime.policies.dynaspec import DynaSpecConfig, DynaSpecPolicy
    from dynvocab.runtime.policies.evospec import EvoSpecConfig, EvoSpecPolicy
    from dynvocab.runtime.policies.hybrid import HybridConfig, HybridPolicy
    from dynvocab.runtime.policies.microspec import MicroSpecConfig, MicroSpecPolicy

    if name == "microspec":
        return MicroSpecPolicy(MicroSpecConfig(), t.vocab, "cpu", pinned=t.eos)
    if name in ("hybrid", "hybrid-nosearch"):
        search = name == "hybrid"
        return HybridPolicy(HybridConfig(), t.vocab, "cpu", t.ranking, pinned=t.eos, graph=t.graph, hnsw=t.hnsw,
                            draft_hnsw=t.draft_hnsw if search else None)
    if name == "dynaspec":
        return DynaSpecPolicy(DynaSpecConfig(), t.clusters, t.router, t.embedding, t.vocab, t.eos)
    if name == "evospec":
        ranking = t.ranking[: EvoSpecConfig.static_size]
        core = torch.cat([ranking, t.eos[~torch.isin(t.eos, ranking)]])  # as EvoSpecPolicy.from_context builds it
        return EvoSpecPolicy(EvoSpecConfig(), core, t.hnsw, t.graph, t.vocab)
    raise ValueError(f"unknown policy {name!r}; known: {POLICIES}")


def scripted_cycles(t: _Tables, cycles: int, gamma: int, seed: int) -> list[dict]:
    """A reproducible run of ``cycles`` draft-verify cycles: drafted tokens (mostly frequent ids), the accepted
    prefix, target logits [γ+1, V] and hidden states [γ+1, d], the draft's hidden states per step."""
    g = torch.Generator().manual_seed(seed + 1)
    frequent = t.ranking[:4096]
    out = []
    for c in range(cycles):
        pick = torch.randint(frequent.numel(), (gamma + 1,), generator=g)
        tokens = frequent[pick]
        rare = torch.rand(gamma + 1, generator=g) < 0.15
        tokens = torch.where(rare, torch.randint(t.vocab, (gamma + 1,), generator=g), tokens).tolist()
        accepted = int(torch.randint(gamma + 1, (1,), generator=g))
        logits = torch.randn(gamma + 1, t.vocab, generator=g)  # [γ+1, V]
        logits[torch.arange(gamma + 1), torch.tensor(tokens)] += 8.0  # the target agrees with the script
        out.append({
            "position": 64 + c * gamma,
            "draft_tokens": tokens[:gamma],
            "accepted": accepted,
            "emitted": tokens[: accepted + 1],
            "target_logits": logits,
            "target_hidden": torch.randn(gamma + 1, t.target_dim, generator=g),
            "draft_hidden": torch.randn(gamma, 1, t.draft_dim, generator=g),
            "draft_top": [torch.randint(t.vocab, (3,), generator=g) for _ in range(gamma)],
        })
    return out


def run_policy(policy, script: list[dict], head: DraftHead | None = None, prompt: torch.Tensor | None = None) -> dict:
    """Drive ``policy`` through ``script``; returns the active sets per step (``sets``, lists of sorted ids) and
    the seconds spent in ``active_ids`` (``active_s``), ``observe`` (``observe_s``) and the head (``head_s``)."""
    if prompt is not None:
        logits = script[0]["target_logits"][:1].expand(prompt.numel() - 1, -1) if policy.prefill_logits else None
        policy.prefill(prompt, logits, None)
    sets, active_s, observe_s, head_s, steps = [], 0.0, 0.0, 0.0, 0
    for cyc in script:
        tops, cycle_sets = [], []
        for j in range(len(cyc["draft_tokens"])):
            fed = cyc["draft_tokens"][j - 1] if j else cyc["emitted"][0]
            hidden = cyc["draft_hidden"][j]  # [1, d]
            t0 = time.perf_counter()
            ids = policy.active_ids(j, hidden, fed)
            t1 = time.perf_counter()
            if head is not None:
                head.logits(hidden, ids)
            head_s += time.perf_counter() - t1
            active_s += t1 - t0
            sets.append(_sorted_ids(ids))
            cycle_sets.append(ids)
            tops.append(cyc["draft_top"][j])
            steps += 1
        report = CycleReport(cyc["position"], cyc["draft_tokens"], tops if policy.draft_topk else [],
                             cyc["accepted"], cyc["emitted"], cyc["target_logits"], cyc["target_hidden"], cycle_sets)
        t0 = time.perf_counter()
        policy.observe(report)
        observe_s += time.perf_counter() - t0
    return {"sets": sets, "active_s": active_s, "observe_s": observe_s, "head_s": head_s, "steps": steps}


def _sorted_ids(active) -> list[int]:
    return [] if active.is_full else sorted(active.ids().tolist())


def policy_step_bench(
    bundle=None,
    dtypes: tuple[str, ...] = ("bfloat16", "float32"),
    policies: tuple[str, ...] = POLICIES,
    cycles: int = 40,
    warmup_cycles: int = 8,
    gamma: int = 6,
    seed: int = 0,
    threads: int | None = None,
    target: dict = DEMO_TARGET,
) -> dict:
    """Each policy's own ms per draft step and its head's ms per step, beside an EAGLE-1 step with a 3k-row head,
    per dtype (``target``: other shapes, e.g. tiny ones for tests). Returns ``{"tables", "target", "cycles",
    "gamma", "threads", "dtypes": {dtype: {"eagle": {"body_ms", "head_ms", "step_ms"}, "policies": {name:
    {"policy_ms", "active_ms", "observe_ms", "head_ms", "mean_active", "share_of_eagle_step"}}}}}``."""
    with cpu_threads(threads):
        tables = _Tables(bundle, target["vocab_size"], target["hidden_size"], torch.float32, seed)
        script = scripted_cycles(tables, warmup_cycles + cycles, gamma, seed)
        prompt = torch.cat([tables.ranking[:200], tables.eos])
        out = {"tables": "bundle" if bundle is not None else "synthetic", "target": target, "cycles": cycles,
               "gamma": gamma, "threads": torch.get_num_threads(), "dtypes": {}}
        for name in dtypes:
            dt = resolve_dtype(name)
            eagle = eagle_step_ms(dt, seed=seed, target=target)
            # [V, d] the head an EAGLE-1 draft reads (with a bundle: the width of the draft its tables were built for)
            weight = torch.randn(tables.vocab, tables.draft_dim).to(dt)
            rows = {}
            for p in policies:
                policy = _policy(p, tables)
                head = DraftHead(weight)
                run_policy(policy, script[:warmup_cycles], head, prompt)
                r = run_policy(policy, script[warmup_cycles:], head)
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
    for col in ("dtype", "policy", "active ids", "policy ms/step", "active_ids", "observe", "head ms/step",
                "EAGLE-1 step ms (3k)", "policy / step"):
        table.add_column(col, justify="left" if col in ("dtype", "policy") else "right", no_wrap=True)
    for dtype, res in result["dtypes"].items():
        eagle = res["eagle"]
        for name, r in res["policies"].items():
            table.add_row(
                dtype, name, f"{r['mean_active']:,.0f}", f"{r['policy_ms']:.3f}", f"{r['active_ms']:.3f}",
                f"{r['observe_ms']:.3f}", "–" if r["head_ms"] is None else f"{r['head_ms']:.3f}",
                f"{eagle['step_ms']:.2f}", f"{100 * r['share_of_eagle_step']:.1f}%",
            )
    return table
