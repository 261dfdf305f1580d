"""DynaSpec's position-aware budget, one definition for the runtime's policies and the router builder's report.

Builders and runtime never import each other; both import this.
"""

from __future__ import annotations


def pa_budget(k_max: int, step: int, divisor: int = 1) -> int:
    """DynaSpec's position-aware budget: k_max for steps 0 and 1, then ⌊k_max / (divisor·(t+1))⌋.

    ``divisor=1`` is the frequency-ranked schedule (DynaSpec appendix A.1); ``divisor=2`` the cluster one.
    """
    if step < 2:
        return k_max
    return max(1, k_max // (divisor * (step + 1)))
