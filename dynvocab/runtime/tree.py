"""A small draft tree: the drafted chain plus the draft's runner-up as a leaf where it was unsure.

The draft proposes a chain ``d_1..d_γ``. At a step where its chosen token had probability below a threshold, its
runner-up ``s_j`` joins as a leaf: a sibling of ``d_j`` with the same parent ``d_1..d_{j-1}``. The target scores
the root (the last committed token), the chain and the leaves in one pass; tree attention (a 4-D mask) lets each
leaf see only the prefix, the root and its own ancestors, at the position of the chain token it replaces.

Greedy verification (:func:`dynvocab.runtime.verify.verify_tree_greedy`) walks the chain as usual; where it stops at depth j and the target's token there is the
leaf ``s_j``, the leaf is accepted and the target's token after it (from the leaf's own row) is emitted too. So
the output is still exactly the target's greedy output, one token longer whenever a runner-up was right
(SpecInfer, Miao et al. 2024; EAGLE-2 and MicroSpec verify wider trees in the same way).
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

    def attention_mask(
        self, past: int, dtype: torch.dtype, device, window: int | None = None, kv_offset: int = 0
    ) -> torch.Tensor:
        """Additive mask [1, 1, n, past - kv_offset + n]: every row sees the cached positions ``kv_offset..past-1``;
        the root and the chain are causal; the leaf at depth j sees the root, its ancestors ``d_1..d_j`` (0-based:
        ``chain[:j]``) and itself. With ``window`` (a sliding-window layer, whose cache keeps only the positions from
        ``kv_offset`` on), a row at position p sees only keys at positions > p - window, as transformers'
        sliding-window mask does."""
        n_chain = len(self.chain) + 1
        n = n_chain + len(self.depths)
        allowed = torch.zeros(n, n, dtype=torch.bool, device=device)
        allowed[:n_chain, :n_chain] = torch.ones(n_chain, n_chain, dtype=torch.bool, device=device).tril()
        for i, j in enumerate(self.depths):
            row = n_chain + i
            allowed[row, : j + 1] = True  # the root and the chain tokens before depth j
            allowed[row, row] = True
        seen = torch.ones(n, past - kv_offset, dtype=torch.bool, device=device)  # [n, cached]
        if window is not None:
            pos = self.positions(past, device)[0]  # [n]
            keys = torch.arange(kv_offset, past, device=device)  # [cached]
            seen = pos[:, None] - keys[None, :] < window
            allowed &= pos[:, None] - pos[None, :] < window
        visible = torch.cat([seen, allowed], dim=1)  # [n, cached + n]
        mask = torch.zeros(1, 1, n, visible.shape[1], dtype=dtype, device=device)
        mask[0, 0].masked_fill_(~visible, torch.finfo(dtype).min)
        return mask
