"""The shape of an EAGLE-2 draft tree (``--tree DEPTHxTOPKxTOKENS``) and the ``@tree`` suffix of strategy names.

A tree of depth D, top-k K and N tokens grows as EAGLE-2 does (:mod:`dynvocab.runtime.trees.growth`): the root's K
best children, then D - 1 more depths, each expanding the K best frontier nodes by cumulative draft log-probability
into K children each; of the ``K + (D - 1) K²`` candidates the N best are verified in one target pass. ``off`` is
today's chain (with its runner-up leaves); ``auto`` picks N per cycle from the target's measured verification cost
(:mod:`dynvocab.runtime.trees.budget`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dynvocab.errors import DynvocabError

TREE_OFF = "off"
TREE_AUTO = "auto"
TREE_SUFFIX = "@tree"  # a bench row or strategy ``X@tree``: X drafted as a tree of ``--tree`` (``auto`` when off);
# ``X@auto`` and ``X@DxKxN`` name the tree themselves
MAX_TREE_TOKENS = 256  # one verification pass: more is never worth it on a CPU, and the masks grow as N²
_SHAPE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*x\s*(\d+)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class TreeShape:
    """Depth (draft steps), top-k (children per expanded node, nodes expanded per depth) and the tokens verified."""

    depth: int
    topk: int
    tokens: int

    def __post_init__(self):
        if self.depth < 1 or self.topk < 1 or self.tokens < 1:
            raise DynvocabError(f"--tree {self}: depth, top-k and tokens must each be 1 or more")
        if self.tokens > self.candidates:
            raise DynvocabError(
                f"--tree {self}: a tree of depth {self.depth} and top-k {self.topk} grows {self.candidates} "
                f"candidate tokens, fewer than the {self.tokens} asked; ask for {self.candidates} or fewer"
            )
        if self.tokens > MAX_TREE_TOKENS:
            raise DynvocabError(f"--tree {self}: at most {MAX_TREE_TOKENS} tokens per verification pass")

    @property
    def candidates(self) -> int:
        """The nodes the growth makes: K at the root, K² at each later depth."""
        return self.topk + (self.depth - 1) * self.topk * self.topk

    def within(self, depth: int) -> "TreeShape":
        """This shape at most ``depth`` deep (the last cycles of a generation), its tokens cut to what it grows."""
        depth = max(1, min(self.depth, depth))
        return TreeShape(depth, self.topk, min(self.tokens, self.topk + (depth - 1) * self.topk * self.topk))

    def __str__(self) -> str:
        return f"{self.depth}x{self.topk}x{self.tokens}"


def parse_tree(text: str | TreeShape | None) -> TreeShape | str | None:
    """``off`` (or None, or empty) -> None; ``auto`` -> ``"auto"``; ``DxKxN`` -> :class:`TreeShape`. Anything else
    is refused in one line."""
    if text is None or isinstance(text, TreeShape):
        return text
    value = str(text).strip().lower()
    if value in ("", TREE_OFF):
        return None
    if value == TREE_AUTO:
        return TREE_AUTO
    found = _SHAPE.match(value)
    if found is None:
        raise DynvocabError(f"--tree {text!r}: give off, auto or DEPTHxTOPKxTOKENS (e.g. 5x8x60)")
    return TreeShape(*(int(g) for g in found.groups()))


def chains_only(label: str) -> DynvocabError:
    """The one-line refusal of ``--tree`` for a draft (``label``: what it is) that drafts chains only."""
    return DynvocabError(f"--tree needs an EAGLE head; a {label} drafts chains (drop --tree and @tree rows)")


def asks_for_trees(tree: str, names) -> bool:
    """Whether a run with ``--tree tree`` over the strategies or rows ``names`` drafts any tree."""
    return str(tree) != TREE_OFF or any(split_tree(name)[1] is not None for name in names)


def split_tree(name: str) -> tuple[str, str | None]:
    """``name`` without its tree suffix, and the suffix's tree: ``X@tree`` -> ``"tree"`` (``--tree``'s shape, or
    auto where that is off), ``X@auto`` or ``X@DxKxN`` -> that (checked), no suffix -> None."""
    base, at, tree = name.rpartition("@")
    if not at or not base:
        return name, None
    if tree != TREE_SUFFIX[1:]:
        parse_tree(tree)
    return base, tree
