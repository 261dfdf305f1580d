"""Per-generation metrics as data (the CLI renders them; :mod:`dynvocab.bench.summary` aggregates them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Metrics:
    """What one generation measured; field names are the JSON contract (README, "JSON output")."""

    new_tokens: int = 0
    cycles: int = 0
    mean_accepted_length: float = 0.0
    tokens_per_s: float = 0.0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    head_s: float = 0.0
    policy_s: float = 0.0  # in the vocabulary policy: choosing active sets (inside draft_s), observing cycles
    mean_active_vocab: float | None = None
    # Share of the emitted tokens (on the accepted path, within a draft step) that lay inside that step's active
    # set. Not bench's --coverage (target probability mass); JSON also carries it as ``coverage``, its old name.
    active_hit_rate: float | None = None
    # Per chain position j: the share of cycles drafting j whose chain token j was accepted. An accepted tree leaf
    # is not a chain token; it counts in ``leaf_hits`` only.
    accept_by_position: list[float] = field(default_factory=list)
    draft_steps: int = 0
    head_rows_copied: int = 0
    leaves: int = 0  # runner-up leaves verified beside the drafted chains (see dynvocab.runtime.tree)
    leaf_hits: int = 0  # cycles that accepted a leaf (one more token than the chain gave)

    def as_dict(self) -> dict:
        """A JSON-ready dict (floats rounded for readability)."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 5)
        out["accept_by_position"] = [round(v, 4) for v in self.accept_by_position]
        out["coverage"] = out["active_hit_rate"]  # the old name, kept for readers of earlier JSON
        return out
