"""EAGLE checkpoints read and written through the layout registry (:mod:`dynvocab.models.eagle.layouts`).

Each published layout (``eagle``, ``eagle3``, ``speculators``, and any registered later) answers how a folder is
recognised as it, how its ``config.json`` reads and writes, how its tensor names map onto the model's and what its
explicit ``eagle_aux_hidden_state_layer_ids`` mean; this module does the rest the same way for every layout and
never asks which one it has. Weight names may carry a ``model.`` prefix; ``embed_tokens`` may be absent (the
target's embeddings are used). In :class:`EagleConfig` the layer ids are ``aux_hidden_states``, indices into the
target's hidden states, so a head read from one layout and written to another keeps its layers
(``tests/test_eagle_interop.py``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import nn

from dynvocab.errors import DynvocabError
from dynvocab.models.eagle.config import EAGLE3, EagleConfig
from dynvocab.models.eagle.layouts import DEFAULT_FAMILY, Layout, check_kind, layout_for, lookup_layout, recognize
from dynvocab.models.eagle.modules import EagleModel, rotary_embedding

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


# -- config.json ---------------------------------------------------------------------------------------
def config_from_json(data: dict, layout: str | Layout) -> EagleConfig:
    """Read a checkpoint's ``config.json`` written in ``layout``; what it cannot run as the writer's code runs it
    is refused in one line naming the field."""
    layout = lookup_layout(layout)
    layer = layout.layer_of(data)
    rope = layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    aux = data.get("eagle_aux_hidden_state_layer_ids") or layer.get("eagle_aux_hidden_state_layer_ids")
    if int(layer.get("num_hidden_layers") or 1) != 1:
        raise DynvocabError(
            f"the EAGLE head has {layer['num_hidden_layers']} decoder layers (num_hidden_layers); dynvocab runs "
            "one-layer heads"
        )
    try:
        heads = int(layer["num_attention_heads"])
        cfg = EagleConfig(
            kind=layout.kind,
            arch=layout.arch(layer),
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
            aux_hidden_states=layout.read_aux(aux),
            norm_before_residual=bool(data.get("norm_before_residual", layout.norm_before_residual)),
            norm_before_fc=bool(data.get("norm_before_fc", False)),
            fc_norm=bool(data.get("fc_norm", False)),
            norm_output=bool(data.get("norm_output", False)),
            sliding_window=_sliding_window(layer),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DynvocabError(
            f"the EAGLE config.json lacks or garbles field {exc}; it is not a checkpoint we can read"
        ) from None
    return cfg


def _sliding_window(layer: dict) -> int | None:
    """speculators core.py: the (first) draft layer attends a window when its ``layer_types`` entry is
    ``sliding_attention``; Qwen3's config derives ``layer_types`` from ``use_sliding_window``."""
    types = layer.get("layer_types") or (["sliding_attention"] if layer.get("use_sliding_window") else [])
    if types and types[0] == "sliding_attention" and layer.get("sliding_window"):
        return int(layer["sliding_window"])
    return None


def _layer_json(cfg: EagleConfig) -> dict:
    """The decoder layer's fields, as every layout writes them (flat or nested)."""
    layer = {
        "architectures": [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(cfg.arch, "LlamaForCausalLM")],
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
    if cfg.head_dim is not None or cfg.arch == "qwen3":
        layer["head_dim"] = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    if cfg.sliding_window:
        layer.update(sliding_window=cfg.sliding_window, layer_types=["sliding_attention"], use_sliding_window=True)
    return layer


def config_to_json(cfg: EagleConfig, layout: str | Layout, target_name: str | None = None) -> dict:
    """``config.json`` of a head ``cfg`` in ``layout`` (a registered name), as the reference loaders read it;
    refuses a head of the other kind, or fields the layout cannot hold. ``target_name``: the verifier
    (speculators' ``verifier.name_or_path``: a local folder or a hub id)."""
    layout = lookup_layout(layout)
    check_kind(layout, cfg.kind)
    return layout.config_json(cfg, _layer_json(cfg), target_name)


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


def read_layout(folder: str | Path) -> Layout | None:
    """The layout of the EAGLE checkpoint in ``folder``, or None when it is not one (from ``config.json`` and the
    weight names, asked of each registered layout; nothing is loaded)."""
    folder = Path(folder)
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    names = functools.cache(lambda: {_strip(n) for n in _weight_names(folder)})
    return recognize(data, names)


def detect_kind(folder: str | Path) -> str | None:
    """:data:`EAGLE1`, :data:`EAGLE3`, or None when ``folder`` is not an EAGLE checkpoint (see :func:`read_layout`)."""
    layout = read_layout(folder)
    return None if layout is None else layout.kind


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


@functools.lru_cache(maxsize=16)
def _checkpoint_kind(spec) -> tuple[Path, str] | None:
    folder = eagle_checkpoint(spec)
    return None if folder is None else (folder, detect_kind(folder))


def checkpoint_of_kind(spec, kind: str) -> Path | None:
    """The local folder of the EAGLE checkpoint of ``kind`` (:data:`EAGLE1` or :data:`EAGLE3`) that ``spec`` names,
    else None (another kind, or no EAGLE checkpoint): the draft registry's recogniser of each EAGLE kind. A hub
    checkpoint is fetched once for all kinds asked."""
    found = _checkpoint_kind(spec)
    return found[0] if found is not None and found[1] == kind else None


def read_config(folder: str | Path) -> EagleConfig:
    """The :class:`EagleConfig` of the checkpoint in ``folder`` (refuses a folder that is not one)."""
    return _open(Path(folder))[1]


def _open(folder: Path) -> tuple[Layout, EagleConfig]:
    """The layout of the checkpoint in ``folder`` and its config (refuses a folder that is not one)."""
    layout = read_layout(folder)
    if layout is None:
        raise DynvocabError(f"{folder} is not an EAGLE checkpoint (no fc over features and one-layer body)")
    return layout, config_from_json(json.loads((folder / "config.json").read_text()), layout)


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


def _read_state(folder: Path, layout: Layout, cfg: EagleConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the model's names; a full-vocabulary EAGLE-3 head saved without ``d2t``/``t2d``
    (speculators' ``DraftVocabMixin``) gets the identity, and a missing ``t2d`` is made from ``d2t``."""
    state = {layout.to_model(_strip(k)): v for k, v in _read_weights(folder).items()}
    if cfg.kind == EAGLE3 and cfg.draft_vocab == cfg.vocab_size and "d2t" not in state and "t2d" not in state:
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    if "t2d" not in state and "d2t" in state:
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(state["d2t"].numel()) + state["d2t"].long()] = True
    return state


def _check_state(folder: Path, cfg: EagleConfig, model: EagleModel, state: dict) -> None:
    """Refuse, in one line naming the first weight, tensors the model lacks, misses or shapes otherwise."""
    if cfg.kind == EAGLE3 and "d2t" not in state:
        raise DynvocabError(f"{folder} has no d2t; an EAGLE-3 head needs its draft-to-target id offsets")
    own = model.state_dict()
    missing = {m for m in set(own) - set(state) if "rotary_emb" not in m}
    unexpected = set(state) - set(own)
    if missing or unexpected:
        first = sorted(missing or unexpected)[0]
        what = "missing" if missing else "unexpected"
        raise DynvocabError(f"{folder} does not match the EAGLE {cfg.kind} layout: {what} weight '{first}'")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise DynvocabError(
                f"{folder}: weight '{name}' has shape {tuple(tensor.shape)}, the config says {tuple(own[name].shape)}"
            )


def load_eagle(
    folder: str | Path,
    embeddings: torch.Tensor | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> EagleModel:
    """Load the EAGLE checkpoint in ``folder``, in whichever registered layout it is. ``embeddings`` [V, d]: the
    target's input embeddings, used when the checkpoint has none (they are shared, not copied)."""
    folder = Path(folder)
    layout, cfg = _open(folder)
    state = _read_state(folder, layout, cfg)
    with torch.device("meta"):
        model = EagleModel(cfg)
    shared = "embed_tokens.weight" not in state
    if shared:
        if embeddings is None:
            raise DynvocabError(f"{folder} has no embed_tokens; pass the target's embeddings")
        if tuple(embeddings.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise DynvocabError(
                f"the target's embeddings are {tuple(embeddings.shape)} but the EAGLE head needs "
                f"({cfg.vocab_size}, {cfg.hidden_size}); it was built for another target"
            )
        state["embed_tokens.weight"] = embeddings
    _check_state(folder, cfg, model, state)
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


def state_for_layout(model: EagleModel, layout: str | Layout, embeddings: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` under ``layout``'s key names, refused as :func:`config_to_json` refuses.
    ``embeddings``: include ``embed_tokens`` (a layout with ``always_embeddings`` gets them anyway); a layout
    with ``full_vocab_without_map`` writes a full-vocabulary head without ``d2t``/``t2d``."""
    layout = lookup_layout(layout)
    cfg = model.config
    config_to_json(cfg, layout, target_name="-")  # refuses a layout of the other kind or fields it cannot hold
    full = layout.full_vocab_without_map and cfg.draft_vocab == cfg.vocab_size
    if full and bool(model.d2t.any()):
        raise DynvocabError(
            f"a full-vocabulary head whose d2t is not the identity cannot be written as {layout.name}"
        )
    state = {}
    for name, tensor in model.state_dict().items():
        if "rotary_emb" in name or (full and name in ("d2t", "t2d")):
            continue
        if name == "embed_tokens.weight" and not (embeddings or layout.always_embeddings):
            continue
        state[layout.to_file(name)] = tensor.detach().contiguous().cpu()
    return state


def save_eagle(
    model: EagleModel,
    folder: str | Path,
    layout: str | Layout | None = None,
    embeddings: bool = False,
    target_name: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``model`` to ``folder`` as ``layout`` (a registered name; default: the EAGLE repo's layout of its kind,
    ``eagle`` for EAGLE-1, ``eagle3`` for EAGLE-3): ``model.safetensors`` then ``config.json``, each written whole.
    ``embeddings``: include ``embed_tokens`` (the published heads mostly leave it out and use the target's;
    speculators always gets them). ``target_name``: the verifier speculators records and loads — required for that
    layout; give a path that resolves where the head is used (a local folder, or the hub id of the target).
    ``dtype``: the floating-point tensors' dtype on disk (default: as they are; bfloat16 halves a float32 head, and
    loading casts back)."""
    from safetensors.torch import save_file

    from dynvocab.files import write_atomic

    layout = lookup_layout(layout or layout_for(DEFAULT_FAMILY, model.kind))
    config = config_to_json(model.config, layout, target_name)
    state = state_for_layout(model, layout, embeddings)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    write_atomic(folder / "config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    return folder
