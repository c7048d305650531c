"""Whether a draft tree pays over its chain, and how much of it: from the cost curve.

A tree's extra nodes widen the verify pass. On this CPU width 8 costs about 1.3-1.5x
width 1, so a second candidate at a shallow depth is often worth its row and a deep bushy
tree is not. Expected committed tokens are computable per node: with chain acceptance a
(per depth) and b the chance that an alternative child is right when its older sibling was
wrong, the l-th node of a branch forking at depth d adds a^(d-1) (1-a) b a^(l-1) tokens.
`prune_tree` adds nodes in order of that gain while the expected tokens per second of the
step still rise (a chain when no node pays). `TreeStats` learns b from verified trees.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from engine.tree import ROOT, DraftTree
from engine.tuning import AcceptanceEstimate, CostModel, expected_tokens

EXTRA_NODES = 8  # most nodes a tree may add beyond its main chain
ALT_PRIOR = 0.35  # prior chance an alternative child is right after its sibling missed


@dataclass
class TreeStats:
    """How often an alternative child was accepted where the first child was rejected."""

    alt: AcceptanceEstimate = field(default_factory=lambda: AcceptanceEstimate(ALT_PRIOR))
    trees: int = 0

    def observe(self, tree: DraftTree, path: tuple[int, ...]) -> None:
        """One verified tree: at each node the walk reached whose first child lost, did
        another child win?"""
        if tree.is_chain:
            return
        self.trees += 1
        children = tree.children
        node = ROOT
        for depth in range(len(path) + 1):
            kids = children.get(node, ())
            taken = path[depth] if depth < len(path) else None
            if len(kids) > 1 and taken != kids[0]:
                self.alt.update(1, int(taken is not None))
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
               draft_s: float = 0.0) -> DraftTree:
    """The subtree with the best expected tokens per second: the main chain plus the
    branch nodes that pay for their rows (a chain when none does)."""
    n_main = tree.first_chain()
    if n_main == len(tree) or costs is None:
        return tree
    tokens = expected_tokens(alpha, n_main)
    seconds = n_main * draft_s + costs.verify(n_main + 1)
    heap: list[tuple[float, int, int, int]] = []  # (-gain, branch, position in branch, node)
    branches = _branches(tree)
    for b, (depth, nodes) in enumerate(branches):
        reach = alpha ** (depth - 1) * (1 - alpha) * alt
        heapq.heappush(heap, (-reach, b, 0, nodes[0]))
    kept: set[int] = set(range(n_main))
    width = n_main + 1
    while heap:
        neg_gain, b, pos, node = heapq.heappop(heap)
        parent = tree.parents[node]
        if parent != ROOT and parent not in kept:
            continue  # forks off a branch that did not pay
        new_tokens, new_seconds = tokens - neg_gain, seconds + costs.verify(width + 1) \
            - costs.verify(width)
        if new_tokens / new_seconds <= tokens / seconds:
            break
        tokens, seconds, width = new_tokens, new_seconds, width + 1
        kept.add(node)
        nodes = branches[b][1]
        if pos + 1 < len(nodes):
            heapq.heappush(heap, (neg_gain * alpha, b, pos + 1, nodes[pos + 1]))
    return subtree(tree, kept)


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
