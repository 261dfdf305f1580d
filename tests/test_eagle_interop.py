"""EAGLE-3 heads across layouts: aux layer ids per layout, what the speculators writer holds or refuses, and the
speculators options the loader runs (norm_before_fc, fc_norm, norm_output, sliding window, Qwen3 layer, full
vocabulary without d2t). speculators' own code is run against ours by scripts/speculators_roundtrip.py
(docs/interop.md); these tests use tiny random heads only."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from dynvocab.errors import DynvocabError
from dynvocab.models.eagle import EAGLE1, EAGLE3, EagleConfig, EagleModel, config_to_json, load_eagle, read_config, save_eagle

pytestmark = pytest.mark.transformers_api  # CI runs it again at transformers' lower bound

V, D, K = 60, 16, 24


def head(seed: int = 0, **kw) -> EagleModel:
    cfg = EagleConfig(
        kind=EAGLE3, hidden_size=D, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
        max_position_embeddings=128, **{"draft_vocab_size": K, **kw},
    )
    torch.manual_seed(seed)
    model = EagleModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        model.set_draft_vocab(torch.randperm(V)[: cfg.draft_vocab].sort().values)
    return model


def run(model: EagleModel, n: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (1, n), generator=g)
    feats = torch.randn(1, n, model.config.feature_size, generator=g)
    return ids, feats, model(ids, feats, torch.arange(n)[None])


def test_aux_ids_are_written_and_read_per_layout(tmp_path):
    model = head(aux_hidden_states=(1, 4, 8))
    ids = {}
    for layout in ("eagle3", "speculators"):
        save_eagle(model, tmp_path / layout, layout=layout, embeddings=True, target_name="t")
        ids[layout] = json.loads((tmp_path / layout / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
        assert read_config(tmp_path / layout).target_layers(8) == (1, 4, 8)
    assert ids == {"eagle3": [0, 3, 7], "speculators": [1, 4, 8]}  # SGLang: output of layer i; vLLM: hidden_states[i]
    converted = load_eagle(tmp_path / "eagle3")  # an SGLang head written again as speculators keeps its layers
    save_eagle(converted, tmp_path / "back", layout="speculators", target_name="t")
    assert read_config(tmp_path / "back").target_layers(8) == (1, 4, 8)
    with pytest.raises(DynvocabError, match=r"hidden_states\[0\]"):
        config_to_json(head(aux_hidden_states=(0, 4, 8)).config, "eagle3")


def test_speculators_resolved_ids_are_hidden_state_indices(tmp_path):
    """speculators writes the resolved defaults, e.g. [2, 4, 5] for 8 layers: hidden_states[2], [4], [5]."""
    save_eagle(head(), tmp_path, layout="speculators", target_name="t")
    config = json.loads((tmp_path / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_config(tmp_path).target_layers(8) == (2, 4, 5)


def test_speculators_writer_holds_embeddings_and_verifier(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    save_eagle(head(), tmp_path / "h", layout="speculators", target_name=str(target))
    state = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert "embed_tokens.weight" in state and "fc.bias" not in state
    verifier = json.loads((tmp_path / "h" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(target), "architectures": ["Qwen2ForCausalLM"]}


@pytest.mark.parametrize(
    "model,target,word",
    [
        (head(fc_bias=True), "t", "fc.bias"),
        (head(target_hidden_size=24), "t", "target_hidden_size"),
        (head(), None, "verifier"),
    ],
)
def test_speculators_writer_refuses_what_speculators_drops(tmp_path, model, target, word):
    with pytest.raises(DynvocabError, match=word) as err:
        save_eagle(model, tmp_path, layout="speculators", target_name=target)
    assert "\n" not in str(err.value)


def test_full_vocabulary_head_without_d2t(tmp_path):
    model = head(draft_vocab_size=V)
    with torch.no_grad():
        model.set_draft_vocab(torch.arange(V))
    save_eagle(model, tmp_path, layout="speculators", target_name="t")
    state = load_file(str(tmp_path / "model.safetensors"))
    assert "d2t" not in state and "t2d" not in state  # as speculators saves one
    loaded = load_eagle(tmp_path)
    assert torch.equal(loaded.draft_to_target(), torch.arange(V)) and bool(loaded.t2d.all())


@pytest.mark.parametrize("option", ["norm_before_fc", "fc_norm", "norm_output"])
def test_speculators_options_round_trip_and_run(tmp_path, option):
    model = head(**{option: True})
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1 so that they matter
            p.normal_(0, 0.3)
    save_eagle(model, tmp_path, layout="speculators", target_name="t")
    loaded = load_eagle(tmp_path)
    assert getattr(loaded.config, option)
    ids, feats, (feature, head_in) = run(loaded)
    x = feats
    if option == "norm_before_fc":
        x = loaded.input_norm(feats)  # speculators core.py: input_norm over cat(h_low, h_mid, h_high)
    elif option == "fc_norm":
        x = torch.cat([n(c) for n, c in zip(loaded.fc_norm, feats.chunk(3, dim=-1))], dim=-1)
    plain = replace(loaded.config, norm_before_fc=False, fc_norm=False, norm_output=False)
    ref = EagleModel(plain).eval()
    ref.load_state_dict({k: v for k, v in loaded.state_dict().items() if not k.startswith(("input_norm", "fc_norm"))})
    f_ref, h_ref = ref(ids, ref.fc(x), torch.arange(ids.shape[1])[None])
    torch.testing.assert_close(head_in, h_ref)
    torch.testing.assert_close(feature, h_ref if option == "norm_output" else f_ref)  # norm_output feeds back normed


def test_sliding_window_limits_attention_and_caches(tmp_path):
    model = head(sliding_window=3)
    save_eagle(model, tmp_path, layout="speculators", target_name="t")
    loaded = load_eagle(tmp_path)
    assert loaded.config.sliding_window == 3
    ids, feats, (full, _) = run(loaded, n=8)
    changed = feats.clone()
    changed[:, :4] += 1.0  # positions 0..3 are outside the window of position 7 (it sees 5, 6, 7)
    other, _ = loaded(ids, changed, torch.arange(8)[None])
    torch.testing.assert_close(other[:, 7], full[:, 7])
    assert not torch.allclose(other[:, 4], full[:, 4])
    cache = loaded.new_cache()
    a, _ = loaded(ids[:, :5], feats[:, :5], torch.arange(5)[None], cache)
    b, _ = loaded(ids[:, 5:], feats[:, 5:], torch.arange(5, 8)[None], cache)
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-5, atol=1e-5)


def test_qwen3_layer_round_trips(tmp_path):
    model = head(arch="qwen3")
    save_eagle(model, tmp_path, layout="speculators", target_name="t")
    state = load_file(str(tmp_path / "model.safetensors"))
    assert "layers.0.self_attn.q_norm.weight" in state and "layers.0.self_attn.k_norm.weight" in state
    loaded = load_eagle(tmp_path)
    assert loaded.config.arch == "qwen3"
    _, _, (a, _) = run(model)
    _, _, (b, _) = run(loaded)
    torch.testing.assert_close(a, b)
    with pytest.raises(DynvocabError, match="qwen3 layer"):
        save_eagle(model, tmp_path / "e", layout="eagle3")


@pytest.mark.parametrize(
    "edit,word",
    [
        ({"num_hidden_layers": 2}, "num_hidden_layers"),
        ({"model_type": "qwen2"}, "model_type 'qwen2'"),
    ],
)
def test_speculators_heads_we_cannot_run_are_refused(tmp_path, edit, word):
    save_eagle(head(), tmp_path, layout="speculators", target_name="t")
    config = json.loads((tmp_path / "config.json").read_text())
    config["transformer_layer_config"].update(edit)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DynvocabError, match=word) as err:
        read_config(tmp_path)
    assert "\n" not in str(err.value)


def test_eagle_repo_qwen2_form_reads_as_cnets1(tmp_path):
    """cnets1.py: a llama config with ``qkv_bias`` builds q/k/v with biases (o_proj without): a Qwen2 layer."""
    cfg = EagleConfig(kind=EAGLE1, arch="qwen2", hidden_size=D, intermediate_size=32, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=128)
    torch.manual_seed(0)
    model = EagleModel(cfg).eval()
    save_eagle(model, tmp_path, embeddings=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"], qkv_bias=True)  # the EAGLE repo's form
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = load_file(str(tmp_path / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.bias" in state and "layers.0.self_attn.o_proj.bias" not in state
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_eagle(tmp_path)
    assert loaded.config.arch == "qwen2"
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
