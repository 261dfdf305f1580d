"""EAGLE checkpoints in the three published layouts, read and written (see :mod:`dynvocab.models.eagle`).

- ``eagle``: the EAGLE repo's EAGLE-1/2 form (SGLang reads it too; a Qwen2 layer keeps its q/k/v biases).
- ``eagle3``: the EAGLE repo's / SGLang's EAGLE-3 form (``midlayer.*``, ``d2t`` offsets, ``t2d``).
- ``speculators``: vllm-project/speculators' EAGLE-3 form (nested ``transformer_layer_config``, ``layers.0.*``).

Weight names may carry a ``model.`` prefix; ``embed_tokens`` may be absent (the target's embeddings are used).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dynvocab.errors import DynvocabError
from dynvocab.models.eagle.config import EAGLE1, EAGLE3, EagleConfig
from dynvocab.models.eagle.modules import EagleModel, rotary_embedding

LAYOUTS = ("eagle", "eagle3", "speculators")  # what :func:`save_eagle` writes
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


# -- config.json ---------------------------------------------------------------------------------------
def config_from_json(data: dict, kind: str) -> EagleConfig:
    """Read a checkpoint's ``config.json`` (EAGLE repo or speculators form) as a head of ``kind``."""
    layer = data.get("transformer_layer_config", data)  # speculators nests the layer's config
    qwen2 = layer.get("model_type") == "qwen2" or "Qwen2" in "".join(layer.get("architectures") or [])
    rope = layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    aux = data.get("eagle_aux_hidden_state_layer_ids") or layer.get("eagle_aux_hidden_state_layer_ids")
    try:
        heads = int(layer["num_attention_heads"])
        cfg = EagleConfig(
            kind=kind,
            arch="qwen2" if qwen2 and kind == EAGLE1 else "llama",
            hidden_size=int(layer["hidden_size"]),
            intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            vocab_size=int(layer.get("vocab_size") or data["vocab_size"]),
            head_dim=layer.get("head_dim"),
            target_hidden_size=data.get("target_hidden_size") or layer.get("target_hidden_size"),
            draft_vocab_size=data.get("draft_vocab_size") or layer.get("draft_vocab_size"),
            fc_bias=data.get("bias", layer.get("bias")),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope),
            rope_scaling=layer.get("rope_scaling"),
            max_position_embeddings=int(layer.get("max_position_embeddings", 4096)),
            hidden_act=layer.get("hidden_act", "silu"),
            aux_layer_ids=_ids(aux),
            norm_before_residual=bool(data.get("norm_before_residual", "speculators_model_type" in data)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DynvocabError(
            f"the EAGLE config.json lacks or garbles field {exc}; it is not a checkpoint we can read"
        ) from None
    return cfg


def config_to_json(cfg: EagleConfig, layout: str, target_name: str | None = None) -> dict:
    """``config.json`` of a head ``cfg`` in ``layout`` (:data:`LAYOUTS`), as the reference loaders read it."""
    layer = {
        "architectures": ["Qwen2ForCausalLM" if cfg.arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": cfg.arch,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": cfg.hidden_act,
        "tie_word_embeddings": False,
    }
    if cfg.head_dim is not None:
        layer["head_dim"] = cfg.head_dim
    if layout == "eagle":
        if cfg.kind != EAGLE1:
            raise DynvocabError(
                "layout 'eagle' holds EAGLE-1/2 heads; write an EAGLE-3 head as eagle3 or speculators"
            )
        return {**layer, "bias": cfg.has_fc_bias}
    if cfg.kind != EAGLE3:
        raise DynvocabError(f"layout '{layout}' holds EAGLE-3 heads; write an EAGLE-1/2 head as eagle")
    eagle3 = {
        "draft_vocab_size": cfg.draft_vocab,
        "target_hidden_size": cfg.target_hidden,
        "bias": cfg.has_fc_bias,
        "norm_before_residual": cfg.norm_before_residual,
    }
    if cfg.aux_layer_ids is not None:
        eagle3["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    if layout == "eagle3":
        return {**layer, "architectures": ["LlamaForCausalLMEagle3"], **eagle3}
    if layout != "speculators":
        raise DynvocabError(f"unknown EAGLE layout '{layout}'; use one of {', '.join(LAYOUTS)}")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        **eagle3,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name, "architectures": []},
        },
    }


def _ids(value) -> tuple[int, ...] | None:
    return None if not value else tuple(int(v) for v in value)


# -- checkpoints -------------------------------------------------------------------------------------------
def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    raise DynvocabError(f"{folder} has no {' or '.join(WEIGHT_FILES)}; it is not an EAGLE checkpoint")


def _weight_names(folder: Path) -> list[str]:
    path = folder / "model.safetensors"
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    if (folder / "pytorch_model.bin").is_file():
        return list(_read_weights(folder))
    return []


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def detect_kind(folder: str | Path) -> str | None:
    """:data:`EAGLE1`, :data:`EAGLE3`, or None when ``folder`` is not an EAGLE checkpoint (from ``config.json``
    and the weight names: an ``fc`` over features and a one-layer body)."""
    folder = Path(folder)
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if data.get("speculators_model_type") == "eagle3":
        return EAGLE3
    if data.get("speculators_model_type"):
        raise DynvocabError(f"speculators model type '{data['speculators_model_type']}' is not supported; use eagle3")
    names = {_strip(n) for n in _weight_names(folder)}
    if "fc.weight" not in names:
        return None
    if any(n.startswith("midlayer.") for n in names) or "d2t" in names:
        return EAGLE3
    if any(n.startswith("layers.0.") for n in names):
        return EAGLE1
    return None


def eagle_checkpoint(spec) -> Path | None:
    """The local folder of an EAGLE checkpoint named by a :class:`~dynvocab.models.loading.ModelSpec` (a folder or
    a hub id; a hub checkpoint is fetched), or None when it is not one (a draft model)."""
    if spec.gguf_file is not None:
        return None
    if spec.is_local:
        return Path(spec.path) if detect_kind(spec.path) else None
    try:
        from huggingface_hub import hf_hub_download, snapshot_download

        data = json.loads(Path(hf_hub_download(spec.path, "config.json")).read_text())
        if data.get("num_hidden_layers", data.get("transformer_layer_config", {}).get("num_hidden_layers")) != 1:
            return None  # EAGLE heads are one layer; anything else is a draft model
        folder = Path(snapshot_download(spec.path, allow_patterns=["config.json", *WEIGHT_FILES]))
    except Exception:  # not reachable or not a hub model: the draft-model loader reports it in one line
        return None
    return folder if detect_kind(folder) else None


def read_config(folder: str | Path) -> EagleConfig:
    """The :class:`EagleConfig` of the checkpoint in ``folder`` (refuses a folder that is not one)."""
    folder = Path(folder)
    kind = detect_kind(folder)
    if kind is None:
        raise DynvocabError(f"{folder} is not an EAGLE checkpoint (no fc over features and one-layer body)")
    return config_from_json(json.loads((folder / "config.json").read_text()), kind)



def _check_draft_vocab(model: EagleModel) -> None:
    """Refuse a ``d2t`` that is not an offset table consistent with ``t2d`` (read as absolute ids it would map
    the draft onto the first target ids and acceptance would silently collapse)."""
    targets = model.draft_to_target()
    vocab = model.t2d.numel()
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        raise DynvocabError(
            f"the EAGLE-3 d2t maps draft ids outside the target's {vocab} ids; it is not an offset table"
        )
    distinct = targets.unique().numel() == targets.numel()
    if not distinct or int(model.t2d.sum()) != targets.numel() or not bool(model.t2d[targets].all()):
        raise DynvocabError(
            "the EAGLE-3 d2t and t2d disagree (d2t must hold offsets: target = draft id + d2t[draft id])"
        )


def load_eagle(
    folder: str | Path,
    embeddings: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> EagleModel:
    """Load the EAGLE checkpoint in ``folder``. ``embeddings`` [V, d]: the target's input embeddings, used when
    the checkpoint has none (they are shared, not copied)."""
    folder = Path(folder)
    cfg = read_config(folder)
    state = {_strip(k): v for k, v in _read_weights(folder).items()}
    if cfg.kind == EAGLE3:  # speculators and vLLM name the layer layers.0
        state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    if "t2d" not in state and "d2t" in state:
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(state["d2t"].numel()) + state["d2t"].long()] = True
    with torch.device("meta"):
        model = EagleModel(cfg)
    missing = set(model.state_dict()) - set(state)
    shared = "embed_tokens.weight" in missing
    if shared:
        if embeddings is None:
            raise DynvocabError(f"{folder} has no embed_tokens; pass the target's embeddings")
        if tuple(embeddings.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise DynvocabError(
                f"the target's embeddings are {tuple(embeddings.shape)} but the EAGLE head needs "
                f"({cfg.vocab_size}, {cfg.hidden_size}); it was built for another target"
            )
        state["embed_tokens.weight"] = embeddings
        missing.discard("embed_tokens.weight")
    if cfg.kind == EAGLE3 and "d2t" in missing:
        raise DynvocabError(f"{folder} has no d2t; an EAGLE-3 head needs its draft-to-target id offsets")
    missing = {m for m in missing if "rotary_emb" not in m}
    unexpected = set(state) - set(model.state_dict())
    if missing or unexpected:
        first = sorted(missing or unexpected)[0]
        what = "missing" if missing else "unexpected"
        raise DynvocabError(f"{folder} does not match the EAGLE {cfg.kind} layout: {what} weight '{first}'")
    for name, tensor in state.items():
        want = model.state_dict()[name].shape
        if tuple(tensor.shape) != tuple(want):
            raise DynvocabError(
                f"{folder}: weight '{name}' has shape {tuple(tensor.shape)}, the config says {tuple(want)}"
            )
    model.to_empty(device=device)
    model.load_state_dict(state, strict=False, assign=False)
    model.rotary_emb = rotary_embedding(cfg.arch, model.layer_config).to(device)
    model.to(dtype)
    if cfg.kind == EAGLE3:
        model.d2t.data = state["d2t"].to(device, torch.long)
        model.t2d.data = state["t2d"].to(device, torch.bool)
        _check_draft_vocab(model)
    if shared and embeddings.dtype == dtype and embeddings.device == torch.device(device):
        model.embed_tokens.weight = nn.Parameter(embeddings, requires_grad=False)  # shared with the target
    return model.eval()


def state_for_layout(model: EagleModel, layout: str, embeddings: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` under ``layout``'s key names (speculators: ``layers.0.*`` for ``midlayer.*``)."""
    cfg = model.config
    config_to_json(cfg, layout)  # refuses a layout of the other kind
    state = {}
    for name, tensor in model.state_dict().items():
        if "rotary_emb" in name or (name == "embed_tokens.weight" and not embeddings):
            continue
        if layout == "speculators" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        state[name] = tensor.detach().contiguous().cpu()
    return state


def save_eagle(
    model: EagleModel,
    folder: str | Path,
    layout: str | None = None,
    embeddings: bool = False,
    target_name: str | None = None,
) -> Path:
    """Write ``model`` to ``folder`` as ``layout`` (default: ``eagle`` for EAGLE-1, ``eagle3`` for EAGLE-3):
    ``model.safetensors`` then ``config.json``, each written whole. ``embeddings``: include ``embed_tokens``
    (the published heads mostly leave it out and use the target's)."""
    from safetensors.torch import save_file

    from dynvocab.files import write_atomic

    layout = layout or (EAGLE1 if model.kind == EAGLE1 else "eagle3")
    config = config_to_json(model.config, layout, target_name)
    state = state_for_layout(model, layout, embeddings)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    write_atomic(folder / "config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    return folder
