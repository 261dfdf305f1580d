"""Phase 2 of ``train-draft``: the losses and the training-time test (TTT) unroll of an EAGLE head.

- **EAGLE-1** (SafeAILab/EAGLE ``eagle/train/main.py``): the head predicts the target's next feature; loss
  ``SmoothL1(f̂, f) + 0.1 · CE(softmax(W f), log_softmax(W f̂))`` with W the target's (frozen) LM head, and uniform
  noise on the input features (``AddUniformNoise``).
- **EAGLE-3** (``eagle/traineagle3/cnets.py``): soft cross-entropy against the target's distribution restricted
  to the draft vocabulary (``target_head[..., t2d]`` then softmax), only where the target's argmax is in the
  draft vocabulary (``position_mask``); a training-time test over several chained steps, step i weighted 0.8^i
  (``ploss_weight`` in ``eagle/traineagle3/main.py``).

The unroll (both kinds; EAGLE-1 with one step is the paper's recipe, more steps are HASS-style): step 0 pairs
token x_{t+1} with the target feature f_t at index t; step i > 0 pairs x_{t+1+i} with the head's own step-(i-1)
output at the same index. As in cnets.py's ``cache_hidden`` attention, a query of step i at index t attends the
step-0 keys of indices ≤ t and, of each later step, only its own index: exactly what drafting sees (the real
prefix, then its own drafts). RoPE positions advance by one per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynvocab.models.eagle import EAGLE1, EagleModel

EAGLE1_P_WEIGHT = 0.1  # main.py: p_w
STEP_DECAY = 0.8  # traineagle3/main.py: ploss_weight = 0.8 ** i


@dataclass
class StepResult:
    """One unroll step over a document: its loss and top-1 agreement counts."""

    loss: torch.Tensor  # scalar
    agree: int  # positions where the head's top-1 (as a target id) equals the target's argmax
    positions: int  # positions scored


def attention_mask(n: int, step: int, device) -> torch.Tensor:
    """Bool [1, 1, n, (step+1)·n]: causal over the step-0 keys, then only the same index of steps 1..step."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [n, n]
    eye = torch.eye(n, dtype=torch.bool, device=device)  # [n, n]
    return torch.cat([causal, *([eye] * step)], dim=1)[None, None]


def forward_step(model: EagleModel, ids, features, positions, cache, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``EagleModel.forward`` with an explicit attention mask (its own builds a causal one): (feature, head input),
    each [1, n, d]. ``tests/test_train_draft.py`` checks that step 0 equals ``model(...)``."""
    embeds = model.embed_tokens(ids).to(model.fc.weight.dtype)  # [1, n, d]
    rope = model.rotary_emb(embeds, position_ids=positions)
    kwargs = dict(attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, position_embeddings=rope)
    if model.kind == EAGLE1:
        out = model.layers[0](model.fc(torch.cat([embeds, features], dim=-1)), **kwargs)  # embedding first
        return out, out
    h = model.project(features) if features.shape[-1] != model.config.hidden_size else features
    out = model.midlayer(embeds, h, **kwargs)
    normed = model.norm(out)
    return (normed if model.config.norm_output else out), normed


def unroll(
    model: EagleModel,
    doc: dict[str, torch.Tensor],
    steps: int,
    target_head: torch.Tensor,
    draft_ids: torch.Tensor | None,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[StepResult]:
    """The losses of ``steps`` chained steps over one document.

    ``doc``: ``ids`` [T], ``argmax`` [T], ``last`` [T, d] (and ``aux`` [T, 3d] for EAGLE-3) from the feature
    cache. ``target_head`` [V, d]: EAGLE-1, the target's LM head; EAGLE-3, its rows for the draft vocabulary
    ([K, d], in draft order ``draft_ids`` [K]).
    """
    from transformers import DynamicCache

    device = model.fc.weight.device
    ids, argmax = doc["ids"].to(device), doc["argmax"].to(device)  # [T] each
    last = doc["last"].to(device)  # [T, d]
    n = ids.numel() - 1  # training indices t = 0..T-2
    steps = min(steps, n)
    features = (last if model.kind == EAGLE1 else doc["aux"].to(device))[:n][None]  # [1, n, f]
    if noise:
        features = features + (torch.rand(features.shape, generator=generator).to(device) - 0.5) * noise
    cache = DynamicCache(config=model.layer_config)
    results = []
    for i in range(steps):
        step_ids = F.pad(ids[1 + i :], (0, i))[None]  # [1, n]: x_{t+1+i}, padding past the end (masked)
        positions = torch.arange(i, n + i, device=device)[None]  # [1, n]
        features, head_in = forward_step(model, step_ids, features, positions, cache, attention_mask(n, i, device))
        valid = n - i  # indices whose target position t+1+i exists
        teacher, out = last[1 + i :], head_in[0, :valid]  # [valid, d] each
        if model.kind == EAGLE1:
            results.append(_eagle1_loss(out, teacher, target_head, argmax[1 + i :]))
        else:
            results.append(_eagle3_loss(model, out, teacher, target_head, draft_ids, argmax[1 + i :]))
    return results


def _eagle1_loss(out, teacher, head, argmax) -> StepResult:
    """main.py: vloss (SmoothL1 per position, mean over d) + 0.1 · soft CE through the target's head."""
    with torch.no_grad():
        p = torch.softmax(F.linear(teacher, head), dim=-1)  # [n, V]
    logits = F.linear(out, head)  # [n, V]
    vloss = F.smooth_l1_loss(out, teacher, reduction="none").mean(-1).mean()
    ploss = -(p * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    agree = int((logits.argmax(-1) == argmax).sum())
    return StepResult(vloss + EAGLE1_P_WEIGHT * ploss, agree, argmax.numel())


def _eagle3_loss(model, out, teacher, head_rows, draft_ids, argmax) -> StepResult:
    """cnets.py: soft CE over the draft vocabulary where the target's argmax is in it."""
    with torch.no_grad():
        p = torch.softmax(F.linear(teacher, head_rows), dim=-1)  # [n, K]
        keep = model.t2d[argmax].float()  # [n]
    logits = model.lm_head(out)  # [n, K]
    loss = -((p * torch.log_softmax(logits.float(), dim=-1)).sum(-1) * keep).sum() / argmax.numel()
    agree = int((draft_ids[logits.argmax(-1)] == argmax).sum())
    return StepResult(loss, agree, argmax.numel())


def weighted_loss(results: list[StepResult]) -> torch.Tensor:
    """Σ 0.8^i · loss_i (traineagle3/main.py)."""
    return sum(STEP_DECAY**i * r.loss for i, r in enumerate(results))
