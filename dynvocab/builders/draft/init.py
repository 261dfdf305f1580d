"""Start an EAGLE head from its target: real weight shapes and statistics, not a trained head.

- EAGLE-1: the target's last decoder layer (without ``input_layernorm``; of another family's layer, its
  projections only), its embeddings (scaled as the target scales them), and ``fc`` as [0 | I] (the feature passes
  through). A runnable head with real weight shapes and statistics, not a trained one.
- EAGLE-3: only where the shapes allow. The layer's q/k/v read ``cat(input_layernorm(embedding), hidden_norm(h))``
  (2d wide), so the target's last-layer q/k/v fill the hidden half and the embedding half keeps its random start;
  o_proj, the MLP and the norms are copied as they are; ``norm`` is the target's final norm; ``lm_head`` is the
  target's head rows of the draft vocabulary; ``fc`` passes the highest tapped layer through ([0 | 0 | I]). Only
  tensors whose shapes match are copied, so a target of another family still gets a runnable head.
- Either kind, ``--init-from HEAD``: a trained head's own weights replace that start (continued training, e.g. on
  more self-distilled documents or with more training-time-test steps), refused where its kind, shapes or draft
  vocabulary differ from the head the run builds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dynvocab.errors import DynvocabError
from dynvocab.models.eagle import EAGLE1, EAGLE3, EagleModel, load_eagle
from dynvocab.models.eagle.checkpoint import detect_kind, eagle_checkpoint
from dynvocab.models.loading import resolve_model


def init_eagle1_from_target(model: EagleModel, target_model) -> EagleModel:
    """Initialise the EAGLE-1 head ``model`` from ``target_model`` (see the module docstring); returns it."""
    if model.kind != EAGLE1:
        raise DynvocabError("init_eagle1_from_target builds EAGLE-1 heads")
    body = getattr(target_model, target_model.base_model_prefix)
    last = {k: v for k, v in body.layers[-1].state_dict().items() if not k.startswith("input_layernorm")}
    with torch.no_grad():
        layer = model.layers[0]
        if set(last) == set(layer.state_dict()):
            layer.load_state_dict(last)
        else:  # another family's layer (Gemma-3: sandwich norms of another form): its projections only
            own = layer.state_dict()
            for name, tensor in own.items():
                if name.endswith("_proj.weight") and name in last and last[name].shape == tensor.shape:
                    tensor.copy_(last[name])
        model.embed_tokens.weight.copy_(body.embed_tokens.weight)
        model.pair_with(target_model)
        d = model.config.hidden_size
        model.fc.weight.zero_()
        model.fc.weight[:, d:].copy_(torch.eye(d))
        if model.fc.bias is not None:
            model.fc.bias.zero_()
    return model


@torch.no_grad()
def init_eagle3_from_target(head: EagleModel, target_model, draft_ids: torch.Tensor) -> list[str]:
    """Copy what fits from ``target_model`` into ``head`` (draft row i = target id ``draft_ids[i]``); returns the
    names of the tensors copied."""
    assert head.kind == EAGLE3
    body = getattr(target_model, target_model.base_model_prefix)
    last = {k: v.float() for k, v in body.layers[-1].state_dict().items()}
    own = head.midlayer.state_dict()
    d = head.config.hidden_size
    copied = []
    for name, tensor in own.items():
        src = last.get(name)
        if src is None and name == "hidden_norm.weight":
            src = last.get("input_layernorm.weight")
        if src is None:
            continue
        if tensor.shape == src.shape:
            tensor.copy_(src)
            copied.append(f"midlayer.{name}")
        elif tensor.dim() == 2 and tensor.shape == (src.shape[0], 2 * src.shape[1]) and src.shape[1] == d:
            tensor[:, d:].copy_(src)  # q/k/v: the hidden half of the 2d-wide input
            copied.append(f"midlayer.{name}[:, d:]")
    norm = body.norm.weight
    if head.norm.weight.shape == norm.shape:
        head.norm.weight.copy_(norm.float())
        copied.append("norm.weight")
    weight = target_model.get_output_embeddings().weight  # [V, d]
    if weight.shape[1] == d:
        head.lm_head.weight.copy_(weight[draft_ids.to(weight.device)].float())
        copied.append("lm_head.weight")
    head.pair_with(target_model)
    embed = body.embed_tokens.weight
    if head.embed_tokens.weight.shape == embed.shape:
        head.embed_tokens.weight.copy_(embed.float())
        copied.append("embed_tokens.weight")
    if head.config.target_hidden == d:
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * d :].copy_(torch.eye(d))
        copied.append("fc.weight (identity on the highest layer)")
    return copied


def check_init_head(source: str, kind: str) -> Path:
    """The folder of the trained EAGLE head ``source`` names (a folder, a hub id or a ``demo:`` head), refused in one
    line where it is none or of another kind than ``kind``."""
    folder = eagle_checkpoint(resolve_model(source))
    if folder is None:
        raise DynvocabError(f"--init-from {source} is not an EAGLE head (no EAGLE config.json and weights there)")
    found = detect_kind(folder)
    if found != kind:
        names = {EAGLE1: "eagle1", EAGLE3: "eagle3"}
        raise DynvocabError(f"--init-from {source} is an {names[found]} head; pass --arch {names[found]}")
    return folder


@torch.no_grad()
def init_from_head(head: EagleModel, source: str, target_model) -> EagleModel:
    """Load the weights of the trained EAGLE head ``source`` (see :func:`check_init_head`) into ``head``, which keeps
    its target's embeddings; returns it. Refuses a head of another kind, shape or draft vocabulary."""
    folder = check_init_head(source, head.kind)
    embeddings = getattr(target_model, target_model.base_model_prefix).embed_tokens.weight.detach().float()
    try:
        trained = load_eagle(folder, embeddings=embeddings)
    except DynvocabError as exc:
        raise DynvocabError(f"--init-from {source}: {exc}") from exc
    own = head.own_state()
    theirs = trained.state_dict()
    wrong = [k for k, v in own.items() if k not in theirs or theirs[k].shape != v.shape]
    if wrong:
        raise DynvocabError(f"--init-from {source} is shaped for another target ({wrong[0]} differs); train it anew")
    if head.kind == EAGLE3 and not torch.equal(theirs["d2t"].cpu(), own["d2t"].cpu()):
        raise DynvocabError(
            f"--init-from {source} has another draft vocabulary; pass the --bundle (or data) it was trained with"
        )
    for name, tensor in own.items():
        tensor.copy_(theirs[name])
    return head
