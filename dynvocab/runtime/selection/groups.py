"""Ids grouped into contiguous runs of one fixed order, and a pick of groups as row ranges of it.

DynaSpec's clusters and the centroid blocks are both a partition of the vocabulary into groups; the head packs
``W[order]`` once (ids grouped by group), so a set of picked groups is a few contiguous row ranges of that copy.
"""

from __future__ import annotations

import torch

from dynvocab.runtime.heads.active_set import ActiveSet, NodeSets, RowRanges
from dynvocab.runtime.host import to_host


class Groups:
    """``group_of`` [V] (the group of each draftable id) as one id order with per-group bounds, and the EOS ids
    with their groups (so a pick can add the EOS ids it leaves out)."""

    def __init__(self, group_of: torch.Tensor, num_groups: int, eos: torch.Tensor, device: torch.device):
        group_of = group_of.long().cpu()
        vocab = group_of.numel()
        self.device = device
        order = torch.argsort(group_of, stable=True)  # [V] ids grouped by group, ascending within a group
        sizes = torch.bincount(group_of, minlength=num_groups)  # [G]
        self.order = order.to(device)  # the head packs W[order] once; a group is a slice of it
        self.group_of = group_of.to(device)  # [V]
        ends = sizes.cumsum(0)  # [G] group g is order[ends[g] - sizes[g] : ends[g]]
        self.bounds = torch.stack([ends - sizes, ends]).to(device)  # [2, G] (start, end) per group
        eos = eos.long().cpu()
        eos = eos[eos < vocab]
        self.eos = eos.to(device)  # [E]
        self.eos_group = group_of[eos].to(device)  # [E]
        self.num_groups = num_groups

    def select(self, picked_groups: torch.Tensor) -> tuple[RowRanges, torch.Tensor]:
        """The union of groups ``picked_groups`` [k] as row ranges of the order (keyed by it: its rows are gathered
        once), and the EOS ids outside them, LongTensor [e], a changed set: two disjoint segments."""
        picked = torch.zeros(self.num_groups, dtype=torch.bool, device=self.device)
        picked[picked_groups] = True
        starts, ends = self._ranges(picked)
        return RowRanges(self.order, starts, ends), self.eos[~picked[self.eos_group]]

    def node_sets(self, picked: torch.Tensor) -> NodeSets:
        """Each row's groups ``picked`` [B, c] (and the EOS ids) for one head call over their union: the union as
        row ranges of the order and the EOS ids outside it, and which of its columns each row has."""
        ranges, eos = self.select(picked.flatten())
        member = torch.zeros(picked.shape[0], self.num_groups, dtype=torch.bool, device=self.device)
        member.scatter_(1, picked, True)  # [B, G]
        ids = ranges.ids
        inside = member[:, self.group_of[ids]] | torch.isin(ids, self.eos)  # [B, n] its groups' ids, and every EOS id
        own = torch.cat([inside, member.new_ones(picked.shape[0], eos.numel())], dim=1)
        return NodeSets(ActiveSet.of(ranges, eos), own)

    def _ranges(self, picked: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The picked groups (bitmap [G]) as merged row ranges, as ``merge_ranges`` gives them, computed on the
        device from the group bounds: one read of the final ranges instead of a Python pass over k groups."""
        bounds = self.bounds[:, picked & (self.bounds[1] > self.bounds[0])]  # [2, k'] non-empty, in group order
        if bounds.shape[1] == 0:
            return (), ()
        breaks = bounds[0, 1:] != bounds[1, :-1]  # [k'-1] a gap before the next picked group
        first = torch.cat([breaks.new_ones(1), breaks])  # [k'] starts a merged range
        last = torch.cat([breaks, breaks.new_ones(1)])  # [k'] ends one
        flat = to_host(torch.cat([bounds[0, first], bounds[1, last]]))  # the one host read: [starts…, ends…]
        half = len(flat) // 2
        return tuple(flat[:half]), tuple(flat[half:])
