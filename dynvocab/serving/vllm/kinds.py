"""The draft kinds the vLLM plugin exports, one row each (no vLLM import): vLLM's speculative method for the kind,
how the draft folder's ``config.json`` is rewritten for vLLM's class, and what the head's vocabulary is (whose ids
its rows are, and whether it may keep its own draft vocabulary). :mod:`dynvocab.serving.vllm.folder` reads the row
of the kind ``--draft`` is (``runtime/drafts/kinds.py``'s ``find_kind``) and never asks which one it has.

A new kind is one :class:`VllmKind` row here and its architectures in ``names.ARCHITECTURES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dynvocab.errors import DynvocabError
from dynvocab.models.eagle.config import head_rows
from dynvocab.registry import Registry
from dynvocab.serving.vllm.names import EAGLE1_ACTIVATIONS


@dataclass(frozen=True)
class VllmKind:
    """How a draft of kind ``name`` becomes a folder vLLM loads."""

    name: str  # dynvocab's draft kind (runtime/drafts/kinds.py)
    method: str  # vLLM's speculative_config["method"]
    rewrite: Callable[[dict, Path], dict]  # (config.json, the draft folder) -> config.json as vLLM's class reads it
    fits: Callable[..., tuple[str, list[str]]]  # (bundle, spec, text config, draft) -> (role compared, differences)
    marks: tuple[str, ...] = ()  # what vLLM adds to the architecture's name (stripped to find the plugin's class)
    draft_vocabulary: bool = False  # the head may keep its own draft vocabulary (EAGLE-3's d2t)
    target_states: bool = False  # vLLM feeds the head's first pass the target's last hidden states (EAGLE-1's
    # ``llama_eagle.py:forward``; an EAGLE-3 head gets middle layers combined, a draft model none)

    def base_architecture(self, architecture: str) -> str:
        """``architecture`` without the kind's marks (``LlamaForCausalLMEagle3``, the eagle3 layout's, and
        ``Eagle3LlamaForCausalLM`` are ``LlamaForCausalLM``)."""
        for mark in self.marks:
            if architecture.startswith(mark):
                return architecture[len(mark):]
            if architecture.endswith(mark):
                return architecture[: -len(mark)]
        return architecture

    def check_head(self, text: dict, strategy: str) -> None:
        """Refuse a selector on a head whose rows are its own draft vocabulary (EAGLE-3's ``d2t``): the selectors
        pick target ids."""
        own = head_rows(text)
        if not self.draft_vocabulary or own == int(text["vocab_size"]):
            return
        if strategy == "fr":
            raise DynvocabError(
                f"fr on this EAGLE-3 head adds nothing: its own head is already a static set of {own:,} ids (d2t); run "
                "vLLM's eagle3 without the plugin, or use lowrank/centroids with a head whose draft vocabulary is the target's"
            )
        raise DynvocabError(
            f"the {strategy} selector picks target ids, but this EAGLE-3 head's rows are its own {own:,}-id draft "
            "vocabulary (d2t); use a head whose draft vocabulary is the target's (draft_vocab_size == vocab_size)"
        )


def _as_is(config: dict, source: Path) -> dict:
    return config


def _fits_own_draft(bundle, spec, text: dict, draft: str) -> tuple[str, list[str]]:
    """A draft model predicts its own ids: compare its tokenizer and head with the bundle's draft."""
    from dynvocab.artifacts import ModelFingerprint
    from dynvocab.models import load_tokenizer

    given = ModelFingerprint.of(load_tokenizer(spec), (int(text["vocab_size"]), int(text["hidden_size"])), draft)
    built = bundle.fingerprints.get("draft")
    return "draft", [] if built is None else built.differences(given)


def _fits_target(bundle, spec, text: dict, draft: str) -> tuple[str, list[str]]:
    """An EAGLE head reads the target's ids and hidden states: compare its shapes with the bundle's target."""
    built = bundle.fingerprints["target"]
    width = int(text.get("target_hidden_size") or text["hidden_size"])
    rows = int(text["vocab_size"])
    return "target", [f"{key} {mine} != {theirs}" for key, theirs, mine in
                      (("head_rows", built.head_rows, rows), ("hidden_size", built.hidden_size, width)) if mine != theirs]


def _eagle(kind: str, source: Path):
    """The head's layout-free config, refused where vLLM's EAGLE-3 classes build ``fc`` without the bias it has."""
    from dynvocab.models.eagle import read_config

    cfg = read_config(source)
    if kind == "eagle3" and cfg.has_fc_bias:
        raise DynvocabError(
            "this EAGLE-3 head's fc has a bias, which vLLM's eagle3 head does not load (its fc is built without one); "
            "use a head trained without fc bias"
        )
    return cfg


def _eagle1_config(config: dict, source: Path) -> dict:
    """The plugin's EAGLE-1 class (``eagle1.py``) loads an fc bias and runs the activations of
    ``names.EAGLE1_ACTIVATIONS``; another activation is refused. The config's ``bias`` (fc's, in the EAGLE repo's
    layout) is left out: vLLM's llama layer would read it as biases on q/k/v/o that the head does not have. vLLM
    registers no ``EagleQwen2ForCausalLM``: a Qwen2 layer goes as vLLM's llama EAGLE layer with q/k/v biases
    (``qkv_bias``; ``model_type`` llama, whose config has no ``layer_types``, which vLLM's EAGLE-1 layer cannot
    index)."""
    cfg = _eagle("eagle1", source)
    act = config.get("hidden_act", "silu")
    if act not in EAGLE1_ACTIVATIONS:
        raise DynvocabError(f"this EAGLE-1 head's activation {act} has no vLLM kernel in the plugin; supported: "
                            f"{', '.join(EAGLE1_ACTIVATIONS)}")
    # the EAGLE repo's "bias" is fc's; vLLM's llama layer reads it as attention_bias (llama.py), so it goes
    out = {k: v for k, v in config.items() if k != "bias"}
    out["attention_bias"] = bool(config.get("attention_bias", False))
    if cfg.arch != "qwen2":
        return out
    if any(t != "full_attention" for t in config.get("layer_types") or []):
        raise DynvocabError("vLLM's EAGLE-1 head attends fully; this head's layer_types ask for a sliding window")
    out = {k: v for k, v in out.items() if k != "layer_types"}
    return {**out, "model_type": "llama", "qkv_bias": True, "attention_bias": False}


def _eagle3_config(config: dict, source: Path) -> dict:
    """EAGLE-3's explicit layer ids are ``hidden_states[i]`` to vLLM (``gpu_model_runner.py``
    ``_get_eagle3_aux_layers_from_config``, read as written, deduplicated), the output of layer i in the eagle3
    layout, so they are written as vLLM reads them; repeats are refused (vLLM reads each once, so ``fc`` would not
    fit)."""
    ids = _eagle("eagle3", source).aux_hidden_states
    if ids is None:
        return config  # both read the default (2, L // 2, L - 3)
    if len(set(ids)) != len(ids):
        raise DynvocabError(
            f"this EAGLE-3 head reads target hidden states {list(ids)} with repeats, which vLLM reads once each "
            "(its fc would not fit); use a head over distinct layers"
        )
    return {**config, "eagle_aux_hidden_state_layer_ids": list(ids)}


KINDS: Registry[VllmKind] = Registry("vLLM draft kind")
for _row in (
    VllmKind("draft-model", "draft_model", _as_is, _fits_own_draft),
    VllmKind("eagle1", "eagle", _eagle1_config, _fits_target, marks=("Eagle3", "Eagle"), target_states=True),
    VllmKind("eagle3", "eagle3", _eagle3_config, _fits_target, marks=("Eagle3", "Eagle"), draft_vocabulary=True),
):
    KINDS.register(_row)


def kind_of_method(method: str | None) -> VllmKind | None:
    """The row whose vLLM speculative method is ``method`` (None: none)."""
    return next((KINDS[name] for name in KINDS if KINDS[name].method == method), None)


def vllm_kind(kind: str) -> VllmKind:
    """The row of draft kind ``kind``; refused in one line where vLLM has no speculative method for it."""
    if kind not in KINDS:
        raise DynvocabError(f"draft kind '{kind}' has no vLLM speculative method; use a draft model or EAGLE head")
    return KINDS[kind]
