"""Peak memory of one EvoSpec alignment update: LoRA vs full-parameter updates (for memory reports)."""

from __future__ import annotations

import gc
from dataclasses import replace

import torch

from dynvocab.runtime.policies.evospec_align import AlignConfig, Aligner


def _status_bytes(field: str) -> int:
    """A byte count from ``/proc/self/status`` (``VmRSS``: resident now, ``VmHWM``: its peak); 0 where absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


def update_peak_memory(
    lm,
    trainable: str = "lora",
    cfg: AlignConfig = AlignConfig(),
    samples: int | None = None,
    seq_len: int | None = None,
    path_len: int = 4,
    seed: int = 0,
) -> dict:
    """Peak memory of one alignment update (adapter/optimizer set-up, a full buffer, forward, backward, step).

    Runs :class:`Aligner` in mode ``trainable`` on synthetic samples (random ids, random target logits) of
    ``seq_len`` tokens (default ``cfg.context_tokens + path_len - 1``). On CUDA it reads
    ``torch.cuda.max_memory_allocated``; on CPU the process's peak RSS (VmHWM, reset through
    ``/proc/self/clear_refs``), so run each mode in a fresh process for clean figures. The full modes write
    ``lm``'s weights: pass a throwaway model. Returns bytes: ``baseline`` (before set-up), ``peak``,
    ``delta`` (= peak − baseline), ``grads`` and ``optimizer_state`` (exact; ``state`` is their sum), and the
    number of ``trainable_params``.
    """
    samples = samples or cfg.buffer_size
    seq_len = seq_len or cfg.context_tokens + path_len - 1
    cuda = lm.device.type == "cuda"
    gen = torch.Generator().manual_seed(seed)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        _reset_rss_peak()
        baseline = _status_bytes("VmRSS")
    aligner = Aligner(lm, cfg, trainable)
    try:
        big = replace(cfg, buffer_size=samples + 1)  # fill the buffer without triggering the update
        aligner.cfg = big
        logits = torch.randn(path_len, lm.vocab_size, generator=gen) * 4  # [m, V]
        for _ in range(samples):
            context = torch.randint(0, lm.vocab_size, (seq_len - path_len + 1,), generator=gen).tolist()
            path = torch.randint(0, lm.vocab_size, (path_len,), generator=gen).tolist()
            aligner.add(context, path, logits)
        aligner.cfg = cfg
        trainable_params = sum(p.numel() for p in aligner.params)
        aligner.update()
        optimizer_state = sum(
            t.numel() * t.element_size() for st in aligner.optimizer.state.values() for t in st.values() if torch.is_tensor(t)
        )
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _status_bytes("VmHWM")
    finally:
        aligner.close()
    return {
        "trainable": trainable,
        "trainable_params": trainable_params,
        "samples": samples,
        "seq_len": seq_len,
        "baseline": baseline,
        "peak": peak,
        "delta": peak - baseline,
        "grads": aligner.grad_bytes,
        "optimizer_state": optimizer_state,
        "state": aligner.grad_bytes + optimizer_state,
        "device": "cuda" if cuda else "cpu",
    }
