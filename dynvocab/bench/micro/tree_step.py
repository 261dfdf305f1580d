"""EAGLE-2 tree cycles on random weights at a target's shape: time per cycle (growth, head, verification) for each
tree shape and active set beside the chain, and the host reads each cycle makes (``gpu_check``'s ``tree_step``).

A random target (from a transformers config: nothing is downloaded) and a random EAGLE-1 head for it decode
``cycles`` tokens after ``context`` random ones through the one loop
(:func:`~dynvocab.runtime.decoding.loop.speculative_generate`, section times on: CUDA events on a GPU), once per shape
and set. Random weights accept nearly nothing, so each cycle grows the whole tree and verifies all of it: the figures
are the cost of a cycle, not its yield. The reads are counted by :class:`~dynvocab.runtime.host.HostReads`: a tree
cycle reads once after its growth (``grow_tree``) and once for its verdict, nothing inside the draft loop.
"""

from __future__ import annotations

import torch

from dynvocab.bench.micro.timing import resolve_dtype
from dynvocab.runtime.host import HostReads

GEMMA3_270M_TEXT = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                        sliding_window=512, final_logit_softcapping=None)


def _random_pair(target_cfg: dict, device: torch.device, dtype: torch.dtype, seed: int):
    """A random Gemma-3 text target of ``target_cfg`` and a random EAGLE-1 head for it, as the loop drives them."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from dynvocab.models.eagle import EAGLE1, EagleModel, config_like
    from dynvocab.runtime.drafts.eagle_draft import Eagle1Draft
    from dynvocab.runtime.drafts.lm import CausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**target_cfg)).to(device, dtype).eval()
    target = CausalLM(model)
    head = EagleModel(config_like(model.config, EAGLE1)).to(device, dtype).eval().pair_with(model)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    return target, Eagle1Draft(head, target)


def tree_step_bench(target_cfg: dict, device: str = "cpu", dtype: str = "float32", shapes=("4x4x16",),
                    sets=(None, 1024), context: int = 128, cycles: int = 8, seed: int = 0) -> dict:
    """Per set (None: the full head; K: a static K-id prefix, ``fr``'s kind) and per tree shape (and ``off``,
    the chain), ms per cycle of growth, head and verification, tokens verified per cycle, and the host reads by
    helper and elsewhere. Returns a JSON-ready dict."""
    from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
    from dynvocab.runtime.selection import FullPolicy, SelectorPolicy
    from dynvocab.runtime.selection.frequency import StaticSelector

    dev, dt = torch.device(device), resolve_dtype(dtype)
    target, draft = _random_pair(target_cfg, dev, dt, seed)
    vocab = target.vocab_size
    prompt = torch.randint(vocab, (context,), generator=torch.Generator().manual_seed(seed)).tolist()
    ranking = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 1)).to(dev)
    out = {"device": str(dev), "dtype": str(dt).replace("torch.", ""), "vocab": vocab, "context": context,
           "cycles": cycles, "rows": []}
    for size in sets:
        for tree in ("off", *shapes):
            def policy():
                return FullPolicy(vocab) if size is None else SelectorPolicy(StaticSelector(ranking[:size]))

            cfg = DecodeConfig(max_new_tokens=cycles + 8, tree=tree, stop_below=0.0, branch_below=0.0)
            speculative_generate(target, prompt, cfg, set(), draft, policy())  # warm-up
            with HostReads() as reads:
                g = speculative_generate(target, prompt, cfg, set(), draft, policy(), timing=True)
            m = g.metrics
            per = 1e3 / max(m.cycles, 1)
            out["rows"].append({
                "set": "full" if size is None else size, "tree": tree, "cycles": m.cycles,
                "draft_ms": round(m.draft_s * per, 3), "head_ms": round(m.head_s * per, 3),
                "verify_ms": round(m.verify_s * per, 3),
                "tokens_verified": round(m.tree_tokens / m.tree_cycles, 2) if m.tree_cycles else None,
                "head_calls": round(m.draft_steps / max(m.cycles, 1), 2), "reads": dict(reads.helper),
                "reads_elsewhere": {k: v for k, v in reads.elsewhere.items()},
            })
    return out
