"""EAGLE checkpoints in the three published layouts, read and written (see :mod:`dynvocab.models.eagle`).

- ``eagle``: the EAGLE repo's EAGLE-1/2 form (SGLang reads it too; a Qwen2 layer keeps its q/k/v biases).
- ``eagle3``: the EAGLE repo's / SGLang's EAGLE-3 form (``midlayer.*``, ``d2t`` offsets, ``t2d``).
- ``speculators``: vllm-project/speculators' EAGLE-3 form (nested ``transformer_layer_config``, ``layers.0.*``).

Weight names may carry a ``model.`` prefix; ``embed_tokens`` may be absent (the target's embeddings are used).

EAGLE-3's explicit ``eagle_aux_hidden_state_layer_ids`` mean one thing per layout, converted here on reading and
writing (in :class:`EagleConfig` they are ``aux_hidden_states``, indices into the target's hidden states):

- ``eagle3`` (EAGLE / SGLang / SpecForge): id i = the OUTPUT of layer i = ``hidden_states[i + 1]``. SGLang
  ``python/sglang/srt/models/llama.py`` ``set_eagle3_layers_to_capture``: "for the ith layer, it takes the output
  of the (i-1)th layer", so it captures before layer ``id + 1``.
- ``speculators`` (vllm-project/speculators, vLLM): id i = ``hidden_states[i]``, the INPUT of layer i (i = L:
  the last layer's output). vLLM ``model_executor/models/llama.py`` appends ``hidden_states + residual`` before
  running layer ``idx`` when ``idx in aux_hidden_state_layers``; speculators ``convert/dflash/converter.py``
  (117-119) and ``models/utils.py:resolve_target_layer_ids`` (ids within ``[0, L]``; its ``from_pretrained`` and
  ``from_training_args`` write the defaults ``[2, L // 2, L - 3]`` out once the verifier is known).

A head read from one layout and written to the other keeps its layers (``tests/test_eagle_interop.py``).

llama.cpp (the tree vendored by llama-cpp-python 0.3.36) converts both EAGLE-3 layouts as they are written here
(``convert_hf_to_gguf.py --target-model-dir``: ``conversion/llama.py:49-105`` config, ``:211-230`` ``midlayer.*`` /
``layers.0.*``, ``:338-351`` ``d2t`` offsets made absolute) and reads the ids the speculators way: it copies them
verbatim (``conversion/llama.py:77-80``) and taps the INPUT of layer i (``common/speculative.cpp:541-543``,
``src/models/llama.cpp:127``). A head with explicit ids therefore goes to llama.cpp as ``speculators``; an
``eagle3`` head without ids gets the same defaults ``[2, L // 2, L - 3]`` on both sides
(``scripts/llamacpp_eagle3.py`` checks the converted file).
"""

from __future__ import annotations

import functools

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
def layout_of(data: dict, kind: str) -> str:
    """The layout a ``config.json`` is written in (:data:`LAYOUTS`)."""
    if "speculators_model_type" in data:
        return "speculators"
    return "eagle3" if kind == EAGLE3 else "eagle"


def _arch(layer: dict, kind: str, layout: str) -> str:
    """The decoder layer family of a head's config. EAGLE-1: ``qwen2`` for a Qwen2 config, or for the EAGLE repo's
    llama config with ``qkv_bias`` (cnets1.py ``LlamaAttention``: q/k/v biases, none on o_proj — a Qwen2 layer).
    speculators: ``transformer_layer_config.model_type`` (its ``model_definitions.py``: llama, qwen3)."""
    model_type = layer.get("model_type", "llama")
    if kind == EAGLE1:
        qwen2 = model_type == "qwen2" or "Qwen2" in "".join(layer.get("architectures") or [])
        return "qwen2" if qwen2 or layer.get("qkv_bias") else "llama"
    if layout == "speculators":
        if model_type not in ("llama", "qwen3"):
            raise DynvocabError(
                f"speculators transformer_layer_config.model_type '{model_type}' is not supported; use llama or qwen3"
            )
        return model_type
    return "llama"


def config_from_json(data: dict, kind: str) -> EagleConfig:
    """Read a checkpoint's ``config.json`` (EAGLE repo or speculators form) as a head of ``kind``; what it cannot
    run as the writer's code runs it is refused in one line naming the field."""
    layout = layout_of(data, kind)
    layer = data.get("transformer_layer_config", data)  # speculators nests the layer's config
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
            kind=kind,
            arch=_arch(layer, kind, layout),
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
            aux_hidden_states=_aux_read(aux, layout),
            # absent: vLLM reads true (transformers_utils/configs/speculators/algos.py); speculators always writes it
            norm_before_residual=bool(data.get("norm_before_residual", layout == "speculators")),
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


def _aux_read(ids, layout: str) -> tuple[int, ...] | None:
    """A layout's explicit layer ids as target hidden-state indices (see the module docstring)."""
    if not ids:
        return None
    ids = tuple(int(i) for i in ids)
    return tuple(i + 1 for i in ids) if layout == "eagle3" else ids  # eagle3: the output of layer i


def _aux_write(cfg: EagleConfig, layout: str) -> list[int] | None:
    """The head's target hidden-state indices as ``layout`` writes its layer ids."""
    if cfg.aux_hidden_states is None:
        return None
    if layout != "eagle3":
        return list(cfg.aux_hidden_states)
    if min(cfg.aux_hidden_states) < 1:
        raise DynvocabError(
            "this EAGLE-3 head reads hidden_states[0] (the embeddings), which the eagle3 layout's ids (the output "
            "of layer i) cannot name; write it as speculators"
        )
    return [i - 1 for i in cfg.aux_hidden_states]


def config_to_json(cfg: EagleConfig, layout: str, target_name: str | None = None) -> dict:
    """``config.json`` of a head ``cfg`` in ``layout`` (:data:`LAYOUTS`), as the reference loaders read it.
    ``target_name``: the verifier (speculators' ``verifier.name_or_path``: a local folder or a hub id)."""
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
    if layout == "eagle":
        if cfg.kind != EAGLE1:
            raise DynvocabError(
                "layout 'eagle' holds EAGLE-1/2 heads; write an EAGLE-3 head as eagle3 or speculators"
            )
        return {**layer, "bias": cfg.has_fc_bias}
    if cfg.kind != EAGLE3:
        raise DynvocabError(f"layout '{layout}' holds EAGLE-3 heads; write an EAGLE-1/2 head as eagle")
    if layout not in LAYOUTS:
        raise DynvocabError(f"unknown EAGLE layout '{layout}'; use one of {', '.join(LAYOUTS)}")
    eagle3 = {
        "draft_vocab_size": cfg.draft_vocab,
        "target_hidden_size": cfg.target_hidden,
        "norm_before_residual": cfg.norm_before_residual,
    }
    aux = _aux_write(cfg, layout)
    if aux is not None:
        eagle3["eagle_aux_hidden_state_layer_ids"] = aux
    if layout == "eagle3":
        options = [n for n in ("norm_before_fc", "fc_norm", "norm_output", "sliding_window") if getattr(cfg, n)]
        if cfg.arch != "llama":
            options.insert(0, f"a {cfg.arch} layer")
        if options:
            raise DynvocabError(f"the eagle3 layout cannot hold {options[0]} (SGLang would drop it); write it as speculators")
        return {**layer, "architectures": ["LlamaForCausalLMEagle3"], "bias": cfg.has_fc_bias, **eagle3}
    _check_speculators(cfg, target_name)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        **eagle3,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_name, "architectures": _verifier_architectures(target_name)},
        },
    }


def _check_speculators(cfg: EagleConfig, target_name: str | None) -> None:
    """Refuse, in one line naming the field, what speculators 0.9.0 would drop or fail on: its
    ``models/eagle3/core.py`` builds ``fc`` without a bias over ``num_aux * hidden_size`` and calls
    ``AutoConfig.from_pretrained(verifier.name_or_path)`` when it loads a head."""
    if cfg.has_fc_bias:
        raise DynvocabError("speculators' fc has no bias (it would drop fc.bias); this head cannot be written as speculators")
    if cfg.target_hidden != cfg.hidden_size:
        raise DynvocabError(
            f"speculators needs target_hidden_size == hidden_size (this head: {cfg.target_hidden} vs "
            f"{cfg.hidden_size}); it cannot be written as speculators"
        )
    if not target_name:
        raise DynvocabError(
            "the speculators layout records its verifier, which speculators loads; pass the target (a local folder or hub id)"
        )


def _verifier_architectures(target_name: str | None) -> list[str]:
    """The verifier's ``architectures`` when its config is on this machine (as speculators' VerifierConfig has)."""
    try:
        return list(json.loads((Path(target_name or "") / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return []


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
    if cfg.kind == EAGLE3 and cfg.draft_vocab == cfg.vocab_size and "d2t" not in state and "t2d" not in state:
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)  # speculators saves a full-vocabulary head
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)  # without them (DraftVocabMixin): identity
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
    """The tensors of ``model`` under ``layout``'s key names (speculators: ``layers.0.*`` for ``midlayer.*``).

    speculators always gets ``embed_tokens``: speculators 0.9.0 marks missing embeddings with NaN and loads the
    verifier's only if it still sees NaN, which transformers 5 (``empty_like``) does not keep, so a head without
    them runs on garbage there. A full-vocabulary head goes without ``d2t``/``t2d``, as speculators saves one."""
    cfg = model.config
    config_to_json(cfg, layout, target_name="-")  # refuses a layout of the other kind or fields it cannot hold
    full = layout == "speculators" and cfg.draft_vocab == cfg.vocab_size
    if full and bool(model.d2t.any()):
        raise DynvocabError("a full-vocabulary head whose d2t is not the identity cannot be written as speculators")
    state = {}
    for name, tensor in model.state_dict().items():
        if "rotary_emb" in name or (full and name in ("d2t", "t2d")):
            continue
        if name == "embed_tokens.weight" and not (embeddings or layout == "speculators"):
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
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``model`` to ``folder`` as ``layout`` (default: ``eagle`` for EAGLE-1, ``eagle3`` for EAGLE-3):
    ``model.safetensors`` then ``config.json``, each written whole. ``embeddings``: include ``embed_tokens``
    (the published heads mostly leave it out and use the target's; speculators always gets them).
    ``target_name``: the verifier speculators records and loads — required for that layout; give a path that
    resolves where the head is used (a local folder, or the hub id of the target). ``dtype``: the floating-point
    tensors' dtype on disk (default: as they are; bfloat16 halves a float32 head, and loading casts back)."""
    from safetensors.torch import save_file

    from dynvocab.files import write_atomic

    layout = layout or (EAGLE1 if model.kind == EAGLE1 else "eagle3")
    config = config_to_json(model.config, layout, target_name)
    state = state_for_layout(model, layout, embeddings)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    write_atomic(folder / "config.json", lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
    return folder
