"""Per-generation metrics as data (the CLI renders them; :mod:`dynvocab.bench.loop.summary` aggregates them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from dynvocab.runtime.host import to_host


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
    # Per chain position j: the share of cycles drafting j whose chain token j was accepted (an EAGLE-2 tree: per
    # depth, its accepted path). An accepted runner-up leaf is not a chain token; it counts in ``leaf_hits`` only.
    accept_by_position: list[float] = field(default_factory=list)
    draft_steps: int = 0
    head_rows_copied: int = 0
    leaves: int = 0  # runner-up leaves verified beside the drafted chains (see dynvocab.runtime.trees.tree)
    leaf_hits: int = 0  # cycles that accepted a leaf (one more token than the chain gave)
    # Cycles whose draft was an n-gram lookup's continuation (``ngram``, see dynvocab.runtime.decoding.ngram), the
    # tokens they drafted and how many of those the target accepted; their tokens count in ``accept_by_position`` too.
    lookup_cycles: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    # EAGLE-2 tree cycles (see dynvocab.runtime.trees.growth): how many, the drafted tokens their passes verified, the
    # candidates grown, the head calls (one per depth), and the accepted tokens that lay off the draft's main path
    # (the best child at each depth): what the tree's width bought.
    tree_cycles: int = 0
    tree_tokens: int = 0
    tree_candidates: int = 0
    head_calls: int = 0
    off_main: int = 0
    tree: str | None = None  # the tree shape drafted (DEPTHxTOPKxTOKENS, or auto), None: chains
    tree_auto: dict | None = None  # ``--tree auto``: its choice and why (shape, median N and depth, the curve)

    def as_dict(self) -> dict:
        """A JSON-ready dict (floats rounded for readability)."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 5)
        out["accept_by_position"] = [round(v, 4) for v in self.accept_by_position]
        out["coverage"] = out["active_hit_rate"]  # the old name, kept for readers of earlier JSON
        return out


class Tally:
    """The loop's counters for one generation, turned into :class:`Metrics` by :meth:`finish`.

    Fed once per cycle with host values the verification already read; the one device-side count (whether a
    recovered token lay in its step's active set) stays on the device until :meth:`finish` reads it, so counting
    never waits on a device inside the loop.
    """

    def __init__(self, gamma: int):
        self.m = Metrics()
        self.drafted_at = [0] * gamma
        self.accepted_at = [0] * gamma
        self.active_total = 0
        self.covered = self.counted = 0
        self._hits: list[torch.Tensor] = []  # device booleans: a recovered token inside its step's active set

    def cycle(self, drafted: int, accepted_chain: int, accepted: int, emitted: list[int], sets: list, leaves: int,
              leaf_hit: bool, looked_up: bool = False) -> None:
        """One verified cycle: ``drafted`` chain tokens (one draft step each, over the active ``sets``) of which
        ``accepted_chain`` were accepted, ``accepted`` draft tokens kept in all (an accepted leaf included),
        ``emitted`` tokens, ``leaves`` runner-up leaves verified.

        Hit rate: accepted tokens were drafted from the active set; the recovered token at position k < γ is a hit
        when it was inside the active set of draft step k. A bonus after full acceptance had no step. A
        ``looked_up`` chain (an n-gram continuation: no draft step, no active set) counts in the lookup counters
        and acceptance by position, not in the hit rate.
        """
        if drafted > len(self.drafted_at):  # a tree deeper than γ
            grow = drafted - len(self.drafted_at)
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for j in range(drafted):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < accepted_chain  # an accepted leaf counts in leaf_hits, not here
        self.m.cycles += 1
        self.m.new_tokens += len(emitted)
        self.m.leaves += leaves
        self.m.leaf_hits += leaf_hit
        if looked_up:
            self.m.lookup_cycles += 1
            self.m.lookup_drafted += drafted
            self.m.lookup_accepted += accepted_chain
            return
        self.m.draft_steps += len(sets)
        self.active_total += sum(s.size for s in sets)
        in_steps = min(accepted + 1, drafted, len(emitted))
        self.counted += in_steps
        self.covered += min(accepted, in_steps)
        if accepted < in_steps:
            self._count_hit(sets[accepted], emitted[accepted])

    def tree(self, grown, verdict) -> None:
        """One tree cycle: the tree verified (a :class:`~dynvocab.runtime.trees.growth.GrownTree`) and its
        :class:`~dynvocab.runtime.trees.verify.Verdict`."""
        m = self.m
        m.tree_cycles += 1
        m.tree_tokens += grown.tree.size - 1
        m.tree_candidates += grown.candidates
        m.head_calls += grown.head_calls
        m.off_main += verdict.accepted - verdict.on_main

    def _count_hit(self, active, token: int) -> None:
        """Count ``token`` as a hit when it is in ``active`` (an
        :class:`~dynvocab.runtime.heads.active_set.ActiveSet`): decided on the host for the full vocabulary, else kept
        as a device boolean."""
        if active.is_full:
            self.covered += 0 <= token < active.vocab
            return
        ids = active.id_segments()
        if ids:
            self._hits.append((torch.cat(ids) == token).any())

    def finish(self, wall_s: float, speculative: bool, rows_copied: int = 0) -> Metrics:
        """The generation's metrics after ``wall_s`` seconds."""
        m = self.m
        m.wall_s = wall_s
        m.mean_accepted_length = m.new_tokens / m.cycles if m.cycles else 0.0
        m.tokens_per_s = m.new_tokens / wall_s if wall_s > 0 else 0.0
        m.accept_by_position = [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]
        if self._hits:
            self.covered += to_host(torch.stack(self._hits).sum())
            self._hits.clear()
        if speculative:
            m.mean_active_vocab = self.active_total / m.draft_steps if m.draft_steps else None
            m.active_hit_rate = self.covered / self.counted if self.counted else None
            m.head_rows_copied = rows_copied
        return m
