"""The budgets both builders and runtime use, one definition each: FR-Spec's K (the frequency set's default size:
the ``fr`` strategy, its batched selector, the token-map exports, an EAGLE-3 head's draft vocabulary) and DynaSpec's
position-aware budget (the runtime's policies and the router builder's report).

Builders and runtime never import each other; both import this.
"""

from __future__ import annotations

FR_SIZE = 32768  # FR-Spec's K: the most frequent ids a static draft vocabulary keeps by default


def pa_budget(k_max: int, step: int, divisor: int = 1) -> int:
    """DynaSpec's position-aware budget: k_max for steps 0 and 1, then ⌊k_max / (divisor·(t+1))⌋.

    ``divisor=1`` is the frequency-ranked schedule (DynaSpec appendix A.1); ``divisor=2`` the cluster one.
    """
    if step < 2:
        return k_max
    return max(1, k_max // (divisor * (step + 1)))
