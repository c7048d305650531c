"""The `Drafter` protocol: anything that can guess the target's next tokens cheaply.

A drafter proposes up to k tokens after a committed context and, where it has them, its
own distributions q (for the rejection rule). After verification `commit` tells it the new
committed context so it can cut its own state back (or catch up) to match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from engine.cache import KVCache, cache_length, trim_caches
from engine.sampling import SamplingParams
from engine.tree import DraftTree


@dataclass(frozen=True)
class Draft:
    """Proposed tokens and, for model drafters, their log-distributions (n, V).

    `logq` None means the drafter is deterministic: verification treats q as one-hot.
    `parents` makes the tokens a draft tree (depth-first, `engine.tree.DraftTree`); None is
    a chain, the degenerate tree.
    """

    ids: tuple[int, ...]
    logq: mx.array | None = None
    parents: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def tree(self) -> DraftTree:
        if self.parents is None:
            return DraftTree.chain(self.ids)
        return DraftTree(tuple(self.ids), tuple(self.parents))


class Drafter(Protocol):
    """What the speculative loop needs from a drafter."""

    name: str

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                accept: str) -> Draft:
        """Guess up to `k` tokens following `context` (the whole committed sequence)."""
        ...

    def commit(self, context: Sequence[int]) -> None:
        """Bring internal state in line with the committed `context`."""
        ...

    def reset(self) -> None:
        """Forget every cached state (a new conversation)."""
        ...


def sync_cache(model, caches: Sequence[KVCache], cached_ids: list[int],
               context: Sequence[int]) -> tuple[list[int], mx.array | None]:
    """Make `caches` hold exactly `context[:-1]`, reusing the longest shared prefix.

    Returns the new cached ids and, when tokens had to be fed, the logits of the last fed
    token (None otherwise). This is how a draft model catches up the target's replaced or
    bonus token, and how its cache survives across chat turns.
    """
    want = list(context[:-1])
    n = 0
    limit = min(len(cached_ids), cache_length(caches), len(want))
    while n < limit and cached_ids[n] == want[n]:
        n += 1
    trim_caches(caches, n)
    logits = None
    if n < len(want):
        logits = model(mx.array([want[n:]]), cache=list(caches))[0]
    return want, logits
