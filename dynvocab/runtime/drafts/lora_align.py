"""EvoSpec's online alignment: LoRA on the draft's q/v projections, trained on mismatched cycles.

A *sample* is one cycle whose drafted token was rejected while the target's token lay inside the active
vocabulary (paper §3.2 Path B; Algorithm 1 lines 22–25): the context before the cycle, the verified path
``x_1 … x_{k+1}`` (k accepted draft tokens + the target's correction) and the target's top-K_logit logits
``z_j`` at those k+1 positions. When the replay buffer holds ``buffer_size`` samples one optimiser step runs
on the curriculum-weighted distillation loss of Eq. 4–5 and the buffer is cleared (Algorithm 1, 26–29):

    J = mean over samples of  Σ_j  w_j · T² · KL(p̂_j ‖ q̃_j),     w_j = exp(−β · L_base · (j − 1))

with p̂_j = softmax(z_j / T) and q̃_j = softmax(draft logits on the same K ids / T), and L_base the draft's
first-step cross-entropy against the verified token x_1 (detached). The paper sums over the buffer; we
average so the step size does not depend on the buffer size.

The draft model is shared (one loaded model serves every strategy of a bench), so the adapter is
temporary: :meth:`Aligner.close` puts the original ``nn.Linear`` objects back, restores every parameter's
``requires_grad`` and removes what peft added to the model, leaving it as it was, bit for bit. Base weights
are never written (LoRA is not merged). Output stays lossless whatever the draft does: the target verifies.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dynvocab.errors import DynvocabError

_ADAPTED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models carrying a live adapter


@dataclass(frozen=True)
class AlignConfig:
    """Online alignment knobs; defaults from EvoSpec Table 5 unless marked."""

    rank: int = 32  # LoRA r
    alpha: int = 32  # LoRA α
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")  # W_q, W_v (Table 5 note)
    buffer_size: int = 32  # replay buffer B; one update each time it fills
    lr: float = 1e-5  # η
    beta: float = 0.3  # curriculum sensitivity β (Eq. 4, Appendix C)
    t_kd: float = 1.0  # distillation temperature T_KD
    k_logit: int = 64  # retained target logits K_logit — not given by the paper
    context_tokens: int = 128  # context kept per sample (ours: bounds the update's cost on long sequences)
    micro_batch: int = 8  # samples per forward/backward (ours: bounds activation memory)
    weight_decay: float = 0.0  # AdamW (the paper names no optimiser; Adam-style state is what it compares)


@dataclass
class Sample:
    """One replay-buffer entry (tensors are normal, not inference-mode, so they can enter autograd)."""

    ids: torch.Tensor  # [L] draft input: context[-C:] + the k accepted tokens
    first: int  # x_1, the verified token at the first position (for L_base)
    z_ids: torch.Tensor  # [m, K] the target's top-K ids at the m = k+1 verified positions
    z: torch.Tensor  # [m, K] their logits (float32)


@dataclass
class AlignStats:
    """What the aligner did in one generation."""

    samples: int = 0
    updates: int = 0
    update_s: float = 0.0
    last_loss: float | None = None
    losses: list[float] = field(default_factory=list)


class Aligner:
    """Trains a temporary adapter (or, for memory comparisons only, base weights) of a draft CausalLM.

    ``trainable``: ``"lora"`` (the runtime path), ``"full-qv"`` (the same q/v modules, full weights) or
    ``"full"`` (every draft parameter). The two full modes write the base weights; use them only on a model
    of your own (tests/test_align.py compares the state each mode keeps).
    """

    def __init__(self, lm, cfg: AlignConfig = AlignConfig(), trainable: str = "lora"):
        if trainable not in ("lora", "full-qv", "full"):
            raise ValueError(f"unknown trainable mode {trainable!r}")
        self.lm = lm  # dynvocab.runtime.drafts.lm.CausalLM
        self.cfg = cfg
        self.trainable = trainable
        self.model: torch.nn.Module = lm.model
        self.vocab_size = lm.vocab_size
        self.buffer: list[Sample] = []
        self.stats = AlignStats()
        self._closed = False
        self._restore = None
        self.grad_bytes = 0  # gradient memory of the last update (for memory reports)
        with torch.inference_mode(False):
            self.params = self._setup()
            self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        if self._restore is not None:
            # If the owner forgets close(), dropping the aligner still restores the shared model.
            self._finalizer = weakref.finalize(self, self._restore)

    # -- set-up and tear-down -------------------------------------------------------------------------
    def _setup(self) -> list[torch.nn.Parameter]:
        model = self.model
        if model in _ADAPTED:
            raise DynvocabError("the draft model already carries an alignment adapter; close the other policy first")
        flags = {name: p.requires_grad for name, p in model.named_parameters()}
        if self.trainable != "lora":
            for name, p in model.named_parameters():
                p.requires_grad_(self.trainable == "full" or _is_target(name, self.cfg.target_modules))
            self._restore = _Restorer(model, flags, {}, set())
            return [p for p in model.parameters() if p.requires_grad]

        from peft import LoraConfig, inject_adapter_in_model

        targets = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in self.cfg.target_modules
        }
        if not targets:
            raise DynvocabError(
                f"the draft has no {'/'.join(self.cfg.target_modules)} projections to adapt; run without --online-align"
            )
        attrs = set(vars(model))
        lora = LoraConfig(
            r=self.cfg.rank,
            lora_alpha=self.cfg.alpha,
            target_modules=list(self.cfg.target_modules),
            lora_dropout=0.0,
            bias="none",
        )
        inject_adapter_in_model(lora, model)
        _ADAPTED.add(model)
        self._restore = _Restorer(model, flags, targets, set(vars(model)) - attrs)
        params = [p for name, p in model.named_parameters() if "lora_" in name]
        for p in params:
            if p.dtype in (torch.float16, torch.bfloat16):
                p.data = p.data.float()  # lr 1e-5 steps vanish in bf16; peft casts inputs to the adapter dtype
            p.requires_grad_(True)
        return params

    def close(self) -> None:
        """Remove the adapter and restore the model exactly (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.buffer.clear()
        self.optimizer = None
        self.params = []
        if self._restore is not None:
            self._finalizer()  # runs _Restorer once

    # -- the replay buffer ------------------------------------------------------------------------------
    def add(self, context: list[int], path: list[int], target_logits: torch.Tensor) -> bool:
        """Queue a mismatched cycle: ``context`` tokens before it, the verified ``path`` [m] (accepted tokens +
        correction) and the target's logits at those positions [m, V]. Runs an update when the buffer fills;
        returns whether it did."""
        if self._closed or not path:
            return False
        cfg = self.cfg
        m = len(path)
        with torch.inference_mode(False):
            ctx = context[-cfg.context_tokens:] if cfg.context_tokens > 0 else context
            ids = torch.tensor(ctx + path[:-1], dtype=torch.long)  # [L]
            k = min(cfg.k_logit, self.vocab_size)
            z, z_ids = target_logits[:m, : self.vocab_size].float().topk(k, dim=-1)  # [m, K]
            self.buffer.append(Sample(ids, int(path[0]), z_ids.clone(), z.clone()))
        self.stats.samples += 1
        if len(self.buffer) >= cfg.buffer_size:
            self.update()
            return True
        return False

    # -- the update ---------------------------------------------------------------------------------------
    def loss(self, samples: list[Sample]) -> torch.Tensor:
        """Σ over ``samples`` of Σ_j w_j T² KL(p̂_j ‖ q̃_j) (Eq. 5), summed (callers scale)."""
        cfg = self.cfg
        device = self.lm.device
        lengths = [s.ids.numel() for s in samples]
        batch = torch.zeros(len(samples), max(lengths), dtype=torch.long, device=device)  # [b, L] right-padded
        for i, s in enumerate(samples):
            batch[i, : lengths[i]] = s.ids.to(device)
        # Right padding needs no attention mask: causal attention never lets a real position see a later pad.
        hidden = self.lm.body(input_ids=batch, use_cache=False).last_hidden_state  # [b, L, d]
        weight, bias = self.lm.weight, self.lm.bias  # [V, d], frozen
        total = hidden.new_zeros((), dtype=torch.float32)
        for i, s in enumerate(samples):
            m = s.z.shape[0]
            h = hidden[i, lengths[i] - m : lengths[i]]  # [m, d] predicts x_1..x_m
            q = torch.einsum("md,mkd->mk", h, weight[s.z_ids.to(device)])  # [m, K]
            if bias is not None:
                q = q + bias[s.z_ids.to(device)]
            q = self.lm.finish(q.float())
            with torch.no_grad():
                first = self.lm.logits(h[:1])  # [1, V] full head for the first-step CE
                l_base = float(F.cross_entropy(first, torch.tensor([s.first], device=device)))
            w = torch.exp(-cfg.beta * l_base * torch.arange(m, dtype=torch.float32, device=device))  # [m]
            log_p = F.log_softmax(s.z.to(device) / cfg.t_kd, dim=-1)  # [m, K]
            log_q = F.log_softmax(q / cfg.t_kd, dim=-1)
            kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [m]
            total = total + (w * cfg.t_kd**2 * kl).sum()
        return total

    def update(self) -> float:
        """One optimiser step on the buffer (micro-batched, mean over samples); clears the buffer."""
        if self._closed or not self.buffer:
            return math.nan
        start = time.perf_counter()
        samples, self.buffer = self.buffer, []
        value = 0.0
        with torch.inference_mode(False), torch.enable_grad():
            self.optimizer.zero_grad(set_to_none=True)
            for i in range(0, len(samples), self.cfg.micro_batch):
                loss = self.loss(samples[i : i + self.cfg.micro_batch]) / len(samples)
                loss.backward()
                value += float(loss.detach())
            self.grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.stats.updates += 1
        self.stats.update_s += time.perf_counter() - start
        self.stats.last_loss = value
        self.stats.losses.append(value)
        return value


class _Restorer:
    """Puts a model back as it was before an adapter: original modules, requires_grad flags, attributes."""

    def __init__(self, model, flags: dict[str, bool], originals: dict[str, torch.nn.Module], new_attrs: set[str]):
        self.model = model
        self.flags = flags
        self.originals = originals
        self.new_attrs = new_attrs

    def __call__(self) -> None:
        model = self.model
        for name, module in self.originals.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module)
        for attr in self.new_attrs:
            if attr in vars(model):
                delattr(model, attr)
        for name, p in model.named_parameters():
            p.grad = None
            p.requires_grad_(self.flags.get(name, p.requires_grad))
        _ADAPTED.discard(model)


def _is_target(name: str, modules: tuple[str, ...]) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in modules
