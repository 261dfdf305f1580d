"""The draft folder vLLM loads as it is (``dynvocab export --format vllm``); no vLLM import.

vLLM's ``speculative_config={"method": METHOD, "model": FOLDER}`` builds the architecture the folder's
``config.json`` names; the plugin (:mod:`dynvocab.serving.vllm`) registers it, and its head reads the folder's
policy file (:mod:`dynvocab.serving.vllm.head`). The folder holds:

- ``config.json``: the draft's own config, ``architectures`` set to the plugin's name for it
  (:func:`~dynvocab.serving.vllm.names.registered_name`), and a ``dynvocab`` section (:func:`section`);
- ``names.POLICY_FILE`` (``dynvocab/policy.safetensors``): a dynvocab bundle of only the stages the strategy's selector reads (and ``freq``, where
  the selectors find the EOS ids), with the source bundle's fingerprints and stage configs;
- everything else of the draft folder (weights, index, tokenizer, generation config), linked by absolute path or
  copied.

The folder is staged beside ``out`` and renamed into place once its selector has been built from it, so it appears
whole or not at all. Every refusal is one line saying what to do.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dynvocab.errors import DynvocabError
from dynvocab.serving.vllm.names import ARCHITECTURES, CONFIG_KEY, FOLDER_FORMAT, METHODS, POLICY_FILE, registered_name


@dataclass(frozen=True)
class DraftFolder:
    """A written draft folder: where it is and what its head runs."""

    path: Path
    strategy: str
    kind: str  # draft kind: draft-model, eagle1, eagle3
    method: str  # vLLM's speculative_config["method"]
    architecture: str  # the registered architecture its config.json names
    ids: int  # the selector's set size k

    def summary(self) -> str:
        """``vllm, STRATEGY, N ids, ARCHITECTURE`` for the CLI's one line."""
        return f"vllm, {self.strategy}, {self.ids:,} ids, {self.architecture}"


def supported() -> str:
    """The (kind, architecture) pairs the plugin registers, for error messages."""
    return ", ".join(f"{kind} {arch}" for kind, arch in ARCHITECTURES)


def base_architecture(kind: str, architecture: str) -> str:
    """The architecture an EAGLE head's config names, without EAGLE's prefix or suffix (``LlamaForCausalLMEagle3``,
    the eagle3 layout's, and ``Eagle3LlamaForCausalLM`` are ``LlamaForCausalLM``); a draft model's as it is."""
    if kind == "draft-model":
        return architecture
    for mark in ("Eagle3", "Eagle"):
        if architecture.startswith(mark):
            return architecture[len(mark):]
        if architecture.endswith(mark):
            return architecture[: -len(mark)]
    return architecture


def _draft_folder(draft: str) -> tuple[object, Path, dict]:
    """(ModelSpec, local folder, its config.json) of ``--draft``; refused when vLLM could not load it as a folder."""
    from dynvocab.models import resolve_model

    path = Path(draft).expanduser()
    if not draft.startswith("demo:") and path.is_dir() and not (path / "config.json").is_file():
        raise DynvocabError(f"draft folder {draft} has no config.json; pass a transformers model folder or EAGLE head")
    spec = resolve_model(draft)  # demo:NAME -> its converted cache folder (safetensors + tokenizer)
    if spec.gguf_file is not None or not spec.is_local:
        raise DynvocabError(
            f"--draft {draft} is not a local model folder; vLLM loads a folder with config.json and safetensors "
            "(download or convert it first; demo:draft works)"
        )
    folder = Path(spec.path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise DynvocabError(f"cannot read {folder / 'config.json'} ({type(exc).__name__}); pass a model folder") from None
    if CONFIG_KEY in config:
        raise DynvocabError(f"{draft} is already a dynvocab vLLM folder; pass the draft it was made from")
    return spec, folder, config


def _architecture(kind: str, config: dict, draft: str) -> tuple[str, str]:
    """(the draft's own architecture, the plugin's registered name for it); refused when the plugin has none."""
    if "speculators_model_type" in config:
        raise DynvocabError(
            f"{draft} is an EAGLE head in the speculators layout, which vLLM converts on loading; write it in the "
            "eagle layout (`dynvocab train-draft --format eagle`) and export that"
        )
    own = (config.get("architectures") or ["(none)"])[0]
    name = registered_name(kind, base_architecture(kind, own))
    if name is None:
        raise DynvocabError(f"the vLLM plugin has no {kind} of architecture {own}; it supports: {supported()}")
    return own, name


def _check_fits(bundle, kind: str, spec, text: dict, draft: str) -> None:
    """Refuse a bundle built for another model than this draft (compared without loading weights)."""
    from dynvocab.artifacts import ModelFingerprint

    rows, hidden = int(text["vocab_size"]), int(text["hidden_size"])
    if kind == "draft-model":
        from dynvocab.models import load_tokenizer

        given = ModelFingerprint.of(load_tokenizer(spec), (rows, hidden), draft)
        role, built = "draft", bundle.fingerprints.get("draft")
        diffs = [] if built is None else built.differences(given)
    else:  # an EAGLE head reads the target's ids and hidden states: compare with the bundle's target
        role, built = "target", bundle.fingerprints["target"]
        width = int(text.get("target_hidden_size") or hidden)
        diffs = [f"{key} {mine} != {theirs}" for key, theirs, mine in
                 (("head_rows", built.head_rows, rows), ("hidden_size", built.hidden_size, width)) if mine != theirs]
    if diffs:
        raise DynvocabError(
            f"bundle {bundle.path} was built for another {role} ({built.source or 'another model'}; "
            f"{', '.join(diffs)}) than --draft {draft}; pass the draft it was built for or rebuild the bundle"
        )


def _check_head(kind: str, text: dict, strategy: str) -> None:
    """Refuse a selector on an EAGLE-3 head with its own draft vocabulary (``d2t``): its rows are draft ids."""
    own = int(text.get("draft_vocab_size") or text["vocab_size"])
    if kind != "eagle3" or own == int(text["vocab_size"]):
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


def _eagle_config(kind: str, config: dict, source: Path) -> dict:
    """The head's ``config.json`` as vLLM's EAGLE classes must read it (the head's own meaning kept); refused in
    one line where vLLM's class cannot hold the head. vLLM's ``llama_eagle.py`` / ``llama_eagle3.py`` build ``fc``
    without a bias; EAGLE-1 has no ``EagleQwen2ForCausalLM``, so a Qwen2 layer goes as a llama layer with q/k/v
    biases (``qkv_bias``; ``model_type`` llama, whose config has no ``layer_types``, which vLLM's EAGLE-1 layer
    cannot index); EAGLE-3's explicit layer ids are ``hidden_states[i]`` to vLLM (``gpu_model_runner.py``
    ``_get_eagle3_aux_layers_from_config``, read as written, deduplicated), the output of layer i in the eagle3
    layout, so they are written as vLLM reads them."""
    if kind == "draft-model":
        return config
    from dynvocab.models.eagle import read_config

    cfg = read_config(source)
    if cfg.has_fc_bias:
        raise DynvocabError(
            f"this EAGLE head's fc has a bias, which vLLM's {kind} head does not load (its fc is built without one); "
            "use a head trained without fc bias"
        )
    if kind == "eagle1":
        if cfg.arch != "qwen2":
            return config
        types = config.get("layer_types") or []
        if any(t != "full_attention" for t in types):
            raise DynvocabError("vLLM's EAGLE-1 head attends fully; this head's layer_types ask for a sliding window")
        out = {k: v for k, v in config.items() if k != "layer_types"}
        return {**out, "model_type": "llama", "qkv_bias": True, "attention_bias": False}
    ids = cfg.aux_hidden_states
    if ids is None:
        return config  # both read the default (2, L // 2, L - 3)
    if len(set(ids)) != len(ids):
        raise DynvocabError(
            f"this EAGLE-3 head reads target hidden states {list(ids)} with repeats, which vLLM reads once each "
            "(its fc would not fit); use a head over distinct layers"
        )
    return {**config, "eagle_aux_hidden_state_layer_ids": list(ids)}


def _check_out(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise DynvocabError(f"--out {out} exists and is not an empty folder; remove it or pick another --out")
    if not out.parent.is_dir():
        raise DynvocabError(f"folder {out.parent} for --out does not exist; create it or pick another --out")


def _link_files(source: Path, staged: Path, copy: bool) -> None:
    """Link (absolute path) or copy every file of the draft folder but its config and hidden files."""
    for item in sorted(source.iterdir()):
        if item.name in ("config.json", Path(POLICY_FILE).parts[0]) or item.name.startswith("."):
            continue
        dest = staged / item.name
        if not copy:
            os.symlink(item.resolve(), dest)
        elif item.is_dir():
            shutil.copytree(item, dest)
        else:
            shutil.copy2(item, dest)


def section(strategy: str, budget: int | None, kind: str, own: str, bundle) -> dict:
    """The ``config.json`` section the plugin reads (``head.draft_section``), with where the policy came from."""
    from dynvocab.version import __version__
    from dynvocab.runtime.policies.batch_select import bundle_stages

    kept = [s for s in (*bundle_stages(strategy), "freq") if bundle.has(s)]
    return {
        "format": FOLDER_FORMAT,
        "strategy": strategy,
        "budget": budget,
        "policy_file": POLICY_FILE,
        "kind": kind,
        "method": METHODS[kind],
        "base_architecture": own,
        "bundle": {
            "path": str(Path(bundle.path).resolve()),
            "fingerprint": {role: fp.as_dict() for role, fp in bundle.fingerprints.items()},
            "stages": {s: bundle.stage_checksum(s) for s in dict.fromkeys(kept)},
        },
        "dynvocab_version": __version__,
    }


def write_draft_folder(bundle: str | Path, draft: str, strategy: str, out: str | Path, budget: int | None = None,
                       copy: bool = False) -> DraftFolder:
    """Write ``out``: a draft folder vLLM loads as it is, whose head runs ``strategy``'s selector from ``bundle``
    over ``draft`` (a local model folder, ``demo:draft``, or an EAGLE head in the eagle layout). ``budget``: the
    selector's size (fr: ids; lowrank: candidates; centroids: blocks; None: the bundle's default); ``copy``: copy
    the draft's files instead of linking them. Every refusal is a one-line :class:`DynvocabError`."""
    from dynvocab.artifacts import load_bundle, write_bundle
    from dynvocab.files import publish_dir, temp_dir_for
    from dynvocab.runtime.drafts import find_kind
    from dynvocab.runtime.policies.batch_select import SelectorSpec, build_selector, bundle_stages, refusal

    why = refusal(strategy)
    if why:
        raise DynvocabError(why)
    if budget is not None and budget < 1:
        raise DynvocabError(f"--budget must be at least 1 (got {budget})")
    out = Path(out).expanduser()
    _check_out(out)
    spec, source, config = _draft_folder(draft)
    kind = find_kind(spec)[0].name
    if kind not in METHODS:
        raise DynvocabError(f"draft kind '{kind}' has no vLLM speculative method; use a draft model or EAGLE head")
    own, architecture = _architecture(kind, config, draft)
    source_ids = config.get("eagle_aux_hidden_state_layer_ids")
    config = _eagle_config(kind, config, source)
    text = config.get("text_config") or config
    _check_head(kind, text, strategy)
    with load_bundle(bundle, verify=True) as src:
        for stage in bundle_stages(strategy):
            src.require(stage)
        _check_fits(src, kind, spec, text, draft)
        kept = dict.fromkeys(s for s in (*bundle_stages(strategy), "freq") if src.has(s))
        stages = [src.load_stage(s) for s in kept]
        fingerprints = (src.fingerprints["target"], src.fingerprints.get("draft"))
        meta = section(strategy, budget, kind, own, src)
    if config.get("eagle_aux_hidden_state_layer_ids") != source_ids:  # the head's own ids, as its layout writes them
        meta["source_eagle_aux_hidden_state_layer_ids"] = source_ids
    vocab = int(text.get("draft_vocab_size") or text["vocab_size"])  # the head's rows, as head.load_policy reads
    staged = temp_dir_for(out)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staged, 0o777 & ~umask)
        (staged / POLICY_FILE).parent.mkdir(parents=True, exist_ok=True)
        write_bundle(staged / POLICY_FILE, stages, *fingerprints)
        with load_bundle(staged / POLICY_FILE, verify=True) as policy:  # a folder that cannot build is never written
            selector = build_selector(policy, SelectorSpec(strategy, budget), vocab, int(text["hidden_size"]))
        (staged / "config.json").write_text(
            json.dumps({**config, "architectures": [architecture], CONFIG_KEY: meta}, indent=2) + "\n")
        _link_files(source, staged, copy)
        publish_dir(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return DraftFolder(out, strategy, kind, METHODS[kind], architecture, int(selector.k))
