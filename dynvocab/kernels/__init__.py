"""Triton kernels for the draft head, each beside its torch reference.

Importing this package never imports Triton: the ``*_triton.py`` kernel modules load on the first launch (so
``TRITON_INTERPRET`` may be set any time before it), and the ``*_auto`` functions use the torch references on
CPU. Their timings live in :mod:`dynvocab.bench.micro.microbench`. Public entry points, and who calls them:

- ``gathered_logits(h, weight, idx)``: float32 logits [M, n] over rows ``idx`` of an LM head, fused, reading the
  rows in place. On the decode path on CUDA: :class:`~dynvocab.runtime.heads.head.RangeHead` (the head over a
  policy's row ranges, e.g. DynaSpec's clusters) computes all of a step's ranges in one launch of it. The bench
  times it too (``gathered_logits_auto``: the kernel on CUDA, the reference elsewhere).
"""

from dynvocab.kernels._triton import interpreting, triton_available
from dynvocab.kernels.gathered_head import gathered_logits, gathered_logits_auto, gathered_logits_reference

__all__ = [
    "gathered_logits",
    "gathered_logits_auto",
    "gathered_logits_reference",
    "interpreting",
    "triton_available",
]
