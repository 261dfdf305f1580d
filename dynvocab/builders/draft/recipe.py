"""Phase 2 of ``train-draft``: the losses and the training-time test (TTT) unroll of an EAGLE head.

- **EAGLE-1** (SafeAILab/EAGLE ``eagle/train/main.py``): the head predicts the target's next feature; loss
  ``SmoothL1(f̂, f) + 0.1 · CE(softmax(W f), log_softmax(W f̂))`` with W the target's (frozen) LM head, and uniform
  noise on the input features (``AddUniformNoise``). With ``negatives`` the cross-entropy is a sampled one
  (:func:`candidate_rows`): it scores the target's cached top-k ids at the batch's positions and a uniform sample
  of the other ids, importance-weighted, instead of all V rows (for a 262k head, ~50× fewer rows, three times per
  token); the held-out evaluation always scores the full head.
- **EAGLE-3** (``eagle/traineagle3/cnets.py``): soft cross-entropy against the target's distribution restricted
  to the draft vocabulary (``target_head[..., t2d]`` then softmax), only where the target's argmax is in the
  draft vocabulary (``position_mask``); a training-time test over several chained steps, step i weighted 0.8^i
  (``ploss_weight`` in ``eagle/traineagle3/main.py``).

The unroll (both kinds; EAGLE-1 with one step is the paper's recipe, more steps are HASS-style): step 0 pairs
token x_{t+1} with the target feature f_t at index t; step i > 0 pairs x_{t+1+i} with the head's own step-(i-1)
output at the same index. As in cnets.py's ``cache_hidden`` attention, a query of step i at index t attends the
step-0 keys of indices ≤ t and, of each later step, only its own index: exactly what drafting sees (the real
prefix, then its own drafts). RoPE positions advance by one per step.

Several documents unroll together, right-padded to the longest: the mask above never lets a real index see a
later one, so the padding after a document is invisible to it and each document trains as it would alone. Losses
are *sums* over positions; :func:`weighted_loss` divides them by the positions they are averaged over (one
document's, or a whole global batch's spread over micro-batches and ranks: one mean over all its tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dynvocab.models.eagle import EAGLE1, EagleModel

EAGLE1_P_WEIGHT = 0.1  # main.py: p_w
STEP_DECAY = 0.8  # traineagle3/main.py: ploss_weight = 0.8 ** i


@dataclass
class StepResult:
    """One unroll step over one or several documents: its loss summed over positions, top-1 agreement counts."""

    loss: torch.Tensor  # scalar: Σ over the positions scored
    agree: int  # positions where the head's top-1 (as a target id) equals the target's argmax
    positions: int  # positions scored


def attention_mask(n: int, step: int, device) -> torch.Tensor:
    """Bool [1, 1, n, (step+1)·n]: causal over the step-0 keys, then only the same index of steps 1..step."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [n, n]
    eye = torch.eye(n, dtype=torch.bool, device=device)  # [n, n]
    return torch.cat([causal, *([eye] * step)], dim=1)[None, None]


def forward_step(model: EagleModel, ids, features, positions, cache, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``EagleModel.forward`` with an explicit attention mask (its own builds a causal one): (feature, head input),
    each [B, n, d]. ``tests/test_train_draft.py`` checks that step 0 equals ``model(...)``."""
    embeds = model.embed(ids)  # [B, n, d]
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
    docs: list[dict[str, torch.Tensor]],
    steps: int,
    target_head: torch.Tensor,
    draft_ids: torch.Tensor | None,
    noise: float = 0.0,
    generators: list[torch.Generator | None] | None = None,
    negatives: torch.Tensor | None = None,
) -> list[StepResult]:
    """The losses of ``steps`` chained steps over the documents ``docs`` (each of 2 tokens or more), together.

    Each doc: ``ids`` [T], ``argmax`` [T], ``last`` [T, d] (and ``aux`` [T, 3d] for EAGLE-3) from the feature
    cache. ``target_head`` [V, d]: EAGLE-1, the target's LM head; EAGLE-3, its rows for the draft vocabulary
    ([K, d], in draft order ``draft_ids`` [K]). ``generators[b]`` draws document b's feature noise (of its own
    shape, so a document gets the same noise in any batch). ``negatives`` [U] (EAGLE-1 only): the uniform sample of
    :func:`candidate_rows`; None scores the whole head.
    """
    from transformers import DynamicCache

    device = model.fc.weight.device
    lengths = [doc["ids"].numel() - 1 for doc in docs]  # training indices t = 0..T_b-2 per document
    n, B = max(lengths), len(docs)
    steps = min(steps, n)
    width = n + steps  # room for x_{t+1+i} and f_{t+1+i} at every index and step, padding past each end
    ids, argmax = _padded([d["ids"] for d in docs], width), _padded([d["argmax"] for d in docs], width)  # [B, width]
    last = _padded([d["last"] for d in docs], width).to(device)  # [B, width, d]
    inputs = []
    for b, doc in enumerate(docs):
        f = (doc["last"] if model.kind == EAGLE1 else doc["aux"])[: lengths[b]][None]  # [1, n_b, f]
        if noise:
            f = f + (torch.rand(f.shape, generator=generators[b] if generators else None) - 0.5) * noise
        inputs.append(f[0])
    features = _padded(inputs, n).to(device)  # [B, n, f]
    ids, argmax = ids.to(device), argmax.to(device)
    sampled = negatives is not None and model.kind == EAGLE1
    topk = _padded([d["topk"] for d in docs], width).to(device) if sampled else None  # [B, width, k]
    index = torch.arange(n, device=device)[None]  # [1, n]
    cache = DynamicCache(config=model.layer_config)
    results = []
    for i in range(steps):
        step_ids = ids[:, 1 + i : 1 + i + n]  # [B, n]: x_{t+1+i}, padding past each end (masked)
        positions = (index + i).expand(B, n)  # [B, n]
        features, head_in = forward_step(model, step_ids, features, positions, cache, attention_mask(n, i, device))
        valid = index < torch.tensor(lengths, device=device)[:, None] - i  # [B, n]: target position t+1+i exists
        out = head_in[valid]  # [N_i, d], document after document
        teacher, target_argmax = last[:, 1 + i : 1 + i + n][valid], argmax[:, 1 + i : 1 + i + n][valid]
        if sampled:
            rows, shift, ids_c = candidate_rows(target_head, topk[:, 1 + i : 1 + i + n][valid], target_argmax, negatives)
            results.append(_eagle1_loss(out, teacher, rows, target_argmax, shift, ids_c))
        elif model.kind == EAGLE1:
            results.append(_eagle1_loss(out, teacher, target_head, target_argmax))
        else:
            results.append(_eagle3_loss(model, out, teacher, target_head, draft_ids, target_argmax))
    return results


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """[B, width, ...]: each row's tensor at its start, zeros after."""
    out = rows[0].new_zeros((len(rows), width, *rows[0].shape[1:]))
    for b, row in enumerate(rows):
        out[b, : min(width, row.shape[0])] = row[:width]
    return out


def candidate_rows(head: torch.Tensor, topk: torch.Tensor, argmax: torch.Tensor, negatives: torch.Tensor):
    """The rows a sampled cross-entropy scores: (rows [C, d], logit shift [C], their ids [C]).

    C = the target's top-k ids at the positions (``topk`` [n, k]) and their argmax (the ids holding most of the
    target's mass), then the ``negatives`` [U] not among them, a uniform sample of the remaining R = V − |top| ids.
    Each sampled id's logit is shifted by log(R / U'), U' the sampled ids kept, so that its exp stands for the R/U'
    ids it represents: Σ over C of exp(logit + shift) is an unbiased estimate of the softmax's normaliser over all V
    (sampled softmax with a uniform proposal), for the target's distribution and the head's alike.
    """
    top = torch.unique(torch.cat([topk.reshape(-1), argmax]))  # [T]
    rest = negatives[~torch.isin(negatives, top)]  # [U']
    ids = torch.cat([top, rest])  # [C]
    shift = torch.zeros(ids.numel(), device=head.device)
    if rest.numel():
        shift[top.numel():] = math.log((head.shape[0] - top.numel()) / rest.numel())
    return head[ids], shift, ids


def _eagle1_loss(out, teacher, head, argmax, shift=None, ids=None) -> StepResult:
    """main.py: vloss (SmoothL1 per position, mean over d) + 0.1 · soft CE through the target's head, summed over
    positions. ``head`` is the whole head, or the candidate rows of :func:`candidate_rows` with their ``shift``
    and ``ids`` (then the agreement counted is the argmax among the candidates: a training figure only)."""
    with torch.no_grad():
        p = F.linear(teacher, head).float()  # [n, V] or [n, C]
        p = torch.softmax(p if shift is None else p + shift, dim=-1)
    logits = F.linear(out, head).float()  # [n, V] or [n, C]
    if shift is not None:
        logits = logits + shift
    vloss = F.smooth_l1_loss(out.float(), teacher, reduction="none").mean(-1).sum()
    ploss = -(p * torch.log_softmax(logits, dim=-1)).sum(-1).sum()
    best = logits.argmax(-1)
    agree = int(((best if ids is None else ids[best]) == argmax).sum())
    return StepResult(vloss + EAGLE1_P_WEIGHT * ploss, agree, argmax.numel())


def _eagle3_loss(model, out, teacher, head_rows, draft_ids, argmax) -> StepResult:
    """cnets.py: soft CE over the draft vocabulary where the target's argmax is in it, summed over positions."""
    with torch.no_grad():
        p = torch.softmax(F.linear(teacher, head_rows).float(), dim=-1)  # [n, K]
        keep = model.t2d[argmax].float()  # [n]
    logits = model.lm_head(out)  # [n, K]
    loss = -((p * torch.log_softmax(logits.float(), dim=-1)).sum(-1) * keep).sum()
    agree = int((draft_ids[logits.argmax(-1)] == argmax).sum())
    return StepResult(loss, agree, argmax.numel())


def weighted_loss(results: list[StepResult], positions: list[int] | None = None) -> torch.Tensor:
    """Σ 0.8^i · loss_i / positions_i (traineagle3/main.py): the mean per position of each step, over the results'
    own positions, or over ``positions[i]`` when they are part of a larger batch (a share of a global batch)."""
    counts = positions if positions is not None else [r.positions for r in results]
    return sum(STEP_DECAY**i * r.loss / counts[i] for i, r in enumerate(results) if counts[i])
