"""Prompt lookup: draft by copying what followed the last n tokens earlier in the context.

When a reply repeats the prompt (code editing, summaries that quote), the longest suffix of
the context that occurred before predicts long runs of tokens for free. Deterministic, so
verification treats its q as one-hot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.drafters.base import Draft
from engine.sampling import SamplingParams


@dataclass
class NgramDrafter:
    """Longest-suffix match over prompt + generated tokens.

    Tries suffix lengths from `max_n` down to `min_n`; among matches of that length the most
    recent occurrence wins (recent text predicts the next text best). An index from each
    n-gram to its latest start is extended as the context grows, so a lookup costs the same
    at token 50 and at token 50,000 — it runs every step, on the critical path.
    """

    min_n: int = 2
    max_n: int = 6
    max_draft: int = 16
    name: str = "ngram"
    _ids: list[int] = field(default_factory=list, init=False, repr=False)
    # _index[n - min_n]: n-gram -> latest start i that has a token after it (i + n < len)
    _index: list[dict[tuple[int, ...], int]] = field(default_factory=list, init=False,
                                                      repr=False)

    def match(self, context: Sequence[int], k: int) -> tuple[int, ...]:
        """The tokens following the best earlier match of a suffix, at most `k` of them."""
        return self.match_with_length(context, k)[0]

    def match_with_length(self, context: Sequence[int], k: int) -> tuple[tuple[int, ...], int]:
        """Like `match`, plus the length of the matched suffix (0 when nothing matched)."""
        k = min(k, self.max_draft)
        n_ctx = len(context)
        if k <= 0 or n_ctx < self.min_n + 1:
            return (), 0
        ids = self._sync(context)
        for n in range(min(self.max_n, n_ctx - 1), self.min_n - 1, -1):
            i = self._index[n - self.min_n].get(tuple(ids[n_ctx - n :]))
            if i is not None:
                return tuple(ids[i + n : i + n + k]), n
        return (), 0

    def _sync(self, context: Sequence[int]) -> list[int]:
        """Bring the index up to `context`: extend it when the context grew, else rebuild."""
        ids = self._ids
        n_old = len(ids)
        if len(context) < n_old or list(context[:n_old]) != ids:
            self.reset()
            ids, n_old = self._ids, 0
        if not self._index:
            self._index = [{} for _ in range(self.min_n, self.max_n + 1)]
        ids.extend(context[n_old:])
        for j in range(max(n_old, self.min_n), len(ids)):
            # token j now follows the n-grams that end just before it
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self._index[n - self.min_n][tuple(ids[j - n : j])] = j - n
        return ids

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                accept: str) -> Draft:
        return Draft(self.match(context, k))

    def commit(self, context: Sequence[int]) -> None:
        return None

    def reset(self) -> None:
        self._ids = []
        self._index = []
