"""Draft trees verified in one target pass: :class:`DraftTree`, a chain with the draft's runner-up as a leaf where
it was unsure, and :class:`TokenTree`, an EAGLE-2 tree of any shape (grown by :mod:`dynvocab.runtime.tree_draft`).

The draft proposes a chain ``d_1..d_γ``. At a step where its chosen token had probability below a threshold, its
runner-up ``s_j`` joins as a leaf: a sibling of ``d_j`` with the same parent ``d_1..d_{j-1}``. The target scores
the root (the last committed token), the chain and the leaves in one pass; tree attention (a 4-D mask) lets each
leaf see only the prefix, the root and its own ancestors, at the position of the chain token it replaces.

Greedy verification (:func:`dynvocab.runtime.verify.verify_tree_greedy`) walks the chain as usual; where it stops at
depth j and the target's token there is the leaf ``s_j``, the leaf is accepted and the target's token after it (from
the leaf's own row) is emitted too. So the output is still exactly the target's greedy output, one token longer
whenever a runner-up was right (SpecInfer, Miao et al. 2024; EAGLE-2 and MicroSpec verify wider trees in the same
way). A :class:`TokenTree` is walked the same way from the root, child by child
(:func:`dynvocab.runtime.verify.verify_token_tree`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """The chain and its leaves, on the device: ``chain`` holds the drafted tokens (γ × [1]), ``leaves`` maps a
    chain depth j (0-based) to the runner-up token there ([1]). Only the tree's shape (the chain's length, the
    leaves' depths) is known on the host; the tokens come back with the verdict."""

    chain: list[torch.Tensor]
    leaves: dict[int, torch.Tensor]

    @classmethod
    def of(cls, chain: list[int], leaves: dict[int, int], device="cpu") -> "DraftTree":
        """A tree from host token ids (tests, scripted drafts)."""
        token = functools.partial(torch.tensor, dtype=torch.long, device=device)
        return cls([token([t]) for t in chain], {j: token([t]) for j, t in leaves.items()})

    @functools.cached_property
    def depths(self) -> list[int]:
        """The leaves' depths in the order the pass feeds them."""
        return sorted(self.leaves)

    def drafted(self) -> list[torch.Tensor]:
        """The drafted tokens in pass order, chain then leaves (each [1])."""
        return [*self.chain, *(self.leaves[j] for j in self.depths)]

    def inputs(self, root: torch.Tensor) -> torch.Tensor:
        """The token ids [1 + chain + leaves] of one verification pass, concatenated on the device: ``root`` [1]
        (the last committed token), the chain, then the leaves in depth order."""
        drafted = self.drafted()
        return torch.cat([root, *(t.to(root.device) for t in drafted)]) if drafted else root

    def leaf_row(self, depth: int) -> int:
        """Index in :meth:`inputs` (and in the pass's logits) of the leaf at ``depth``."""
        return 1 + len(self.chain) + self.depths.index(depth)

    def positions(self, start: int, device) -> torch.Tensor:
        """Position ids [1, n] of the pass: the root at ``start``; a leaf shares its chain sibling's position."""
        pos = [start + i for i in range(len(self.chain) + 1)]
        pos += [start + 1 + j for j in self.depths]
        return torch.tensor([pos], dtype=torch.long, device=device)

    @property
    def size(self) -> int:
        """Rows of the pass: the root, the chain and the leaves."""
        return 1 + len(self.chain) + len(self.leaves)

    def allowed(self, device) -> torch.Tensor:
        """[n, n] bool: which rows of the pass each row sees (its ancestors and itself)."""
        n_chain = len(self.chain) + 1
        allowed = torch.zeros(self.size, self.size, dtype=torch.bool, device=device)
        allowed[:n_chain, :n_chain] = torch.ones(n_chain, n_chain, dtype=torch.bool, device=device).tril()
        for i, j in enumerate(self.depths):
            row = n_chain + i
            allowed[row, : j + 1] = True  # the root and the chain tokens before depth j
            allowed[row, row] = True
        return allowed

    def attention_mask(
        self, past: int, dtype: torch.dtype, device, window: int | None = None, kv_offset: int = 0
    ) -> torch.Tensor:
        """Additive mask [1, 1, n, past - kv_offset + n]: every row sees the cached positions ``kv_offset..past-1``;
        the root and the chain are causal; the leaf at depth j sees the root, its ancestors ``d_1..d_j`` (0-based:
        ``chain[:j]``) and itself (see :func:`tree_attention_mask`)."""
        return tree_attention_mask(self.allowed(device), self.positions(past, device)[0], past, dtype, window, kv_offset)


def tree_attention_mask(allowed: torch.Tensor, positions: torch.Tensor, past: int, dtype: torch.dtype,
                        window: int | None = None, kv_offset: int = 0) -> torch.Tensor:
    """Additive mask [1, 1, n, past - kv_offset + n] of a tree pass whose rows see the rows ``allowed`` [n, n] names
    and every cached position ``kv_offset..past-1``. With ``window`` (a sliding-window layer, whose cache keeps only
    the positions from ``kv_offset`` on), a row at position p sees only keys at positions > p - window, as
    transformers' sliding-window mask does; ``positions`` [n] are the rows' positions."""
    device = allowed.device
    n = allowed.shape[0]
    seen = torch.ones(n, past - kv_offset, dtype=torch.bool, device=device)  # [n, cached]
    if window is not None:
        keys = torch.arange(kv_offset, past, device=device)  # [cached]
        seen = positions[:, None] - keys[None, :] < window
        allowed = allowed & (positions[:, None] - positions[None, :] < window)
    visible = torch.cat([seen, allowed], dim=1)  # [n, cached + n]
    mask = torch.zeros(1, 1, n, visible.shape[1], dtype=dtype, device=device)
    mask[0, 0].masked_fill_(~visible, torch.finfo(dtype).min)
    return mask


@dataclass(frozen=True, eq=False)
class TokenTree:
    """An EAGLE-2 draft tree as one verification pass, shape on the host (:mod:`dynvocab.runtime.tree_draft` grows
    it). Row 0 is the root (the last committed token); rows 1.. are the drafted nodes ordered by depth, each after
    its parent; ``parents[i]`` is the row of row i's parent (``parents[0]`` is -1), ``tokens[i]`` its token (the
    root's is not known here: -1). Siblings keep the order they were drafted in (greedy: the draft's ranking;
    sampling: the order they were drawn without replacement), which exact multi-draft sampling relies on.
    ``main`` holds the rows of the draft's best path (the highest-scored child at each depth)."""

    parents: tuple[int, ...]
    tokens: tuple[int, ...]
    main: tuple[int, ...] = ()

    def __post_init__(self):
        for row, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < row:
                raise ValueError(f"row {row}'s parent {parent} does not come before it")

    @property
    def size(self) -> int:
        """Rows of the pass, the root included."""
        return len(self.parents)

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """Each row's depth (the root: 0)."""
        depth = [0] * self.size
        for row in range(1, self.size):
            depth[row] = depth[self.parents[row]] + 1
        return tuple(depth)

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Each row's children rows, in drafting order."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for row in range(1, self.size):
            kids[self.parents[row]].append(row)
        return tuple(tuple(k) for k in kids)

    def inputs(self, root: torch.Tensor) -> torch.Tensor:
        """The token ids [n] of the pass: ``root`` [1] then the drafted nodes (one upload of their ids)."""
        return torch.cat([root, torch.tensor(self.tokens[1:], dtype=torch.long, device=root.device)])

    def positions(self, start: int, device) -> torch.Tensor:
        """Position ids [1, n]: a row at depth d sits at ``start + d``."""
        return torch.tensor([[start + d for d in self.depths]], dtype=torch.long, device=device)

    def allowed(self, device) -> torch.Tensor:
        """[n, n] bool: each row sees its ancestors and itself."""
        allowed = torch.eye(self.size, dtype=torch.bool)
        for row in range(1, self.size):
            allowed[row] |= allowed[self.parents[row]]
        return allowed.to(device)

    def attention_mask(
        self, past: int, dtype: torch.dtype, device, window: int | None = None, kv_offset: int = 0
    ) -> torch.Tensor:
        """Additive mask [1, 1, n, past - kv_offset + n] (see :func:`tree_attention_mask`)."""
        return tree_attention_mask(self.allowed(device), self.positions(past, device)[0], past, dtype, window, kv_offset)

    def path_to(self, row: int) -> list[int]:
        """The rows from the root's first child down to ``row``."""
        rows = []
        while row > 0:
            rows.append(row)
            row = self.parents[row]
        return rows[::-1]
