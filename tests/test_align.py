"""EvoSpec's online LoRA alignment: adapter-only updates, exact restoration of the shared draft, the loss."""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from conftest import tiny_qwen2
from dynvocab.errors import DynvocabError
from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate
from dynvocab.runtime.drafts.draft_model import DraftModel
from dynvocab.runtime.drafts.lm import CausalLM
from dynvocab.runtime.drafts.lora_align import AlignConfig, Aligner
from dynvocab.runtime.selection.evospec.evospec import EvoSpecConfig, EvoSpecPolicy

VOCAB = 96
SMALL = AlignConfig(rank=4, alpha=4, buffer_size=2, k_logit=16, context_tokens=16, micro_batch=2)
pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(model: torch.nn.Module) -> dict:
    """Everything close() must give back: module types, parameters (bits), flags, attributes."""
    return {
        "modules": {n: type(m) for n, m in model.named_modules()},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "flags": {n: p.requires_grad for n, p in model.named_parameters()},
        "attrs": set(vars(model)),
        "config": model.config.to_dict(),
    }


def assert_restored(model: torch.nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["modules"] == before["modules"]
    assert after["flags"] == before["flags"] and after["attrs"] == before["attrs"]
    assert after["config"] == before["config"]
    assert after["params"].keys() == before["params"].keys()
    for name, p in before["params"].items():
        assert torch.equal(after["params"][name], p), name
    assert all(p.grad is None for p in model.parameters())


def feed(aligner: Aligner, n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        context = torch.randint(0, VOCAB, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        path = torch.randint(0, VOCAB, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
        aligner.add(context, path, 4 * torch.randn(len(path), VOCAB, generator=g))


def test_updates_change_only_the_adapter_and_close_restores_the_model_exactly():
    model = tiny_qwen2(seed=3)
    lm = CausalLM(model)
    before = snapshot(model)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        logits_before = model(ids).logits
    aligner = Aligner(lm, replace(SMALL, lr=1e-2))
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(".q_proj." in n or ".v_proj." in n for n in lora)
    feed(aligner, 4)  # two buffer fills: two updates
    assert aligner.stats.updates == 2 and aligner.stats.samples == 4 and not aligner.buffer
    now = dict(model.named_parameters())
    assert any(not torch.equal(now[n], p) for n, p in lora.items())  # the adapter learned
    for name, p in before["params"].items():  # base weights untouched (peft renames q_proj.weight)
        base = name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        key = name if name in now else base
        assert torch.equal(now[key], p), name
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, logits_before)  # the adapter is live
    aligner.close()
    assert_restored(model, before)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits_before)
    aligner.close()  # idempotent
    feed(aligner, 2)  # a closed aligner ignores samples
    assert aligner.stats.updates == 2


def test_dropping_an_open_aligner_restores_the_model():
    model = tiny_qwen2(seed=4)
    before = snapshot(model)
    aligner = Aligner(CausalLM(model), SMALL)
    feed(aligner, 2)
    del aligner
    gc.collect()
    assert_restored(model, before)


def test_one_adapter_at_a_time():
    model = tiny_qwen2(seed=5)
    first = Aligner(CausalLM(model), SMALL)
    with pytest.raises(DynvocabError, match="already carries"):
        Aligner(CausalLM(model), SMALL)
    first.close()
    Aligner(CausalLM(model), SMALL).close()


def test_a_large_beta_keeps_only_the_first_position():
    """w_j = exp(−β·L_base·(j−1)): with a huge β the loss is the first position's KL alone."""
    model = tiny_qwen2(seed=6)
    lm = CausalLM(model)
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(3, VOCAB, generator=g)
    losses = {}
    for beta, path in ((1e6, [5, 6, 7]), (0.0, [5])):
        aligner = Aligner(lm, replace(SMALL, beta=beta, buffer_size=10))
        aligner.add([1, 2, 3], path, logits)
        with torch.no_grad():
            losses[beta] = float(aligner.loss(aligner.buffer))
        aligner.close()
    assert losses[1e6] == pytest.approx(losses[0.0], rel=1e-5)
    aligner = Aligner(lm, replace(SMALL, beta=0.0, buffer_size=10))
    aligner.add([1, 2, 3], [5, 6, 7], logits)
    with torch.no_grad():
        assert float(aligner.loss(aligner.buffer)) > losses[0.0]  # β = 0 sums every position
    aligner.close()


def test_the_loss_goes_down_on_a_fixed_buffer():
    lm = CausalLM(tiny_qwen2(seed=7))
    aligner = Aligner(lm, replace(SMALL, lr=3e-3, buffer_size=100))
    feed(aligner, 4, seed=1)
    samples = list(aligner.buffer)
    first = []
    for _ in range(8):
        aligner.buffer = list(samples)
        first.append(aligner.update())
    aligner.close()
    assert first[-1] < first[0]


@pytest.mark.parametrize("seed", range(3))
def test_online_alignment_keeps_greedy_lossless_and_leaves_the_shared_draft_as_it_was(tiny_pair, seed):
    from test_evospec import random_graph

    from dynvocab.builders import hnsw as hnsw_builder

    target_model, draft_model = tiny_pair
    target, draft = CausalLM(target_model), DraftModel(draft_model)
    before = snapshot(draft_model)
    index = hnsw_builder.build_index(hnsw_builder.HnswConfig(m=8, ef_construction=32, num_threads=1), target.weight)
    ranking = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    cfg = EvoSpecConfig(
        static_size=88, dynamic_size=4, min_residency=2, synchronous=bool(seed % 2), online_align=True,
        align=replace(SMALL, lr=1e-2, buffer_size=1),
    )
    prompt = [3 + seed, 1, 4, 1, 5]
    decode = DecodeConfig(gamma=3, max_new_tokens=40, stop_below=0.0, branch_below=0.0)  # chains that miss
    ar = speculative_generate(target, prompt, decode, set())
    with EvoSpecPolicy(cfg, ranking[:88], index, random_graph(), VOCAB, draft=draft) as policy:
        spec = speculative_generate(target, prompt, decode, set(), draft, policy)
        assert policy.aligner.stats.updates > 0  # the adapter really changed the draft mid-generation
        assert "align" in policy.summary()
    assert spec.token_ids == ar.token_ids
    assert_restored(draft_model, before)


def update_state_bytes(trainable: str) -> dict:
    """What one alignment update in mode ``trainable`` keeps beside the draft: the number of trainable ``params``,
    their ``grads`` and AdamW's state (``optimizer``) in bytes. The full modes write the model: a throwaway here."""
    aligner = Aligner(CausalLM(tiny_qwen2(seed=8)), replace(SMALL, buffer_size=4), trainable)
    try:
        feed(aligner, 4)  # one full buffer: one update
        assert aligner.stats.updates == 1
        state = aligner.optimizer.state.values()
        optimizer = sum(t.numel() * t.element_size() for st in state for t in st.values() if torch.is_tensor(t))
        return {"params": sum(p.numel() for p in aligner.params), "grads": aligner.grad_bytes, "optimizer": optimizer}
    finally:
        aligner.close()


def test_a_lora_update_keeps_less_state_than_full_updates():
    state = {mode: update_state_bytes(mode) for mode in ("lora", "full-qv", "full")}
    assert state["lora"]["params"] < state["full-qv"]["params"] < state["full"]["params"]
    for s in state.values():
        assert 0 < s["grads"] <= 4 * s["params"]  # float32 gradients (a parameter the loss misses has none)
        assert s["optimizer"] >= 2 * s["grads"]  # AdamW's two moments
    total = {mode: s["grads"] + s["optimizer"] for mode, s in state.items()}
    assert total["lora"] < total["full-qv"] < total["full"]


def test_a_bfloat16_draft_gets_a_float32_adapter_and_is_restored():
    model = tiny_qwen2(seed=9).to(torch.bfloat16)
    before = snapshot(model)
    aligner = Aligner(CausalLM(model), SMALL)
    assert aligner.params and all(p.dtype == torch.float32 for p in aligner.params)  # 1e-5 steps survive
    feed(aligner, 2)
    assert aligner.stats.updates == 1
    with torch.inference_mode():
        assert CausalLM(model).step(torch.tensor([1, 2, 3])).dtype == torch.bfloat16
    aligner.close()
    assert_restored(model, before)
