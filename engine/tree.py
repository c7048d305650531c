"""Draft trees: several guesses per position, verified by the target in one pass.

A chain bets everything on one guess per position; a tree keeps a second candidate where
a drafter is unsure (two earlier matches of the suffix that continue differently, the draft
model's runner-up). `DraftTree` is the one shape every drafter may return: node tokens in
depth-first order with the index of each node's parent (`ROOT` for a child of the newest
committed token). A chain is the degenerate tree whose node i has parent i - 1, so the
step loop has one verify path for both.

The verify pass feeds the newest committed token (row 0) and then every node (row 1 + j).
Each row attends to the committed context, to row 0 and to its own ancestors only
(`ancestor_mask`), and sits at position `start + depth` in RoPE (`row_positions`), so each
node's row is exactly the row a chain through it would have produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import mlx.core as mx

ROOT = -1


class TreeError(ValueError):
    """A drafter's tree that cannot be verified: the step falls back to a plain step."""


@dataclass(frozen=True)
class DraftTree:
    """Node tokens in depth-first order and each node's parent (ROOT = the newest token)."""

    ids: tuple[int, ...]
    parents: tuple[int, ...]

    @classmethod
    def chain(cls, ids: Sequence[int]) -> DraftTree:
        return cls(tuple(ids), tuple(range(-1, len(ids) - 1)))

    def __len__(self) -> int:
        return len(self.ids)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of every node (a child of the root has depth 1); assumes a valid tree."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p == ROOT else out[p] + 1)
        return tuple(out)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def first_chain(self) -> int:
        """How many leading nodes form a chain (the tree's first root-to-leaf path)."""
        n = 0
        while n < len(self.parents) and self.parents[n] == n - 1:
            n += 1
        return n

    @cached_property
    def children(self) -> dict[int, tuple[int, ...]]:
        """Node (or ROOT) -> its children in order."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            out.setdefault(p, []).append(i)
        return {p: tuple(c) for p, c in out.items()}

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node` (empty for ROOT)."""
        out: list[int] = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def leaf_paths(self) -> tuple[tuple[int, ...], ...]:
        """The tree's branches: every root-to-leaf path (node indices), in depth-first
        order, so branch 1 is the first chain."""
        return tuple(tuple(self.path(i)) for i in range(len(self)) if i not in self.children)


def validate_tree(tree: DraftTree, vocab_size: int, max_nodes: int, max_depth: int) -> None:
    """Raise `TreeError` naming the first thing wrong with a drafter's tree.

    Checked before the pass: the parent list is as long as the tokens; each parent comes
    before its child and lies on the path to the node before it (depth-first order, which
    also rules out cycles); no two siblings draft the same token; the node count and depth
    stay within the budget; every id is in the target's vocabulary.
    """
    ids, parents = tree.ids, tree.parents
    if len(parents) != len(ids):
        raise TreeError(f"draft tree: {len(ids)} tokens but {len(parents)} parent indices")
    if len(ids) > max_nodes:
        raise TreeError(f"draft tree: {len(ids)} nodes exceed the budget of {max_nodes}")
    stack: list[int] = []  # path from the root to the previous node
    seen: dict[int, set[int]] = {}
    for i, (tok, p) in enumerate(zip(ids, parents, strict=True)):
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            raise TreeError(f"draft tree: node {i} token {tok!r} is outside the vocabulary "
                            f"(0..{vocab_size - 1})")
        if isinstance(p, bool) or not isinstance(p, int):
            raise TreeError(f"draft tree: node {i} parent {p!r} is not an index")
        if p >= i:
            raise TreeError(f"draft tree: node {i} has parent {p}, which does not come before "
                            "it (a parent after its child, or a cycle)")
        if p != ROOT and p < 0:
            raise TreeError(f"draft tree: node {i} parent {p} is neither a node nor the root "
                            f"({ROOT})")
        while stack and stack[-1] != p:
            stack.pop()
        if p != ROOT and not stack:
            raise TreeError(f"draft tree: node {i} hangs under node {p}, whose subtree "
                            "already ended (tokens are not in depth-first order)")
        if tok in seen.setdefault(p, set()):
            raise TreeError(f"draft tree: node {i} repeats token {tok} of a sibling "
                            f"under {'the root' if p == ROOT else f'node {p}'}")
        seen[p].add(tok)
        stack.append(i)
        if len(stack) > max_depth:
            raise TreeError(f"draft tree: node {i} is at depth {len(stack)}, beyond the "
                            f"budget of {max_depth}")


def ancestor_mask(tree: DraftTree, n_cached: int) -> mx.array:
    """Boolean (1 + N, n_cached + 1 + N): row r may attend to key c.

    Every row sees the committed rows and row 0 (the newest token); row 1 + j also sees
    its ancestors' rows and its own.
    """
    n = len(tree)
    rows = [[True] + [False] * n for _ in range(n + 1)]
    for j, p in enumerate(tree.parents):
        row = rows[1 + j]
        if p != ROOT:
            row[:] = rows[1 + p]
        row[1 + j] = True
    tail = mx.array(rows, dtype=mx.bool_)
    if n_cached == 0:
        return tail
    return mx.concatenate([mx.ones((n + 1, n_cached), dtype=mx.bool_), tail], axis=1)


def row_positions(tree: DraftTree, start: int) -> list[int]:
    """Absolute position of every row of the pass: row 0 at `start`, node j at start + depth."""
    return [start, *(start + d for d in tree.depths)]


def kept_rows(path: Sequence[int]) -> list[int]:
    """Rows of the pass to keep in the cache when `path` (node indices) was accepted: row 0
    and the path's nodes, in order — they become the committed rows start, start + 1, ..."""
    return [0, *(1 + j for j in path)]
