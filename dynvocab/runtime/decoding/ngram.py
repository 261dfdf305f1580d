"""Drafting by n-gram lookup in the request's own tokens: prompt lookup decoding (Saxena, 2023), vLLM's ``ngram``
method and transformers' ``prompt_lookup_num_tokens``, inside dynvocab's one loop.

Before a cycle drafts, :meth:`NgramLookup.continuation` looks for the longest suffix of the committed tokens (at
least ``shortest``, at most ``longest`` tokens) that occurred earlier in the request (the prompt and what followed),
the most recent occurrence first, and proposes the tokens that followed it there. Where one is found the cycle's
draft is that continuation: neither the draft's body nor its head runs (a strategy row with ``+ngram``, or
``ar+ngram`` with no draft at all). Where none is found the cycle drafts as it would have.

Lossless either way: the target verifies the continuation as it verifies any draft. The continuation is a
deterministic proposal, ``q`` one-hot on its token, so exact rejection sampling accepts it with probability
``p(x)`` and a rejection draws from ``p`` without ``x``, renormalized: the output distribution is the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NGRAM_MAX = 4  # the longest suffix looked up
DEFAULT_NGRAM_MIN = 2  # the shortest suffix that counts as a match
NGRAM_SUFFIX = "+ngram"  # a row or strategy name ending in it also drafts by lookup (``microspec+ngram``)


def split_ngram(name: str) -> tuple[str, bool]:
    """``name`` without the ``+ngram`` suffix, and whether it had it."""
    if name.endswith(NGRAM_SUFFIX) and len(name) > len(NGRAM_SUFFIX):
        return name[: -len(NGRAM_SUFFIX)], True
    return name, False


@dataclass(frozen=True)
class NgramLookup:
    """The lookup's n-gram sizes: suffixes of ``shortest`` to ``longest`` tokens are matched, longest first."""

    longest: int = DEFAULT_NGRAM_MAX
    shortest: int = DEFAULT_NGRAM_MIN

    def __post_init__(self):
        if not 1 <= self.shortest <= self.longest:
            raise ValueError(f"n-gram sizes need 1 ≤ shortest ≤ longest (got {self.shortest}, {self.longest})")

    def continuation(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the most recent earlier occurrence of the longest matching suffix
        of ``tokens``; [] when no suffix of at least ``shortest`` tokens occurred before.

        One backward pass over ``tokens``: each earlier occurrence of the last token is extended backwards while it
        matches, up to ``longest``. A continuation that reaches the end of ``tokens`` goes on with its own first
        tokens (a repeating pattern repeats)."""
        n_tokens = len(tokens)
        if limit <= 0 or n_tokens < self.shortest + 1:
            return []
        last = tokens[-1]
        best_len, best_end = 0, -1
        for end in range(n_tokens - 2, -1, -1):
            if tokens[end] != last:
                continue
            n = 1
            while n < self.longest and end - n >= 0 and tokens[end - n] == tokens[n_tokens - 1 - n]:
                n += 1
            if n > best_len:
                best_len, best_end = n, end
                if n == self.longest:
                    break
        if best_len < self.shortest:
            return []
        out: list[int] = []
        at = best_end + 1
        while len(out) < limit:
            out.append(tokens[at] if at < n_tokens else out[at - n_tokens])
            at += 1
        return out
