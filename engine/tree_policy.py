"""Whether a draft tree pays over its chain, and how much of it: from the cost curve.

A tree's extra nodes widen the verify pass. On this CPU width 8 costs about 1.3-1.5x
width 1, so a second candidate at a shallow depth is often worth its row and a deep bushy
tree is not. Expected committed tokens are computable per node: with chain acceptance a
(per depth) and b the chance that an alternative child is right when its older sibling was
wrong, the l-th node of a branch forking at depth d adds a^(d-1) (1-a) b a^(l-1) tokens.
`prune_tree` ranks nodes by that gain and keeps the prefix of the ranking with the most
expected tokens per second (a chain when no prefix pays). `TreeStats` learns b from
verified trees.

A model drafter's runner-up carries its score gap: how far below the chain's token it
scored under the same coupled noise (at T = 0, the log-ratio of their draft
probabilities). A close call is a likelier win than a distant one (EAGLE-2's point: the
draft's own confidence predicts acceptance), so b is learned per gap band and the budget
goes to the close calls at whatever depth they are. Prompt lookup has no scores: one b.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.drafters.base import Draft
from engine.tree import ROOT, DraftTree
from engine.tuning import K_MAX, AcceptanceEstimate, CostModel, expected_tokens

ALT_PRIOR = 0.35  # prior chance an alternative child is right after its sibling missed
# score-gap bands of a runner-up (upper edges) and the prior chance it wins in each
GAP_EDGES = (0.5, 1.5, 3.0)
GAP_PRIORS = (0.45, 0.3, 0.15, 0.05)


def gap_band(gap: float) -> int:
    """Which `GAP_EDGES` band a runner-up's score gap falls in."""
    return sum(gap >= edge for edge in GAP_EDGES)


@dataclass
class TreeStats:
    """How often an alternative child was accepted where the first child was rejected:
    per score-gap band for runner-ups that carry a gap, one figure for those that do not."""

    alt: AcceptanceEstimate = field(default_factory=lambda: AcceptanceEstimate(ALT_PRIOR))
    by_gap: list[AcceptanceEstimate] = field(
        default_factory=lambda: [AcceptanceEstimate(p) for p in GAP_PRIORS])
    trees: int = 0

    def chance(self, gap: float | None) -> float:
        """The chance an alternative child with this score gap wins where its older
        sibling lost."""
        return self.alt.alpha if gap is None else self.by_gap[gap_band(gap)].alpha

    def observe(self, tree: DraftTree, path: tuple[int, ...],
                gaps: Sequence[float | None] | None = None) -> None:
        """One verified tree: at each node the walk reached whose first child lost, did
        another child win (which one, for children with a score gap)?"""
        if tree.is_chain:
            return
        self.trees += 1
        children = tree.children
        node = ROOT
        for depth in range(len(path) + 1):
            kids = children.get(node, ())
            taken = path[depth] if depth < len(path) else None
            if len(kids) > 1 and taken != kids[0]:
                scored = [kid for kid in kids[1:] if gaps is not None and gaps[kid] is not None]
                for kid in scored:
                    self.by_gap[gap_band(gaps[kid])].update(1, int(taken == kid))
                if len(scored) < len(kids) - 1:
                    self.alt.update(1, int(taken is not None and taken not in scored))
            if taken is None:
                break
            node = taken


def _branches(tree: DraftTree) -> list[tuple[int, list[int]]]:
    """(fork depth, node indices) of every branch after the main chain, in DFS order."""
    out: list[tuple[int, list[int]]] = []
    for i, p in enumerate(tree.parents):
        if i < tree.first_chain():
            continue
        if p != i - 1:
            out.append((tree.depths[i], [i]))
        else:
            out[-1][1].append(i)
    return out


def prune_tree(tree: DraftTree, alpha: float, alt: float, costs: CostModel | None,
               draft_s: float = 0.0, limit: int = K_MAX + 1) -> DraftTree:
    """The subtree with the best expected tokens per second: the main chain plus the
    branch nodes that pay for their rows (a chain when none does), every alternative child
    priced alike (`alt`: its chance to win where its older sibling lost). Widths are
    priced as they will run under a row budget of `limit` (`CostModel.verify`)."""
    return subtree(tree, kept_nodes(tree, alpha, [alt] * len(tree), costs, draft_s, limit))


def prune_draft(draft: Draft, alpha: float, stats: TreeStats, costs: CostModel | None,
                draft_s: float = 0.0, limit: int = K_MAX + 1) -> Draft:
    """`prune_tree` for a drafter's tree, each branch priced by its score gap where it has
    one; the kept nodes keep their gaps (for `TreeStats.observe`). q is dropped: trees
    are verified under the coupled rule, which does not read it."""
    tree = draft.tree
    gaps = draft.gaps or (None,) * len(tree)
    kept = kept_nodes(tree, alpha, [stats.chance(g) for g in gaps], costs, draft_s, limit)
    pruned = subtree(tree, kept)
    if pruned.is_chain:
        return Draft(pruned.ids)
    kept_gaps = tuple(g for i, g in enumerate(gaps) if i in kept)
    return Draft(pruned.ids, None, pruned.parents, kept_gaps)


def kept_nodes(tree: DraftTree, alpha: float, chances: Sequence[float],
               costs: CostModel | None, draft_s: float = 0.0,
               limit: int = K_MAX + 1) -> set[int]:
    """The nodes worth their rows (each with its parent kept); `chances[i]`: the chance
    node i wins where its older sibling lost (read for the first node of each branch)."""
    n_main = tree.first_chain()
    if n_main == len(tree) or costs is None:
        return set(range(len(tree)))
    tokens = expected_tokens(alpha, n_main)
    seconds = n_main * draft_s + costs.verify(n_main + 1, limit)
    heap: list[tuple[float, int, int, int]] = []  # (-gain, branch, position in branch, node)
    branches = _branches(tree)
    for b, (depth, nodes) in enumerate(branches):
        reach = alpha ** (depth - 1) * (1 - alpha) * chances[nodes[0]]
        heapq.heappush(heap, (-reach, b, 0, nodes[0]))
    kept: set[int] = set(range(n_main))
    width = n_main + 1
    # every prefix of the gain order is priced, not only until the first row that does
    # not pay: the cost curve has steps (a BLAS kernel's row blocking, a GPU's SIMD
    # width), so a row that costs a step can open several that cost nothing
    best_rate, best_n = tokens / seconds, 0
    order: list[int] = []  # the branch nodes in gain order
    while heap:
        neg_gain, b, pos, node = heapq.heappop(heap)
        parent = tree.parents[node]
        if parent != ROOT and parent not in kept:
            continue  # forks off a branch that was not taken
        tokens -= neg_gain
        seconds += costs.verify(width + 1, limit) - costs.verify(width, limit)
        width += 1
        kept.add(node)
        order.append(node)
        if tokens / seconds > best_rate:
            best_rate, best_n = tokens / seconds, len(order)
        nodes = branches[b][1]
        if pos + 1 < len(nodes):
            heapq.heappush(heap, (neg_gain * alpha, b, pos + 1, nodes[pos + 1]))
    return set(range(n_main)) | set(order[:best_n])


def subtree(tree: DraftTree, kept: set[int]) -> DraftTree:
    """The nodes in `kept` (each with its parent kept), renumbered in the same DFS order."""
    new_index: dict[int, int] = {ROOT: ROOT}
    ids: list[int] = []
    parents: list[int] = []
    for i, (tok, p) in enumerate(zip(tree.ids, tree.parents, strict=True)):
        if i in kept and p in new_index:
            new_index[i] = len(ids)
            ids.append(tok)
            parents.append(new_index[p])
    return DraftTree(tuple(ids), tuple(parents))
