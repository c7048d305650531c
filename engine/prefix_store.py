"""Prompt caches of conversations the session has left, kept for when it comes back.

A session holds one KV cache, and a follow-up turn only reads its new tokens. Switching to
another conversation (the app's sidebar, a second editor talking to the server) used to
throw that cache away, so coming back meant reading the whole conversation again: on the
demo model on this CPU a 2,000-token chat is ~8 s of prompt and an 8,000-token one ~100 s
(attention over long contexts dominates). The store keeps the last few caches, bounded by
bytes, and hands one back when a prompt starts with more of it than the live cache holds.

Caches move in and out by reference, never copied: an entry owns the buffers it was given
and gives them up when taken. A live cache parked after a shared start keeps a view of
those rows, which its next write outgrows into a buffer of its own, so no pass writes into
a parked buffer. The head drafter's feature taps move with the cache: their rows are per
position of the same conversation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from engine.cache import PreallocatedKVCache, shared_length, trim_caches, usable_length
from engine.models.taps import FeatureTap

# at most 1 GiB (three full 8k-token windows of the demo model at 46 KB a position in
# float32, or one of an 8B model in float16 at 128 KB) and a sixteenth of the machine's RAM
MAX_BUDGET_BYTES = 1 << 30
RAM_SHARE = 16
# a prefix this short is read again in well under a second; keeping it only evicts others
MIN_TOKENS = 256


@dataclass
class Layer:
    """One layer's cache buffers as they were when parked."""

    keys: mx.array | None
    values: mx.array | None
    offset: int
    base: int = 0  # the position of the buffers' first row (a windowed cache dropped some)


@dataclass
class Parked:
    """A conversation's prompt cache: its token ids, every layer's rows and its taps' rows."""

    ids: tuple[int, ...]
    layers: list[Layer]
    taps: list[tuple[FeatureTap, list[tuple[int, mx.array]]]]

    @property
    def nbytes(self) -> int:
        total = sum(a.nbytes for layer in self.layers for a in (layer.keys, layer.values)
                    if a is not None)
        return total + sum(rows.nbytes for _, chunks in self.taps for _, rows in chunks)


def default_budget() -> int:
    """Bytes parked caches may hold on this machine."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows) or no such name
        return MAX_BUDGET_BYTES // 4
    return min(MAX_BUDGET_BYTES, ram // RAM_SHARE)


def carries_on(old: Sequence[int], new: Sequence[int], tail: int = 32) -> bool:
    """Whether `new` goes on from where `old` ends: the same conversation with its oldest
    exchanges left out (`engine.context_fit`), or a longer one. Its old cache would never
    be asked for again, so parking it would only evict caches that may be."""
    end = tuple(old[-tail:])
    if not end:
        return False
    n, first = len(end), end[0]
    return any(new[i] == first and tuple(new[i : i + n]) == end
               for i in range(len(new) - n + 1))


class PrefixStore:
    """Parked prompt caches, least recently used evicted first past `budget_bytes`."""

    def __init__(self, budget_bytes: int | None = None, min_tokens: int = MIN_TOKENS) -> None:
        self.budget_bytes = default_budget() if budget_bytes is None else budget_bytes
        self.min_tokens = min_tokens
        self._entries: list[Parked] = []  # oldest first

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def lengths(self) -> list[int]:
        """Each parked cache's length in tokens, oldest first."""
        return [len(e.ids) for e in self._entries]

    def park(self, ids: Sequence[int], caches: Sequence[PreallocatedKVCache],
             taps: Sequence[FeatureTap], keep: int) -> bool:
        """Move the caches' rows (and the taps') into the store, leaving the caches holding
        their first `keep` rows only; returns whether anything was parked. A cache too
        short to be worth keeping, or larger than the whole budget, is left as it was."""
        n = min(len(ids), caches[0].offset if caches else 0)
        if n < self.min_tokens or n - keep < self.min_tokens:
            return False
        entry = Parked(tuple(ids[:n]),
                       [Layer(c.keys, c.values, c.offset, c.base) for c in caches],
                       [(t, list(t.chunks)) for t in taps])
        if entry.nbytes > self.budget_bytes:
            return False
        self._entries = [e for e in self._entries if e.ids != entry.ids]
        self._entries.append(entry)
        for c in caches:
            # the live cache keeps a view of the shared rows; its next write outgrows the
            # view and copies them into a buffer of its own (`PreallocatedKVCache._grow`)
            if c.keys is not None and c.values is not None and keep:
                rows = keep - c.base
                c.keys, c.values = c.keys[..., :rows, :], c.values[..., :rows, :]
            else:
                c.keys = c.values = None
                c.base = 0
            c.offset = keep
        for t in taps:
            t.truncate(keep)  # rows are never written in place: the parked list stays whole
        self._evict()
        return True

    def reuse(self, held: Sequence[int], caches: Sequence[PreallocatedKVCache],
              taps: Sequence[FeatureTap], prompt_ids: Sequence[int], limit: int) -> int:
        """Leave `caches` (holding `held`) with the longest prefix of `prompt_ids` that they
        or a parked cache hold, at most `limit` tokens (none where a windowed layer dropped
        rows it would need: `usable_length`); returns its length. A parked cache
        that shares more comes back and the live one is parked in its place; a live cache
        that would lose most of its rows is parked before they go. Either way not when the
        prompt goes on from the live cache's end: that conversation moved on."""
        n = usable_length(caches, min(shared_length(held, prompt_ids), limit))
        entry, shared = self._closest(prompt_ids)
        if entry is not None:  # (its windowed layers may have dropped rows needed again)
            shared = usable_length(caches, min(shared, limit),
                                   [layer.base for layer in entry.layers])
        if entry is not None and shared > n:
            if not carries_on(held, prompt_ids):
                self.park(held, caches, taps, keep=0)
            self._load(entry, caches, taps)
            n = shared
        elif len(held) - n > n and not carries_on(held, prompt_ids):
            self.park(held, caches, taps, keep=n)
        trim_caches(caches, n)
        return n

    def best(self, prompt_ids: Sequence[int]) -> int:
        """The longest prefix of `prompt_ids` a parked cache holds (0 when none)."""
        return self._closest(prompt_ids)[1]

    def _closest(self, prompt_ids: Sequence[int]) -> tuple[Parked | None, int]:
        """The parked cache sharing the longest prefix with `prompt_ids` (the most recently
        parked of equals), and that prefix's length."""
        best: tuple[Parked | None, int] = (None, 0)
        for e in reversed(self._entries):
            shared = shared_length(e.ids, prompt_ids)
            if shared > best[1]:
                best = (e, shared)
        return best

    def _load(self, entry: Parked, caches: Sequence[PreallocatedKVCache],
              taps: Sequence[FeatureTap]) -> None:
        """Move `entry` out of the store into `caches` and `taps`."""
        self._entries.remove(entry)
        for c, layer in zip(caches, entry.layers, strict=True):
            c.keys, c.values, c.offset, c.base = (layer.keys, layer.values, layer.offset,
                                                  layer.base)
        for t in taps:
            t.chunks = next((chunks for owner, chunks in entry.taps if owner is t), [])

    def clear(self) -> None:
        self._entries = []

    def _evict(self) -> None:
        while self._entries and self.nbytes > self.budget_bytes:
            self._entries.pop(0)
