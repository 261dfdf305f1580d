"""The loop's one way from the device to the host (vLLM's ``parse_output``).

Every value the speculative loop needs as a Python number — a draft step's token, runner-up and confidence, a
cycle's verdict, a generation's counters — comes back through :func:`to_host`, one small tensor at a time. Each
call is one device→host copy (on a GPU, one wait); anything else on the hot path stays a device tensor. The
host-read test (tests/test_host_reads.py) counts these calls and forbids the others.
"""

from __future__ import annotations

import torch


def to_host(t: torch.Tensor) -> list | int | float | bool:
    """``t`` as Python numbers: a list for a tensor with dimensions, a scalar for a 0-d tensor (one device wait)."""
    return t.tolist()
