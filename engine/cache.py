"""Key/value caches.

The cache is preallocated in chunks so the decode loop writes in place instead of
concatenating every step, and it can be cut back to any committed length: speculative
verification writes K+1 rows, then keeps only the accepted prefix. `compact` keeps a
chosen subset of freshly written rows (the accepted path through a draft tree): the rows
that move are gathered through `kernels.dispatch` (the KV-compaction kernel where doctor
allowed it, MLX's gather elsewhere), then written into place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import mlx.core as mx

from kernels import dispatch


@runtime_checkable
class KVCache(Protocol):
    """What an attention layer needs from its cache."""

    offset: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append `keys`/`values` (B, kv_heads, L, head_dim); return all rows so far."""
        ...

    def trim(self, length: int) -> None:
        """Forget every row at or after `length` (the committed length)."""
        ...

    def compact(self, start: int, keep: Sequence[int]) -> None:
        """Keep rows `start + i` for i in `keep` (in order) after `start`; drop the rest."""
        ...


class PreallocatedKVCache:
    """A KV cache in buffers that grow `chunk` rows at a time."""

    def __init__(self, chunk: int = 256) -> None:
        self.chunk = chunk
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        B, n_kv, _, k_dim = keys.shape
        v_dim = values.shape[3]
        n_chunks = (needed - self.capacity + self.chunk - 1) // self.chunk
        extra = n_chunks * self.chunk
        new_k = mx.zeros((B, n_kv, extra, k_dim), keys.dtype)
        new_v = mx.zeros((B, n_kv, extra, v_dim), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            assert self.values is not None
            # keep the whole old buffer: `extra` was sized from `capacity`, and after a trim
            # offset < capacity, so keeping only `offset` rows could leave too few
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        L = keys.shape[2]
        end = self.offset + L
        if end > self.capacity:
            self._grow(keys, values, end)
        assert self.keys is not None and self.values is not None
        self.keys[..., self.offset : end, :] = keys
        self.values[..., self.offset : end, :] = values
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def trim(self, length: int) -> None:
        if length < 0 or length > self.offset:
            raise ValueError(f"cannot trim a cache of {self.offset} rows to {length}")
        self.offset = length

    def compact(self, start: int, keep: Sequence[int]) -> None:
        keep = list(keep)
        if self.keys is None or not keep:
            self.trim(start)
            return
        if start < 0 or min(keep) < 0 or start + max(keep) >= self.offset:
            raise ValueError(f"cannot keep rows {keep} after row {start} of a cache of "
                             f"{self.offset} rows")
        assert self.values is not None
        moved = rows_in_place(keep)  # a chain's prefix moves nothing at all
        end = start + len(keep)
        if moved < len(keep):
            # gathered into a separate buffer first, so no row is overwritten before it is read
            k, v = dispatch.gather_kv_rows(self.keys, self.values,
                                           [start + i for i in keep[moved:]])
            self.keys[..., start + moved : end, :] = k
            self.values[..., start + moved : end, :] = v
        self.offset = end

    @property
    def state(self) -> tuple[mx.array, mx.array] | None:
        """The live rows, for `mx.eval` after a step."""
        if self.keys is None or self.values is None:
            return None
        return self.keys, self.values


def rows_in_place(keep: Sequence[int]) -> int:
    """How many leading kept rows are already where they belong (keep[i] == i)."""
    n = 0
    while n < len(keep) and keep[n] == n:
        n += 1
    return n


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` have in common: how much of a cache holding `a`
    a prompt `b` can reuse."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def make_caches(n_layers: int, chunk: int = 256) -> list[PreallocatedKVCache]:
    """One cache per decoder layer."""
    return [PreallocatedKVCache(chunk) for _ in range(n_layers)]


def cache_length(caches: Sequence[KVCache]) -> int:
    """The committed length of a per-layer cache list (all layers agree)."""
    return caches[0].offset if caches else 0


def trim_caches(caches: Sequence[KVCache], length: int) -> None:
    for c in caches:
        c.trim(length)


def compact_caches(caches: Sequence[KVCache], start: int, keep: Sequence[int]) -> None:
    for c in caches:
        c.compact(start, keep)
