"""A cycle's draft as one verification pass: :class:`DraftTree`, the one tree type. A chain is a tree of one path
(:meth:`DraftTree.chain`), with the draft's runner-up as a leaf where it was unsure; an EAGLE-2 tree of any shape is
grown by :mod:`dynvocab.runtime.trees.growth`.

Row 0 is the root (the last committed token); every drafted row comes after its parent. The target scores all rows
in one pass; tree attention (a 4-D mask) lets each row see only the prefix, the root and its own ancestors, at the
position ``start + depth``; a pass that is one path needs no mask (a causal pass). A runner-up leaf at chain depth
j is a sibling of the chain's token there: same parent, same position (SpecInfer, Miao et al. 2024).

Verification (:mod:`dynvocab.runtime.trees.verify`) walks from the root child by child, so the output is exactly the
target's, one token longer whenever a runner-up or a side branch was right.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree, its shape on the host and its drafted tokens where the draft left them (the device).

    ``parents[i]`` is the row of row i's parent (``parents[0]`` is -1, the root); ``tokens`` [n - 1] are the drafted
    rows' ids, row 1 first. Siblings keep the order they were drafted in (greedy: the draft's ranking; sampling: the
    order they were drawn without replacement, which exact multi-draft sampling relies on). ``main`` holds the rows
    of the draft's best path (its chosen token at each depth), the rows a chain draft's own cache holds."""

    parents: tuple[int, ...]
    tokens: torch.Tensor
    main: tuple[int, ...] = ()

    def __post_init__(self):
        for row, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < row:
                raise ValueError(f"row {row}'s parent {parent} does not come before it")
        if self.tokens.numel() != self.size - 1:
            raise ValueError(f"{self.tokens.numel()} drafted tokens for {self.size - 1} drafted rows")

    @classmethod
    def chain(cls, chain: list[torch.Tensor], leaves: dict[int, torch.Tensor] | None = None,
              device=None) -> "DraftTree":
        """A chain ``d_1..d_γ`` (γ × [1] on the device) with runner-up ``leaves`` by chain depth j (0-based: a
        sibling of ``chain[j]``): rows 1..γ the chain, then the leaves in depth order. The tokens are concatenated
        on ``device`` (default: the first token's), not read."""
        leaves = leaves or {}
        depths = sorted(leaves)
        parents = (-1, *range(len(chain)), *depths)
        drafted = [*chain, *(leaves[j] for j in depths)]
        device = device if device is not None else (drafted[0].device if drafted else "cpu")
        tokens = torch.cat([t.to(device) for t in drafted]) if drafted else torch.zeros(0, dtype=torch.long,
                                                                                          device=device)
        return cls(parents, tokens, tuple(range(1, len(chain) + 1)))

    @classmethod
    def of(cls, parents, tokens: list[int], main=(), device="cpu") -> "DraftTree":
        """A tree from host values: ``tokens`` the drafted rows' ids (tests, a grown tree's chosen nodes)."""
        return cls(tuple(parents), torch.tensor(list(tokens), dtype=torch.long, device=device), tuple(main))

    @classmethod
    def of_chain(cls, chain: list[int], leaves: dict[int, int] | None = None, device="cpu") -> "DraftTree":
        """:meth:`chain` from host ids (tests, scripted drafts)."""
        token = functools.partial(torch.tensor, dtype=torch.long, device=device)
        return cls.chain([token([t]) for t in chain], {j: token([t]) for j, t in (leaves or {}).items()}, device)

    @property
    def size(self) -> int:
        """Rows of the pass, the root included."""
        return len(self.parents)

    @functools.cached_property
    def is_path(self) -> bool:
        """Whether the tree is one path in row order (a chain without leaves): its pass needs no tree mask."""
        return all(parent == row - 1 for row, parent in enumerate(self.parents[1:], start=1))

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
        """The token ids [n] of the pass, concatenated on ``root``'s device: ``root`` [1] (the last committed token),
        then the drafted rows."""
        return torch.cat([root, self.tokens.to(root.device)])

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
        positions = self.positions(past, device)[0]
        return tree_attention_mask(self.allowed(device), positions, past, dtype, window, kv_offset)

    def on_main(self, path_rows) -> int:
        """How many of ``path_rows`` (an accepted path, from the root's child down) lie on :attr:`main`."""
        n = 0
        while n < len(path_rows) and n < len(self.main) and path_rows[n] == self.main[n]:
            n += 1
        return n


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
