"""EAGLE heads: the published key layouts written and read back, cached steps, one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch

from dynvocab.errors import DynvocabError
from dynvocab.models.eagle import (
    EAGLE1,
    EAGLE3,
    EagleConfig,
    EagleModel,
    LayerTap,
    check_target,
    config_to_json,
    detect_kind,
    load_eagle,
    read_config,
    save_eagle,
)

pytestmark = pytest.mark.transformers_api  # CI runs it again at transformers' lower bound

V, D = 50, 16


def tiny_config(kind: str, arch: str = "llama", **kw) -> EagleConfig:
    extra = {"draft_vocab_size": 20, "target_hidden_size": 24} if kind == EAGLE3 else {}
    return EagleConfig(
        kind=kind, arch=arch, hidden_size=D, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=V, max_position_embeddings=128, **{**extra, **kw},
    )


def random_head(cfg: EagleConfig, seed: int = 0) -> EagleModel:
    torch.manual_seed(seed)
    model = EagleModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        if cfg.kind == EAGLE3:
            model.set_draft_vocab(torch.randperm(V)[: cfg.draft_vocab].sort().values)
    return model


def test_eagle1_layout_keys(tmp_path):
    model = random_head(tiny_config(EAGLE1, "qwen2"))
    save_eagle(model, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert tuple(f.get_tensor("fc.weight").shape) == (D, 2 * D)
    assert "fc.bias" in keys  # cnets1.py: bias per config, default true
    assert "layers.0.self_attn.q_proj.bias" in keys  # Qwen2 q/k/v biases
    assert not any("input_layernorm" in k for k in keys)
    assert not any(k.startswith(("norm", "lm_head", "embed_tokens")) for k in keys)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["bias"] is True and config["model_type"] == "qwen2"
    assert detect_kind(tmp_path) == EAGLE1


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_eagle3_layout_keys(tmp_path, layout):
    wide = 24 if layout == "eagle3" else D  # speculators reads target_hidden_size == hidden_size only
    model = random_head(tiny_config(EAGLE3, target_hidden_size=wide))
    save_eagle(model, tmp_path, layout=layout, embeddings=False, target_name="tiny")
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    assert state[prefix + "self_attn.q_proj.weight"].shape == (4 * 4, 2 * D)  # 2d-wide attention input
    assert prefix + "hidden_norm.weight" in state and prefix + "input_layernorm.weight" in state
    assert state["fc.weight"].shape == (D, 3 * wide) and "fc.bias" not in state
    assert ("embed_tokens.weight" in state) == (layout == "speculators")  # speculators always gets them
    assert state["lm_head.weight"].shape == (20, D)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 20
    targets = torch.arange(20) + state["d2t"]  # offsets, as SGLang reads them
    assert torch.equal(state["t2d"].nonzero().flatten(), targets)
    config = json.loads((tmp_path / "config.json").read_text())
    if layout == "speculators":
        assert config["speculators_model_type"] == "eagle3" and config["transformer_layer_config"]["hidden_size"] == D
    assert config["draft_vocab_size"] == 20 and config["target_hidden_size"] == wide
    assert detect_kind(tmp_path) == EAGLE3


@pytest.mark.parametrize("kind,layout", [(EAGLE1, "eagle"), (EAGLE3, "eagle3"), (EAGLE3, "speculators")])
def test_round_trip_and_cached_steps(tmp_path, kind, layout):
    cfg = tiny_config(kind, **({"target_hidden_size": D} if layout == "speculators" else {}))
    model = random_head(cfg, seed=3)
    save_eagle(model, tmp_path, layout=layout, target_name="tiny")
    embeddings = model.embed_tokens.weight.detach().clone()
    loaded = load_eagle(tmp_path, embeddings=embeddings)
    assert read_config(tmp_path).kind == kind
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    ids = torch.randint(0, V, (1, 7))
    feats = torch.randn(1, 7, cfg.feature_size)
    pos = torch.arange(7)[None]
    full, head_full = loaded(ids, feats, pos)
    cache = loaded.new_cache()
    a, _ = loaded(ids[:, :4], feats[:, :4], pos[:, :4], cache)
    b, head_b = loaded(ids[:, 4:], feats[:, 4:], pos[:, 4:], cache)
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head_b, head_full[:, 4:], rtol=1e-5, atol=1e-5)
    cache.crop(-4)  # rolls back to 3 positions, like a draft model's cache
    c, _ = loaded(ids[:, 3:], feats[:, 3:], pos[:, 3:], cache)
    torch.testing.assert_close(c, full[:, 3:], rtol=1e-5, atol=1e-5)


def test_model_prefix_and_missing_embeddings(tmp_path):
    cfg = tiny_config(EAGLE1)
    model = random_head(cfg)
    from safetensors.torch import save_file

    state = {"model." + k: v for k, v in model.state_dict().items() if not k.startswith(("embed", "rotary"))}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config_to_json(cfg, "eagle")))
    with pytest.raises(DynvocabError, match="no embed_tokens"):
        load_eagle(tmp_path)
    with pytest.raises(DynvocabError, match=r"\(50, 16\)"):
        load_eagle(tmp_path, embeddings=torch.zeros(60, D))
    loaded = load_eagle(tmp_path, embeddings=model.embed_tokens.weight.detach())
    assert loaded.embed_tokens.weight.data_ptr() == model.embed_tokens.weight.data_ptr()  # shared, not copied


def test_absolute_d2t_is_refused(tmp_path):
    model = random_head(tiny_config(EAGLE3))
    save_eagle(model, tmp_path, embeddings=True)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    state["d2t"] = torch.arange(20) + state["d2t"]  # absolute ids: the silent-misalignment trap
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(DynvocabError, match="d2t"):
        load_eagle(tmp_path)


def test_check_target_one_line():
    cfg = tiny_config(EAGLE3)
    check_target(cfg, 24, V, 6)
    for args, word in (((32, V, 6), "hidden size 24"), ((24, V + 1, 6), f"{V} ids"), ((24, V, 2), "layers")):
        with pytest.raises(DynvocabError, match=word) as err:
            check_target(cfg, *args)
        assert "\n" not in str(err.value)
    explicit = tiny_config(EAGLE3, aux_hidden_states=(1, 2, 4))
    assert explicit.target_layers(4) == (1, 2, 4)  # hidden_states[i]; 4 = the last layer's output
    assert tiny_config(EAGLE3).target_layers(32) == (2, 16, 29)


def test_layer_tap_keeps_inputs():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(
        LlamaConfig(vocab_size=V, hidden_size=24, intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
                    num_key_value_heads=2)
    ).eval()
    tap = LayerTap(target, (2, 2, 5))
    out = target(torch.randint(0, V, (1, 6)), output_hidden_states=True)
    hs = out.hidden_states  # hs[i] enters layer i; hs[5] is normed, so compare the pre-norm one separately
    feats = tap.features()
    assert feats.shape == (6, 72)
    torch.testing.assert_close(feats[:, :24], hs[2][0])
    assert not torch.allclose(feats[:, 48:], hs[5][0])  # the tap is before the final norm
    tap.remove()
