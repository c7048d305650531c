"""One target pass over a draft tree, the coupled walk down it, and the cache gather.

The pass writes the newest token's row and every node's row after the committed rows (so
the cache never holds more than committed length + 1 + the tree's nodes, or the padded
width, within the same budget, where a wider pass is cheaper: `CostModel.pad_width`).
Acceptance walks down from the root: at each depth it takes the child equal to the target's
own coupled sample at that absolute position — the token plain decoding commits there, so
the text is identical to plain decoding whichever branch wins. Then one gather per layer
moves the accepted path's rows into place and sets the length: no second pass, no restore.

The rejection rule is verified on chains only: a tree under it is cut to its first chain
before the pass (`chain_for_rejection`). Recursive multi-candidate rejection (SpecInfer)
is not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from engine.cache import KVCache, cache_length, compact_caches
from engine.models.attention import inference_pass
from engine.models.taps import FeatureTap
from engine.sampling import SamplingParams, coupled_rows
from engine.tree import ROOT, DraftTree, ancestor_mask, kept_rows, row_positions
from engine.verify import Verdict


@dataclass(frozen=True)
class TreeVerdict:
    """The accepted path (node indices, root down), then the target's own token after it;
    `node_probs[j]` is the target's probability of node j's token under its parent's row
    (None for a rejected tree node: not computed, the walk needs only each row's sample)."""

    path: tuple[int, ...]
    token: int
    token_prob: float
    node_probs: tuple[float | None, ...]

    @classmethod
    def from_chain(cls, verdict: Verdict) -> TreeVerdict:
        return cls(tuple(range(verdict.n_accepted)), verdict.token, verdict.token_prob,
                   verdict.draft_probs)


def tree_pass(model, caches: Sequence[KVCache], last: int, tree: DraftTree,
              width: int = 0) -> mx.array:
    """Logits (1 + N, V) for [last, *nodes]: row 0 predicts depth 1, row 1 + j the child
    of node j. A chain takes the plain causal pass; a tree gets its ancestor mask and the
    per-row positions committed length + depth.

    `width`: run the pass this many rows wide when that is more than 1 + N
    (`CostModel.pad_width`: a wider pass can cost less). The padding rows repeat `last`
    after the nodes (for a tree, as more children of the root), so no node's row sees
    them; their logits are dropped and their cache rows go with the rejected ones.
    A chain's ids the target has no row for (a draft model's padded embedding) are fed
    as a stand-in: such a draft is always rejected, so the rows after it are never used.
    """
    with inference_pass():
        return _tree_pass(model, caches, last, tree, width)


def _tree_pass(model, caches: Sequence[KVCache], last: int, tree: DraftTree,
               width: int) -> mx.array:
    vocab = model.args.vocab_size
    n_pad = max(width - 1 - len(tree), 0)
    feed = mx.array([[last, *(t if t < vocab else 0 for t in tree.ids), *[last] * n_pad]])
    rows = 1 + len(tree)
    if tree.is_chain:
        return model(feed, cache=list(caches))[0][:rows]
    padded = (DraftTree(tree.ids + (last,) * n_pad, tree.parents + (ROOT,) * n_pad)
              if n_pad else tree)
    start = cache_length(caches)
    mask = ancestor_mask(padded, start)
    positions = mx.array(row_positions(padded, start), dtype=mx.int32)
    return model(feed, mask=mask, cache=list(caches), positions=positions)[0][:rows]


def _row_history(context: Sequence[int], tree: DraftTree, row: int) -> list[int]:
    """The tokens before the position row `row` predicts: context, then the row's path."""
    return [*context, *(tree.ids[j] for j in tree.path(row - 1))] if row else list(context)


def verify_tree_coupled(logits: mx.array, tree: DraftTree, context: Sequence[int],
                        sampling: SamplingParams) -> TreeVerdict:
    """Walk down the tree taking, at each depth, the child equal to the target's coupled
    sample at that position; stop at the first position with no such child (the sample is
    the REPLACED token) or at a leaf (the sample is the BONUS token).

    One sampler call gives every row's own sample at its position (row 0 at t0, node j's
    row at t0 + depth); rows are read back once.
    """
    t0, n = len(context), len(tree)
    positions = row_positions(tree, t0)
    histories = None
    if sampling.repetition_penalty != 1.0:
        histories = [_row_history(context, tree, r) for r in range(n + 1)]
    sampled = coupled_rows(logits, sampling, histories, positions)
    mx.eval(sampled.tokens, sampled.p_token)
    tokens = sampled.tokens.tolist()
    p_token = sampled.p_token.tolist()
    probs: list[float | None] = [None] * n
    children = tree.children
    path: list[int] = []
    node, row = ROOT, 0
    while True:
        want = tokens[row]
        nxt = next((c for c in children.get(node, ()) if tree.ids[c] == want), None)
        if nxt is None:
            return TreeVerdict(tuple(path), int(want), float(p_token[row]), tuple(probs))
        probs[nxt] = float(p_token[row])  # an accepted node is its parent row's sample
        path.append(nxt)
        node, row = nxt, 1 + nxt


def chain_for_rejection(tree: DraftTree) -> int:
    """How many leading nodes the rejection rule verifies: the tree's first chain (the rule
    here is Leviathan/Chen's, which preserves the target distribution for one chain only)."""
    return tree.first_chain()


def commit_path(model, caches: Sequence[KVCache], start: int, path: Sequence[int]) -> None:
    """Move the accepted path's rows into place after `start` (the committed rows before the
    pass) and set the length: row 0 (the newest token) and the path's nodes stay. The target's
    feature tap, if any, gets the same gather, so the trained head reads the path's states."""
    keep = kept_rows(path)
    compact_caches(caches, start, keep)
    taps = getattr(model, "feature_taps", None)
    if taps and caches:
        tap: FeatureTap
        for tap in taps.find_all(caches[0]):
            tap.compact(start, keep)
