"""The EAGLE checkpoint layout registry: a toy layout defined here (one class, one registry entry) is written,
recognised, read back, converted to a published layout and run by ``generate`` and ``train-draft --format`` with
no other edit; every built-in layout reads back what it writes; the registry is left as it was found."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, replace

import pytest
import torch
from cli_helpers import run
from conftest import random_eagle3
from safetensors.torch import load_file

from dynvocab.builders.draft.config import TrainDraftConfig, check_config
from dynvocab.errors import DynvocabError
from dynvocab.models.eagle import (
    EAGLE1,
    EAGLE3,
    EagleConfig,
    EagleModel,
    config_like,
    detect_kind,
    load_eagle,
    read_config,
    read_layout,
    save_eagle,
)
from dynvocab.models.eagle import layouts as registry
from dynvocab.models.eagle.layouts import Layout, Names, eagle3_fields

pytestmark = [pytest.mark.transformers_api, pytest.mark.usefixtures("one_thread")]

PROMPT = "w1 w2 w3 w4 w5 w1 w2"


@dataclass(frozen=True)
class ToyLayout(Layout):
    """EAGLE-3 heads with the decoder layer's fields nested under ``decoder``, a ``toy_layout`` mark, the layer's
    tensors under ``block.`` and the head's under ``head.``, and layer ids that name the output of layer i."""

    def recognize(self, config: dict, names: Names) -> bool:
        return config.get("toy_layout") == 1

    def layer_of(self, config: dict) -> dict:
        return config["decoder"]

    def config_json(self, cfg: EagleConfig, layer: dict, target_name: str | None) -> dict:
        return {"toy_layout": 1, "decoder": layer, **eagle3_fields(cfg, self)}


TOY = ToyLayout(
    "toy", EAGLE3, family="toy", priority=40, aux_offset=1, aux_means="the output of layer i",
    renames_in=(("block.", "midlayer."), ("head.", "lm_head.")), renames_out=(("midlayer.", "block."), ("lm_head.", "head.")),
    help="a toy EAGLE-3 layout (tests only)",
)


@contextlib.contextmanager
def registered(layout: Layout):
    """``layout`` in the registry inside the block only; the registry is as it was afterwards."""
    before = registry.layout_names()
    registry.register(layout)
    try:
        yield layout
    finally:
        registry.unregister(layout.name)
    assert registry.layout_names() == before


@pytest.fixture
def toy():
    """The toy layout, registered for one test."""
    with registered(TOY):
        yield TOY


def tiny_eagle3(**kw) -> EagleModel:
    cfg = EagleConfig(kind=EAGLE3, hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=50, max_position_embeddings=128, draft_vocab_size=25, target_hidden_size=16, **kw)
    return random_eagle3(cfg)


def resolved(cfg: EagleConfig) -> EagleConfig:
    """``cfg`` with its fc bias as written out (a layout may leave the default implicit)."""
    return replace(cfg, fc_bias=cfg.has_fc_bias)


def assert_same_head(a: EagleModel, b: EagleModel) -> None:
    assert resolved(a.config) == resolved(b.config)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name


def test_a_toy_layout_round_trips_through_the_registry(toy, tmp_path):
    model = tiny_eagle3(aux_hidden_states=(1, 2, 4))
    save_eagle(model, tmp_path / "toy", layout="toy", embeddings=True)
    config = json.loads((tmp_path / "toy" / "config.json").read_text())
    assert config["toy_layout"] == 1 and config["decoder"]["hidden_size"] == 16
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]  # the output of layer i = hidden_states[i + 1]
    names = set(load_file(str(tmp_path / "toy" / "model.safetensors")))
    assert "block.self_attn.q_proj.weight" in names and "head.weight" in names
    assert not any(n.startswith(("midlayer.", "lm_head.")) for n in names)
    assert read_layout(tmp_path / "toy") is toy and detect_kind(tmp_path / "toy") == EAGLE3
    assert resolved(read_config(tmp_path / "toy")) == resolved(model.config)
    assert_same_head(model, load_eagle(tmp_path / "toy"))
    # converted to a published layout, the head keeps its layers (and back)
    save_eagle(load_eagle(tmp_path / "toy"), tmp_path / "spec", layout="speculators", target_name="t")
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert read_config(tmp_path / "spec").target_layers(8) == (1, 2, 4)
    with pytest.raises(DynvocabError, match=r"hidden_states\[0\].*write it as speculators"):
        save_eagle(tiny_eagle3(aux_hidden_states=(0, 2, 4)), tmp_path / "bad", layout="toy")
    with pytest.raises(DynvocabError, match="layout 'toy' holds EAGLE-3 heads; write an EAGLE-1/2 head as eagle"):
        save_eagle(EagleModel(config_like(load_eagle(tmp_path / "toy").layer_config, EAGLE1)), tmp_path / "e1", layout="toy")


def test_without_the_entry_the_toy_folder_is_refused(tmp_path):
    with registered(TOY):
        save_eagle(tiny_eagle3(), tmp_path, layout="toy", embeddings=True)
    assert read_layout(tmp_path).name == "eagle3"  # its fc and d2t look like one; its config does not read as one
    with pytest.raises(DynvocabError, match="lacks or garbles field"):
        load_eagle(tmp_path)
    with pytest.raises(DynvocabError, match="unknown EAGLE layout 'toy'; use one of eagle, eagle3, speculators"):
        save_eagle(tiny_eagle3(), tmp_path, layout="toy")


def test_generate_runs_a_head_in_the_toy_layout(toy, tiny_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"], dtype=torch.float32).eval()
    cfg = config_like(target.config, EAGLE3, draft_vocab_size=48, aux_hidden_states=(1, 1, 2))
    head = save_eagle(random_eagle3(cfg), tmp_path / "toy", layout="toy", embeddings=True)

    def generate(strategy: str) -> tuple[list[int], int]:
        result = run("generate", PROMPT, "--target", tiny_dirs["target"], "--draft", head, "--no-chat-template",
                     "--quiet", "--dtype", "float32", "--strategy", strategy, "--max-new-tokens", 16, "--json")
        assert result.exit_code == 0, result.output
        out = json.loads(result.output.strip().splitlines()[-1])
        return out["token_ids"], out["metrics"]["cycles"]

    ar, _ = generate("ar")
    full, cycles = generate("full")
    assert full == ar and cycles > 0  # the head drafted, and the output is the target's


def test_train_draft_takes_the_toy_family(toy):
    check_config(TrainDraftConfig(arch="eagle3", layout="toy"))
    with pytest.raises(DynvocabError, match="--format toy holds EAGLE-3 heads; use --arch eagle3 or --format eagle"):
        check_config(TrainDraftConfig(arch="eagle1", layout="toy"))
    with pytest.raises(DynvocabError, match="use eagle or speculators or toy"):
        check_config(TrainDraftConfig(layout="sglang"))


@pytest.mark.parametrize("name", ["eagle", "eagle3", "speculators"])
def test_every_built_in_layout_reads_what_it_writes(tmp_path, name):
    layout = registry.lookup_layout(name)
    if layout.kind == EAGLE1:
        model = EagleModel(EagleConfig(kind=EAGLE1, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=50, max_position_embeddings=128))
    else:
        model = tiny_eagle3(aux_hidden_states=(1, 2, 4))
    save_eagle(model, tmp_path, layout=name, embeddings=True, target_name="t")
    assert read_layout(tmp_path) is layout
    assert_same_head(model, load_eagle(tmp_path))


def test_registry_refusals():
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.lookup_layout("eagle3"))
    with pytest.raises(DynvocabError, match="unknown EAGLE layout 'sglang'"):
        registry.lookup_layout("sglang")
    assert registry.families() == ("eagle", "speculators")
    assert registry.layout_for("eagle", EAGLE3).name == "eagle3" and registry.layout_for("speculators", EAGLE1) is None
