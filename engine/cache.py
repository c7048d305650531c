"""Key/value caches.

The cache is preallocated in chunks so the decode loop writes in place instead of
concatenating every step, and it can be cut back to any committed length: speculative
verification writes K+1 rows, then keeps only the accepted prefix. `compact` keeps a
chosen subset of freshly written rows (the accepted path through a draft tree): the rows
that move are gathered through `kernels.dispatch` (the KV-compaction kernel where doctor
allowed it, MLX's gather elsewhere), then written into place. On the CPU backend they are
moved in the buffer itself, through numpy: MLX's write into a buffer its own gather still
reads copies the whole buffer, every layer (~4 ms a step for the demo at 400 rows).

A sliding-window layer (Gemma 3's local layers, Mistral 7B v0.1, Phi-3) never reads keys
more than its window behind the newest row, so its cache drops them (`WindowedKVCache`):
on a long chat five of every six Gemma 3 layers hold a few thousand rows, not all of
them. It keeps REWIND_ROWS more than the window, so a Regenerate or an Edit of the last
turns still reuses the cache; trimming further back than that (`floor`) is refused, and
the session reads such a prompt again from the start (`usable_length`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from kernels import dispatch
from kernels.noise import cpu_backend

# rows a windowed cache keeps beyond its window: a Regenerate or an Edit this close to the
# end reuses the cache (a chat reply rarely runs longer)
REWIND_ROWS = 2048
# rows dropped at once: each drop copies the rows kept, so not every step
DROP_ROWS = 1024


@runtime_checkable
class KVCache(Protocol):
    """What an attention layer needs from its cache."""

    offset: int
    # the absolute position of the first row `update_and_fetch` returns (0 unless the
    # cache dropped rows out of a sliding window's reach)
    base: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append `keys`/`values` (B, kv_heads, L, head_dim); return the rows held, from
        position `base` on."""
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
        self.base = 0  # a plain cache holds every row from position 0

    @property
    def floor(self) -> int:
        """The shortest length this cache can be trimmed to and go on from (0: any)."""
        return self.floor_at(self.base)

    def floor_at(self, base: int) -> int:
        """`floor` for rows held from position `base` on (a parked copy's, too)."""
        return 0

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
        start = self.offset - self.base  # buffer rows, not positions
        end = start + L
        if end > self.capacity:
            self._grow(keys, values, end)
        assert self.keys is not None and self.values is not None
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.offset += L
        return self.keys[..., :end, :], self.values[..., :end, :]

    def trim(self, length: int) -> None:
        if length < 0 or length > self.offset:
            raise ValueError(f"cannot trim a cache of {self.offset} rows to {length}")
        if length == 0:
            self.base = 0
        elif length < self.floor:
            raise ValueError(f"cannot trim a windowed cache to {length} rows: it dropped the "
                             f"rows before {self.base} and goes on from {self.floor} or later")
        self.offset = length

    def compact(self, start: int, keep: Sequence[int]) -> None:
        keep = list(keep)
        if self.keys is None or not keep:
            self.trim(start)
            return
        if start < self.floor or min(keep) < 0 or start + max(keep) >= self.offset:
            raise ValueError(f"cannot keep rows {keep} after row {start} of a cache of "
                             f"{self.offset} rows")
        assert self.values is not None
        moved = rows_in_place(keep)  # a chain's prefix moves nothing at all
        first = start - self.base  # buffer rows, not positions
        end = first + len(keep)
        if moved < len(keep):
            rows = [first + i for i in keep[moved:]]
            if not move_rows_on_host(self.keys, self.values, rows, first + moved):
                # gathered into a separate buffer first, so no row is overwritten before
                # it is read
                k, v = dispatch.gather_kv_rows(self.keys, self.values, rows)
                self.keys[..., first + moved : end, :] = k
                self.values[..., first + moved : end, :] = v
        self.offset = start + len(keep)

    @property
    def state(self) -> tuple[mx.array, mx.array] | None:
        """The live rows, for `mx.eval` after a step."""
        if self.keys is None or self.values is None:
            return None
        return self.keys, self.values


class WindowedKVCache(PreallocatedKVCache):
    """The cache of a layer that attends over the last `window` positions only: rows out
    of every future row's reach, and REWIND_ROWS past that, are dropped DROP_ROWS at a
    time (one copy of the rows kept)."""

    def __init__(self, window: int, chunk: int = 256, rewind: int | None = None) -> None:
        super().__init__(chunk)
        if window < 1:
            raise ValueError(f"a sliding window must be at least 1 position, got {window}")
        self.window = window
        self.rewind = REWIND_ROWS if rewind is None else rewind

    def floor_at(self, base: int) -> int:
        # a row at position p reads keys from p - window + 1: the first row after a trim
        # to `length` must find them all held
        return 0 if base == 0 else base + self.window - 1

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._drop_front()
        return super().update_and_fetch(keys, values)

    def _drop_front(self) -> None:
        """Drop the rows no pass from here on, nor a trim back REWIND_ROWS, can need: the
        buffers become a view of the rows kept, which the write that follows outgrows into
        a buffer of its own (`_grow`, one copy)."""
        keep_from = self.offset - (self.window - 1) - self.rewind
        if keep_from - self.base < DROP_ROWS or self.keys is None or self.values is None:
            return
        first, used = keep_from - self.base, self.offset - self.base
        self.keys = self.keys[..., first:used, :]
        self.values = self.values[..., first:used, :]
        self.base = keep_from


def rows_in_place(keep: Sequence[int]) -> int:
    """How many leading kept rows are already where they belong (keep[i] == i)."""
    n = 0
    while n < len(keep) and keep[n] == n:
        n += 1
    return n


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` have in common: how much of a cache holding `a`
    a prompt `b` can reuse.

    Whole prefixes are compared in C first: a drafter's commit asks this every drafting
    step about contexts that almost always agree, and the loop below takes ~70 us over
    1,500 ids (the slices' compare ~6)."""
    n, limit = 0, min(len(a), len(b))
    if isinstance(a, list | tuple) and type(a) is type(b) and a[:limit] == b[:limit]:
        return limit
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def make_caches(n_layers: int, chunk: int = 256,
                windows: Sequence[int | None] | None = None) -> list[PreallocatedKVCache]:
    """One cache per decoder layer; `windows[i]`: layer i's sliding window (None: none)."""
    windows = windows if windows is not None else [None] * n_layers
    if len(windows) != n_layers:
        raise ValueError(f"{len(windows)} windows for {n_layers} layers")
    return [PreallocatedKVCache(chunk) if w is None else WindowedKVCache(w, chunk)
            for w in windows]


def model_caches(model, chunk: int = 256) -> list[PreallocatedKVCache]:
    """One cache per layer of `model`, windowed where its layers slide a window."""
    window = getattr(getattr(model, "args", None), "layer_window", None)
    windows = [window(i) for i in range(model.n_layers)] if window is not None else None
    return make_caches(model.n_layers, chunk, windows)


def usable_length(caches: Sequence[KVCache], length: int,
                  bases: Sequence[int] | None = None) -> int:
    """`length` where every cache can be trimmed to it and go on, else 0 (read it all
    again): a windowed cache cannot go back past its `floor`. `bases`: judge the caches
    as holding rows from these positions instead (a parked copy of them)."""
    bases = bases if bases is not None else [getattr(c, "base", 0) for c in caches]
    floors = [c.floor_at(b) if hasattr(c, "floor_at") else 0
              for c, b in zip(caches, bases, strict=True)]
    return length if all(length >= f for f in floors) else 0


def cache_length(caches: Sequence[KVCache]) -> int:
    """The committed length of a per-layer cache list (all layers agree)."""
    return caches[0].offset if caches else 0


def trim_caches(caches: Sequence[KVCache], length: int) -> None:
    for c in caches:
        c.trim(length)


HOST_DTYPES = (mx.float32, mx.float16)  # buffer dtypes numpy can view


def move_rows_on_host(keys: mx.array, values: mx.array, rows: Sequence[int], to: int) -> bool:
    """Copy buffer rows `rows` of keys and values to rows to, to + 1, ... in place, through
    numpy views of MLX's own buffers (evaluated first); False, doing nothing, off the CPU
    backend or for a dtype numpy lacks. Only the cache's fresh rows (a pass's, past every
    committed one) are written: no other array holds them."""
    if not cpu_backend() or keys.dtype not in HOST_DTYPES or values.dtype not in HOST_DTYPES:
        return False
    mx.eval(keys, values)
    for buffer in (keys, values):
        view = np.asarray(buffer)
        view[..., to : to + len(rows), :] = view[..., list(rows), :]
    return True


def compact_caches(caches: Sequence[KVCache], start: int, keep: Sequence[int]) -> None:
    for c in caches:
        c.compact(start, keep)
