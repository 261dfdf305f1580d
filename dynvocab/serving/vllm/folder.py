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

What differs between draft kinds (vLLM's method, the config's rewrite, the head's vocabulary) is one row of
:mod:`dynvocab.serving.vllm.kinds`. For a ``demo:`` draft the section also names the local folder of the demo target
it drafts for (``models.demo.demo_target``), the folder to give vLLM as ``model=``.

The folder is staged beside ``out`` and renamed into place once its selector has been built from it, so it appears
whole or not at all. Every refusal is one line saying what to do. ``dynvocab export --format vllm`` finds this
writer through the entry point ``dynvocab.export_formats: vllm`` (:data:`EXPORT_FORMAT`), so ``artifacts`` never
imports the serving room.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dynvocab.artifacts.export import ExportFormat, Exported, ExportRequest
from dynvocab.errors import DynvocabError
from dynvocab.models.eagle.config import head_rows
from dynvocab.serving.vllm.kinds import VllmKind, vllm_kind
from dynvocab.serving.vllm.names import ARCHITECTURES, CONFIG_KEY, FOLDER_FORMAT, POLICY_FILE, registered_name
from dynvocab.serving.vllm.schedule import SCHEDULE_KEY


@dataclass(frozen=True)
class DraftFolder:
    """A written draft folder: where it is and what its head runs."""

    path: Path
    strategy: str
    kind: str  # draft kind: draft-model, eagle1, eagle3
    method: str  # vLLM's speculative_config["method"]
    architecture: str  # the registered architecture its config.json names
    ids: int  # the selector's set size k
    target: Path | None = None  # a demo draft's: the local folder of the demo target, vLLM's model=
    gamma: int | None = None  # num_speculative_tokens for the speculative_config (None: not said)
    schedule: tuple | None = None  # vLLM's num_speculative_tokens_per_batch_size ranges (None: none)

    def summary(self) -> str:
        """``vllm, STRATEGY, N ids, ARCHITECTURE`` for the CLI's one line."""
        return f"vllm, {self.strategy}, {self.ids:,} ids, {self.architecture}"

    def speculative_config(self) -> dict:
        """The ``speculative_config`` that runs this folder in vLLM (greedy drafts through the plugin's
        ``get_top_tokens``; the γ and schedule where they were given)."""
        spec = {"method": self.method, "model": str(self.path)}
        if self.gamma is not None:
            spec["num_speculative_tokens"] = self.gamma
        spec["use_local_argmax_reduction"] = True
        if self.schedule:
            spec[SCHEDULE_KEY] = [list(r) for r in self.schedule]
        return spec

    def notes(self) -> tuple[str, ...]:
        """What to give vLLM: one line (the target too where dynvocab knows it, a demo draft's)."""
        spec = json.dumps(self.speculative_config())
        if self.target is None:
            return (f"vLLM: speculative_config={spec}",)
        return (f"vLLM: model={self.target}, speculative_config={spec}",)


def supported() -> str:
    """The (kind, architecture) pairs the plugin registers, for error messages."""
    return ", ".join(f"{kind} {arch}" for kind, arch in ARCHITECTURES)


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


def _architecture(row: VllmKind, config: dict, draft: str) -> tuple[str, str]:
    """(the draft's own architecture, the plugin's registered name for it); refused when the plugin has none."""
    if "speculators_model_type" in config:
        raise DynvocabError(
            f"{draft} is an EAGLE head in the speculators layout, which vLLM converts on loading; write it in the "
            "eagle layout (`dynvocab train-draft --format eagle`) and export that"
        )
    own = (config.get("architectures") or ["(none)"])[0]
    name = registered_name(row.name, row.base_architecture(own))
    if name is None:
        raise DynvocabError(f"the vLLM plugin has no {row.name} of architecture {own}; it supports: {supported()}")
    return own, name


def _check_fits(bundle, row: VllmKind, spec, text: dict, draft: str) -> None:
    """Refuse a bundle built for another model than this draft (compared without loading weights)."""
    role, diffs = row.fits(bundle, spec, text, draft)
    if diffs:
        built = bundle.fingerprints[role]
        raise DynvocabError(
            f"bundle {bundle.path} was built for another {role} ({built.source or 'another model'}; "
            f"{', '.join(diffs)}) than --draft {draft}; pass the draft it was built for or rebuild the bundle"
        )


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


def section(strategy: str, budget: int | None, row: VllmKind, own: str, bundle) -> dict:
    """The ``config.json`` section the plugin reads (``head.draft_section``), with where the policy came from."""
    from dynvocab.runtime.batched import SelectorSpec, exported_stages
    from dynvocab.version import __version__

    kept = [s for s in exported_stages(strategy) if bundle.has(s)]
    lookup = SelectorSpec(strategy).lookup
    sizes = {} if lookup is None else {"ngram_max": lookup.longest, "ngram_min": lookup.shortest}
    return {
        "format": FOLDER_FORMAT,
        "strategy": strategy,
        "budget": budget,
        **sizes,
        "policy_file": POLICY_FILE,
        "kind": row.name,
        "method": row.method,
        "base_architecture": own,
        "bundle": {
            "path": str(Path(bundle.path).resolve()),
            "fingerprint": {role: fp.as_dict() for role, fp in bundle.fingerprints.items()},
            "stages": {s: bundle.stage_checksum(s) for s in dict.fromkeys(kept)},
        },
        "dynvocab_version": __version__,
    }


def _target_folder(draft: str) -> tuple[str, Path] | None:
    """A demo draft's demo target and its local folder (converted on first use, as every command does), else
    None."""
    from dynvocab.models.demo import demo_target

    target = demo_target(draft)
    if target is None:
        return None
    from dynvocab.models import resolve_model

    return target, Path(resolve_model(target).path)


def write_draft_folder(bundle: str | Path, draft: str, strategy: str, out: str | Path, budget: int | None = None,
                       copy: bool = False, gamma: int | None = None, schedule: str | None = None) -> DraftFolder:
    """Write ``out``: a draft folder vLLM loads as it is, whose head runs ``strategy``'s selector from ``bundle``
    over ``draft`` (a local model folder, ``demo:draft``, or an EAGLE head in the eagle layout). ``budget``: the
    selector's size (fr: ids; lowrank: candidates; centroids: blocks; None: the bundle's default); ``copy``: copy
    the draft's files instead of linking them; ``gamma`` and ``schedule`` (``START:K,…``, or the JSON a ``bench --vllm
    --schedule`` run wrote) go into the ``speculative_config`` the folder's notes print, and the schedule into its
    section. Every refusal is a one-line :class:`DynvocabError`."""
    from dynvocab.artifacts import load_bundle, write_bundle
    from dynvocab.files import publish_dir, temp_dir_for
    from dynvocab.runtime.batched import SelectorSpec, build_selector, bundle_stages, exported_stages, refusal
    from dynvocab.runtime.drafts.kinds import find_kind

    why = refusal(strategy)
    if why:
        raise DynvocabError(why)
    if budget is not None and budget < 1:
        raise DynvocabError(f"--budget must be at least 1 (got {budget})")
    ranges = None
    if schedule is not None:
        from dynvocab.serving.vllm.schedule import schedule_ranges

        if gamma is None:
            raise DynvocabError("--schedule needs --gamma (the num_speculative_tokens its ranges stay within)")
        ranges = schedule_ranges(schedule, gamma)
    out = Path(out).expanduser()
    _check_out(out)
    spec, source, config = _draft_folder(draft)
    row = vllm_kind(find_kind(spec)[0].name)
    why = refusal(strategy, row.name)
    if why:
        raise DynvocabError(why)
    own, architecture = _architecture(row, config, draft)
    source_ids = config.get("eagle_aux_hidden_state_layer_ids")
    config = row.rewrite(config, source)
    text = config.get("text_config") or config
    row.check_head(text, strategy)
    with load_bundle(bundle, verify=True) as src:
        for stage in bundle_stages(strategy):
            src.require(stage)
        _check_fits(src, row, spec, text, draft)
        kept = [s for s in exported_stages(strategy) if src.has(s)]
        stages = [src.load_stage(s) for s in kept]
        fingerprints = (src.fingerprints["target"], src.fingerprints.get("draft"))
        meta = section(strategy, budget, row, own, src)
    if ranges is not None:
        meta["speculative_config"] = {"num_speculative_tokens": gamma, SCHEDULE_KEY: ranges}
    if config.get("eagle_aux_hidden_state_layer_ids") != source_ids:  # the head's own ids, as its layout writes them
        meta["source_eagle_aux_hidden_state_layer_ids"] = source_ids
    target = _target_folder(draft)
    if target is not None:
        meta["demo_target"] = {"source": target[0], "folder": str(target[1])}
    staged = temp_dir_for(out)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staged, 0o777 & ~umask)
        (staged / POLICY_FILE).parent.mkdir(parents=True, exist_ok=True)
        write_bundle(staged / POLICY_FILE, stages, *fingerprints)
        with load_bundle(staged / POLICY_FILE, verify=True) as policy:  # a folder that cannot build is never written
            selector = build_selector(policy, SelectorSpec(strategy, budget), head_rows(text), int(text["hidden_size"]))
        (staged / "config.json").write_text(
            json.dumps({**config, "architectures": [architecture], CONFIG_KEY: meta}, indent=2) + "\n")
        _link_files(source, staged, copy)
        publish_dir(staged, out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return DraftFolder(out, strategy, row.name, row.method, architecture, int(selector.k),
                       None if target is None else target[1], gamma, None if ranges is None else tuple(map(tuple, ranges)))


def _export(bundle: Path, out: Path, request: ExportRequest) -> Exported:
    folder = write_draft_folder(bundle, request.draft, request.strategy, out, request.budget, request.copy,
                                request.gamma, request.schedule)
    return Exported(folder.path, folder.summary(), folder.notes())


# ``dynvocab export --format vllm``, declared in pyproject.toml's ``dynvocab.export_formats`` entry points
EXPORT_FORMAT = ExportFormat("vllm", _export,
                             "a draft folder vLLM loads, its head running --strategy's selector over --draft",
                             takes=("strategy", "draft", "budget", "copy", "gamma", "schedule"), needs=("strategy", "draft"), folder=True)
