"""EAGLE-3 heads through vllm-project/speculators' own code, both directions (the result:
docs/measurements/2026-11-23-interop-speculators-roundtrip.md).

Not in CI: speculators 0.9.0 pins transformers<=5.19.0 and requires torchvision/torchaudio, so it cannot share
`.ci/run`'s environment and pass `pip check`. Run it in a venv of its own:

    python3 -m venv /tmp/venv-spec && /tmp/venv-spec/bin/pip install torch==2.13.0
    /tmp/venv-spec/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0
    /tmp/venv-spec/bin/pip install "transformers>=5,<=5.19.0" pydantic pydantic-settings "loguru<=0.7.3" \
        safetensors openai "datasets<=5.1.0" psutil protobuf httpx aiohttp click typer rich tqdm
    PYTHONPATH=$PWD /tmp/venv-spec/bin/python scripts/speculators_roundtrip.py [--json out.json]

Targets: tiny random Llama / Qwen2 / Qwen3 models (hidden 64, vocabulary 1,000, 8 layers), each saved to a folder
that is the verifier. Per target, explicit aux ids or none, full or reduced (256) draft vocabulary:

- dynvocab writes (``save_eagle(layout="speculators")``) -> speculators reads (``Eagle3DraftModel.from_pretrained``);
- speculators writes (``from_training_args`` with its train CLI's draft config, ``save_pretrained``) -> dynvocab
  reads (``load_eagle``), plain and with speculators' train defaults (norm_before_fc, norm_output, 2,048-token
  sliding window);
- an SGLang-layout head (``eagle3``, explicit ids = output of layer i) loaded by dynvocab, written as speculators,
  read by speculators.

Each row: loads (no missing/unexpected keys, no NaN), same layers (the target hidden states each side feeds, as
``hidden_states`` indices, and the tapped features equal to transformers' ``output_hidden_states``), logits
max|diff| and argmax equality at TTT step 0 (all positions) and step 1 (the head's own feature fed back).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
try:  # speculators logs every file it resolves
    from loguru import logger

    logger.remove()
except ImportError:
    pass
L, D, V, REDUCED, N = 8, 64, 1000, 256, 12


def make_target(arch: str, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    cfg = cls(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


def draft_ids(full: bool) -> torch.Tensor:
    return torch.arange(V) if full else torch.randperm(V, generator=torch.Generator().manual_seed(1))[:REDUCED].sort().values


def spec_logits(model, feats, ids, steps: int = 2) -> list[torch.Tensor]:
    """speculators' forward with a hook on lm_head: the logits of each TTT step [n, Vd]."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out[0].detach()))
    with torch.no_grad():
        model(hidden_states=feats, input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=torch.arange(ids.shape[1])[None], ttt_steps=steps)
    hook.remove()
    return seen


def dyn_logits(head, feats, ids) -> list[torch.Tensor]:
    """dynvocab's head: step 0 over all positions; step 1 at index n-2 (token ids[n-1], its own step-0 feature),
    which sees what speculators' step 1 sees there (the step-0 keys up to n-2 and itself)."""
    n = ids.shape[1]
    with torch.no_grad():
        feature, head_in = head(ids, feats, torch.arange(n)[None])
        step0 = head.lm_head(head_in)[0]
        cache = head.new_cache()
        head(ids[:, : n - 1], feats[:, : n - 1], torch.arange(n - 1)[None], cache)
        _, h1 = head(ids[:, n - 1 :], feature[:, n - 2 : n - 1], torch.tensor([[n - 1]]), cache)
        return [step0, head.lm_head(h1)[0, 0]]


def compare(spec: list[torch.Tensor], dyn: list[torch.Tensor]) -> dict:
    n = spec[0].shape[0]
    a0, b0 = spec[0], dyn[0]
    a1, b1 = spec[1][n - 2], dyn[1]
    diff = max(float((a0 - b0).abs().max()), float((a1 - b1).abs().max()))
    same = bool(torch.equal(a0.argmax(-1), b0.argmax(-1))) and int(a1.argmax()) == int(b1.argmax())
    return {"max_abs_diff": diff, "argmax_equal": same}


def same_layers(target_dir: Path, spec_ids: list[int], dyn_layers: tuple[int, ...]) -> bool:
    """speculators' ids read as hidden_states[i] == dynvocab's tapped layers, and the tapped features equal
    transformers' output_hidden_states there (index L, the pre-norm last output, is compared as the tap's)."""
    from transformers import AutoModelForCausalLM

    from dynvocab.models.eagle import LayerTap

    if tuple(spec_ids) != tuple(dyn_layers):
        return False
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    tap = LayerTap(target, dyn_layers)
    with torch.no_grad():
        hs = target(torch.arange(5)[None], output_hidden_states=True).hidden_states
    feats = tap.features().view(5, len(dyn_layers), D)
    tap.remove()
    return all(torch.allclose(feats[:, k], hs[i][0]) for k, i in enumerate(dyn_layers) if i < L)


def load_in_speculators(folder: Path):
    from safetensors import safe_open
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"  # CPU: no flex attention
    model = Eagle3DraftModel.from_pretrained(folder, config=config).eval()
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    ignored = set(Eagle3DraftModel._keys_to_ignore_on_save)
    own = set(model.state_dict()) - ignored
    missing, unexpected = sorted(own - keys), sorted(keys - own)
    nan = any(bool(t.isnan().any()) for t in model.state_dict().values() if t.is_floating_point())
    return model, {"missing": missing, "unexpected": unexpected, "nan": nan}


def dynvocab_writes(target_dir: Path, arch: str, explicit: bool, full: bool, out: Path, via_eagle3: bool = False) -> dict:
    from dynvocab.models.eagle import EAGLE3, EagleModel, config_like, load_eagle, read_config, save_eagle
    from transformers import AutoConfig, AutoModelForCausalLM

    layer = AutoConfig.from_pretrained(target_dir)
    aux = (1, 4, 7) if explicit else None
    cfg = config_like(layer, EAGLE3, arch="qwen3" if arch == "qwen3" else "llama", draft_vocab_size=V if full else REDUCED,
                      target_hidden_size=D, aux_hidden_states=aux, norm_before_residual=True)
    torch.manual_seed(2)
    head = EagleModel(cfg).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
        head.embed_tokens.weight.copy_(AutoModelForCausalLM.from_pretrained(target_dir).get_input_embeddings().weight)
        head.set_draft_vocab(draft_ids(full))
    if via_eagle3:  # SGLang layout first (its ids: output of layer i), then dynvocab converts it
        save_eagle(head, out / "eagle3", layout="eagle3", embeddings=True)
        head = load_eagle(out / "eagle3")
    save_eagle(head, out / "spec", layout="speculators", target_name=str(target_dir))
    dyn = load_eagle(out / "spec")
    model, info = load_in_speculators(out / "spec")
    g = torch.Generator().manual_seed(3)
    feats, ids = torch.randn(1, N, 3 * D, generator=g), torch.randint(0, V, (1, N), generator=g)
    row = {"loads": not (info["missing"] or info["unexpected"] or info["nan"]), **info}
    row["same_layers"] = same_layers(target_dir, model.config.eagle_aux_hidden_state_layer_ids,
                                     read_config(out / "spec").target_layers(L))
    row["spec_ids"] = model.config.eagle_aux_hidden_state_layer_ids
    row.update(compare(spec_logits(model, feats, ids), dyn_logits(dyn, feats, ids)))
    return row


def speculators_writes(target_dir: Path, arch: str, explicit: bool, full: bool, defaults: bool, out: Path) -> dict:
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    from dynvocab.models.eagle import load_eagle, read_config

    draft_arch = "qwen3" if arch == "qwen3" else "llama"
    tl = create_transformer_layer_config(str(target_dir), 1, draft_arch, None, 2048 if defaults else 4096,
                                         [] if defaults else [0])
    ids_ = draft_ids(full)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids_] = True
    d2t = ids_ - torch.arange(ids_.numel())
    model = Eagle3DraftModel.from_training_args(
        tl, t2d=None if full else t2d, d2t=None if full else d2t, verifier_name_or_path=str(target_dir),
        target_layer_ids=[1, 4, 7] if explicit else None, draft_vocab_size=V if full else REDUCED,
        norm_before_residual=True, norm_before_fc=defaults, norm_output=defaults, ttt_steps=3, draft_attn_impl="eager",
    ).eval()
    torch.manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_", "lm_head")):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out / "spec")
    dyn = load_eagle(out / "spec")
    g = torch.Generator().manual_seed(3)
    feats, ids = torch.randn(1, N, 3 * D, generator=g), torch.randint(0, V, (1, N), generator=g)
    row = {"loads": True, "spec_ids": model.config.eagle_aux_hidden_state_layer_ids,
           "options": {k: getattr(dyn.config, k) for k in ("norm_before_fc", "norm_output", "sliding_window", "arch")}}
    row["same_layers"] = same_layers(target_dir, model.config.eagle_aux_hidden_state_layer_ids,
                                     read_config(out / "spec").target_layers(L))
    row.update(compare(spec_logits(model, feats, ids), dyn_logits(dyn, feats, ids)))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for arch in ("llama", "qwen2", "qwen3"):
            target = make_target(arch, root / f"target-{arch}")
            for explicit in (False, True):
                for full in (False, True):
                    case = {"target": arch, "draft_layer": "qwen3" if arch == "qwen3" else "llama",
                            "aux_ids": "explicit" if explicit else "default", "draft_vocab": "full" if full else "reduced"}
                    tag = f"{arch}-{explicit}-{full}"
                    writers = [
                        ("dynvocab", lambda o: dynvocab_writes(target, arch, explicit, full, o)),
                        ("dynvocab eagle3 -> speculators", lambda o: dynvocab_writes(target, arch, explicit, full, o, True)),
                        ("speculators", lambda o: speculators_writes(target, arch, explicit, full, False, o)),
                        ("speculators train defaults", lambda o: speculators_writes(target, arch, explicit, full, True, o)),
                    ]
                    if arch == "qwen3":  # the eagle3 (SGLang) layout holds llama layers only: refused by design
                        writers.pop(1)
                    for writer, run in writers:
                        reader = "dynvocab" if writer.startswith("speculators") else "speculators"
                        out = root / f"{tag}-{writer.replace(' ', '_')}"
                        try:
                            result = run(out)
                        except Exception as exc:  # a refusal or a failure is a table cell too
                            result = {"loads": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                        row = {**case, "writer": writer, "reader": reader, **result}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r for r in rows if not (r.get("loads") and r.get("same_layers") and r.get("argmax_equal"))]
    print(f"{len(rows) - len(bad)}/{len(rows)} rows load, feed the same layers and agree on every argmax")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
