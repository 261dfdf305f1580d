"""EAGLE-2 dynamic draft trees (Li et al. 2024), grown on the device with one head call per depth over that depth's
small set, and reduced to the N best nodes verified in one target pass.

Growth (:func:`grow_tree`): the draft consumes the committed tokens it has not seen; the root's K best children
form depth 1. At each later depth the K frontier nodes are fed to the draft in one batched pass (tree attention:
each sees the committed tokens, its own ancestors and itself,
:meth:`~dynvocab.runtime.drafts.eagle_draft.EagleDraft.branch`), the policy names the depth's active set, one head
call scores all K rows over it, and each row's K best children join the candidates with their cumulative
log-probability; the K best of those K² become the next frontier. Of all ``K + (D - 1) K²`` candidates the N best (by
cumulative score; ties to the earlier node, so every kept node's parent is kept) are verified
(:mod:`dynvocab.runtime.trees.verify`).

The sets of a depth, one head call whatever K is. By default (``--tree-sets depth``) the policy is asked once per
depth, with the depth's best frontier node, as the chain asks once per step, and every node is scored over that one
set. With ``--tree-sets node`` a strategy that reads each node (``dynaspec``'s router, ``lowrank``'s scorer,
``centroids``' blocks, ``hybrid``'s per-step search: :meth:`~dynvocab.runtime.selection.base.VocabPolicy.node_sets`)
gives each of the K frontier nodes the set it gives that node's head input and token alone; the head multiplies their
union once and each node's logits outside its own set are ``-inf``, so every node's log-probabilities are normalised
over its own set, as a chain's step over its one set. Other strategies (static sets, per-cycle sets such as
``microspec``'s) are asked once per depth either way.

Sampling: each row's children are drawn without replacement from the draft's ``q`` (Gumbel top-K), and the tree's
shape (which nodes are expanded and kept) is fixed by the children's ranks, not by their drawn probabilities: the
score of a rank-r child is ``log(PRIOR_FIRST · PRIOR_DECAY^r)``. A shape chosen from the drawn tokens' own
probabilities would bias which tokens get verified and break exactness; with a rank-fixed shape recursive rejection
sampling is exact. Greedy decoding is exact for any tree, so it ranks by the draft's log-probabilities as EAGLE-2
does.

The drafted tokens stay on the device during growth (no host read inside the draft loop); one read after it brings
the candidates' tokens, parents and scores to choose the N nodes of the pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from dynvocab.runtime.heads.active_set import ActiveSet
from dynvocab.runtime.host import to_host
from dynvocab.runtime.trees.shape import TreeShape
from dynvocab.runtime.trees.tree import DraftTree
from dynvocab.runtime.trees.verify import SamplingConfig, probs_from_logits

PRIOR_FIRST = 0.6  # sampling's rank-fixed shape: a rank-0 child's assumed acceptance
PRIOR_DECAY = 0.4  # each later rank's, relative to the one before


@dataclass
class Candidates:
    """The grown tree's candidates on the host: token, parent (-1: the root) and score of each, in growth order
    (depth blocks; within one, by parent row, then rank: candidate i is its parent's child of rank ``i % topk``), and
    which candidates each depth expanded."""

    topk: int
    tokens: list[int]
    parents: list[int]
    scores: list[float]
    expanded: list[list[int]]  # per depth >= 1: the candidate index of each frontier row

    def choose(self, n: int) -> list[int]:
        """The ``n`` best candidates (finite scores; ties to the earlier), kept only with their parent and their
        earlier siblings, in growth order."""
        order = sorted((i for i, s in enumerate(self.scores) if math.isfinite(s)), key=lambda i: (-self.scores[i], i))
        kept, keep = [], set()
        for i in sorted(order[:n]):
            parent = self.parents[i]
            if (parent != -1 and parent not in keep) or (i % self.topk and i - 1 not in keep):
                continue
            keep.add(i)
            kept.append(i)
        return kept


@dataclass
class Growth:
    """What a growth made besides its candidates: the active set of each depth, the drafted tokens by depth (for
    policies that ask for the draft's alternatives) and each depth's draft distributions (sampling: probabilities
    [rows, n] over ids [n]; greedy: None)."""

    sets: list[ActiveSet]
    tops: list[torch.Tensor]
    depth_probs: list[tuple[torch.Tensor | None, torch.Tensor | None]]


@dataclass
class GrownTree:
    """A grown draft tree, ready to verify: the pass's :class:`~dynvocab.runtime.trees.tree.DraftTree`, the active set
    of each depth, the candidates grown, the drafted tokens by depth and the draft's distribution at each expanded row
    (sampling)."""

    tree: DraftTree
    sets: list[ActiveSet]
    candidates: int
    tops: list[torch.Tensor] = field(default_factory=list)
    by_row: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)

    @property
    def head_calls(self) -> int:
        """One head call per depth grown."""
        return len(self.sets)

    def proposals(self, row: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's probabilities [n] over ids [n] (None: all ids) at pass row ``row`` (an expanded node)."""
        return self.by_row[row]


def _expand(logits: torch.Tensor, cols: torch.Tensor | None, k: int, sampling: SamplingConfig,
            generator: torch.Generator, log_prior: torch.Tensor):
    """Each row's ``k`` children: (tokens [r, k], score increments [r, k], probabilities [r, n] or None). Greedy: the
    k most likely, scored by their log-probability; sampling: k drawn without replacement (Gumbel top-k), scored by
    the rank prior. Children past the set's size, or of zero probability, score -inf."""
    rows, n = logits.shape
    if sampling.greedy:  # the k best and their log-probabilities, without a log-softmax over the whole set
        top = logits.topk(min(k, n), dim=-1)  # [r, k'] (the head's logits are float32)
        values = top.values - logits.logsumexp(dim=-1, keepdim=True)
        idx = top.indices
        if n < k:  # a set smaller than k: pad with impossible children
            values = torch.cat([values, values.new_full((rows, k - n), -math.inf)], dim=1)
            idx = torch.cat([idx, idx.new_zeros(rows, k - n)], dim=1)
        tokens = idx if cols is None else cols[idx]
        return tokens, values.double(), None
    probs = probs_from_logits(logits, sampling)  # [r, n]
    logq = probs.log()
    u = torch.rand(logq.shape, generator=generator, device=logq.device).clamp_(min=1e-20)
    keys = logq - (-u.log()).log()  # + Gumbel noise: top-k is a draw without replacement
    if n < k:  # a set smaller than k: pad with impossible children
        pad = logq.new_full((rows, k - n), -math.inf)
        logq, keys = torch.cat([logq, pad], dim=1), torch.cat([keys, pad], dim=1)
    idx = keys.topk(k, dim=-1).indices  # [r, k], in drawn order
    values = logq.gather(1, idx)
    safe = idx.clamp(max=n - 1)
    tokens = safe if cols is None else cols[safe]
    increments = torch.where(values.isfinite(), log_prior[:k].expand(rows, k), values)
    return tokens, increments.double(), probs


def _log_prior(k: int) -> list[float]:
    """Sampling's score increment of a child of each rank 0 … ``k`` - 1: ``log(PRIOR_FIRST · PRIOR_DECAY^rank)``."""
    return [math.log(PRIOR_FIRST) + r * math.log(PRIOR_DECAY) for r in range(k)]


def rank_scores(shape: TreeShape) -> list[list[float]]:
    """The cumulative scores a sampled growth of ``shape`` gives its candidates, per depth (each depth's in no
    particular order): fixed by rank, so known before any draw (a child drawn with probability 0, past a set
    smaller than K, scores -inf in the growth instead)."""
    prior = _log_prior(shape.topk)
    by_depth, frontier = [prior], prior
    for _ in range(1, shape.depth):
        scores = [f + p for f in frontier for p in prior]
        by_depth.append(scores)
        frontier = sorted(scores, reverse=True)[: shape.topk]
    return by_depth


def grow_tree(setup, tokens: list[int], shape: TreeShape,
              keep_growing: Callable[[torch.Tensor], bool] | None = None) -> tuple[Growth, Candidates]:
    """Grow an EAGLE-2 tree of ``shape`` after the committed ``tokens`` (see the module's docstring) with the
    setup's proposer (one that can :meth:`branch`), policy, sampling and timer. ``keep_growing``: asked before
    each depth after the first, with the frontier's cumulative scores [K] on the device, whether to grow it
    (``--tree auto``: :meth:`~dynvocab.runtime.trees.budget.TreeBudget.keep_growing`); None grows every depth.
    Returns what the growth made and all its candidates; :func:`tree_of` chooses the nodes to verify."""
    proposer, policy, sampling, timer, sec = setup.proposer, setup.policy, setup.sampling, setup.timer, setup.sections
    k, device = shape.topk, proposer.info.device
    log_prior = torch.tensor(_log_prior(k), dtype=torch.double, device=device)
    feed = torch.tensor(tokens[proposer.length:], dtype=torch.long, device=device)  # once per cycle
    hidden = proposer.step(feed)[-1:]  # [1, d]
    sets, tops, probs_by_depth = [], [], []
    cand_tokens, cand_parents, cand_scores, frontier_ids = [], [], [], []

    def head(depth: int, head_in: torch.Tensor, token: torch.Tensor):
        t_active = timer.mark()
        nodes = policy.node_sets(depth, head_in, token) if setup.node_sets and depth else None
        active = policy.active_ids(depth, head_in[:1], token[:1]) if nodes is None else nodes.active
        t_head = timer.mark()
        logits, cols = proposer.head_logits(head_in, active)  # [r, n], [n] or None
        if nodes is not None:
            logits = nodes.mask(logits, cols)  # each node over its own set
        timer.add(sec.active, t_active, t_head)
        timer.add(sec.head, t_head)
        sets.append(active)
        children, increments, probs = _expand(logits, cols, k, sampling, setup.generator, log_prior)
        probs_by_depth.append((probs, cols))
        if policy.draft_topk:
            tops.append(children.reshape(-1))
        return children, increments

    children, increments = head(0, hidden, feed[-1:])  # [1, k] each
    cand_tokens.append(children[0])
    cand_parents.append(torch.full((k,), -1, dtype=torch.long, device=device))
    cand_scores.append(increments[0])
    frontier = torch.arange(k, device=device)  # candidate ids of the frontier rows
    frontier_tokens, frontier_scores = children[0], increments[0]
    feats = proposer.tree_root().expand(k, -1)  # [k, d]
    ancestors = torch.zeros(k, 0, dtype=torch.bool, device=device)
    offset = k
    for depth in range(1, shape.depth):
        if keep_growing is not None and not keep_growing(frontier_scores):
            break
        frontier_ids.append(frontier)
        out, head_in = proposer.branch(frontier_tokens, feats, depth, ancestors)  # [k, d] each
        children, increments = head(depth, head_in, frontier_tokens)  # [k, k] each
        scores = (frontier_scores[:, None] + increments).cummin(dim=1).values  # a later sibling never outranks
        cand_tokens.append(children.reshape(-1))
        cand_parents.append(frontier.repeat_interleave(k))
        cand_scores.append(scores.reshape(-1))
        if depth + 1 < shape.depth:
            best = scores.reshape(-1).topk(k)
            rows = best.indices // k
            frontier, frontier_scores = offset + best.indices, best.values
            frontier_tokens = children.reshape(-1)[best.indices]
            feats = out[rows]
            ancestors = torch.cat([ancestors, torch.eye(k, dtype=torch.bool, device=device)], dim=1)[rows]
        offset += k * k
    values = to_host(torch.cat([torch.cat(cand_tokens).double(), torch.cat(cand_parents).double(),
                                torch.cat(cand_scores), *(f.double() for f in frontier_ids)]))
    count = offset
    candidates = Candidates(
        k, [int(v) for v in values[:count]], [int(v) for v in values[count : 2 * count]], list(values[2 * count : 3 * count]),
        [[int(v) for v in values[3 * count + i * k : 3 * count + (i + 1) * k]] for i in range(len(frontier_ids))],
    )
    return Growth(sets, tops, probs_by_depth), candidates


def tree_of(growth: Growth, candidates: Candidates, n: int, extra: list[int] = (), device="cpu") -> GrownTree:
    """The tree verifying the ``n`` best ``candidates`` of ``growth`` (and a chain ``extra`` of tokens under the
    root, an n-gram lookup's continuation, greedy only): its :class:`~dynvocab.runtime.trees.tree.DraftTree`, its
    tokens uploaded once to ``device`` (the pass and the verdict read them there), and the draft's distributions at
    its rows. The chain runs through the kept nodes that already hold its first tokens and
    adds nodes only below them: the walk takes the first child whose token matches, so a second child with the same
    token would never be reached."""
    kept = candidates.choose(n)
    row_of = {-1: 0}
    parents, toks = [-1], [-1]
    for i in kept:
        row_of[i] = len(parents)
        parents.append(row_of[candidates.parents[i]])
        toks.append(candidates.tokens[i])
    children: dict[int, list[int]] = {}
    for i in kept:
        children.setdefault(candidates.parents[i], []).append(i)
    main, node = [], -1
    while children.get(node):
        node = max(children[node], key=lambda i: (candidates.scores[i], -i))
        main.append(row_of[node])
    below: dict[int, list[int]] = {}  # row -> its children's rows
    for row in range(1, len(parents)):
        below.setdefault(parents[row], []).append(row)
    row = 0
    for token in extra:
        child = next((c for c in below.get(row, ()) if toks[c] == token), None)
        if child is None:
            parents.append(row)
            toks.append(token)
            child = len(parents) - 1
            below.setdefault(row, []).append(child)
        row = child
    proposals = {}
    depth_probs = growth.depth_probs
    if depth_probs and depth_probs[0][0] is not None:
        proposals[0] = (depth_probs[0][0][0], depth_probs[0][1])
        for depth, ids in enumerate(candidates.expanded, start=1):
            probs, cols = depth_probs[depth]
            for r, i in enumerate(ids):
                if i in row_of:
                    proposals[row_of[i]] = (probs[r], cols)
    tree = DraftTree.of(parents, toks[1:], main, device)
    return GrownTree(tree, growth.sets, len(candidates.tokens), growth.tops, proposals)


__all__ = ["Candidates", "GrownTree", "Growth", "grow_tree", "rank_scores", "tree_of", "PRIOR_DECAY", "PRIOR_FIRST"]
