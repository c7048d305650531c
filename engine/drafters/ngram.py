"""Prompt lookup: draft by copying what followed the last n tokens earlier in the context.

When a reply repeats the prompt (code editing, summaries that quote), the longest suffix of
the context that occurred before predicts long runs of tokens for free. Deterministic, so
verification treats its q as one-hot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.drafters.base import Draft
from engine.sampling import SamplingParams


@dataclass
class NgramDrafter:
    """Longest-suffix match over prompt + generated tokens.

    Tries suffix lengths from `max_n` down to `min_n`; among matches of that length the most
    recent occurrence wins (recent text predicts the next text best).
    """

    min_n: int = 2
    max_n: int = 6
    max_draft: int = 16
    name: str = "ngram"

    def match(self, context: Sequence[int], k: int) -> tuple[int, ...]:
        """The tokens following the best earlier match of a suffix, at most `k` of them."""
        return self.match_with_length(context, k)[0]

    def match_with_length(self, context: Sequence[int], k: int) -> tuple[tuple[int, ...], int]:
        """Like `match`, plus the length of the matched suffix (0 when nothing matched)."""
        k = min(k, self.max_draft)
        n_ctx = len(context)
        if k <= 0 or n_ctx < self.min_n + 1:
            return (), 0
        ctx = list(context)
        for n in range(min(self.max_n, n_ctx - 1), self.min_n - 1, -1):
            suffix = ctx[n_ctx - n :]
            first = suffix[0]
            # scan right-to-left for the most recent earlier occurrence
            i = n_ctx - n - 1
            while i >= 0:
                try:
                    i = _rindex(ctx, first, i)
                except ValueError:
                    break
                if ctx[i : i + n] == suffix:
                    follow = ctx[i + n : i + n + k]
                    if follow:
                        return tuple(follow), n
                i -= 1
        return (), 0

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                accept: str) -> Draft:
        return Draft(self.match(context, k))

    def commit(self, context: Sequence[int]) -> None:
        return None

    def reset(self) -> None:
        return None


def _rindex(seq: list[int], value: int, end: int) -> int:
    """Index of the last `value` in seq[: end + 1]; ValueError when absent."""
    for j in range(end, -1, -1):
        if seq[j] == value:
            return j
    raise ValueError(value)
