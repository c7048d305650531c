"""KV compaction through the dispatcher equals the gather `cache.compact` did before it.

`old_compact` is the previous `PreallocatedKVCache.compact` written out (gather every kept
row, write rows start..end); `moved` is the same in numpy. The cache now moves only rows
not already in place, through `kernels.dispatch` (on a Mac with the kernel switched on, see
tests/kernels/test_on_metal.py; MLX's gather elsewhere) or, on the CPU backend for the
dtypes numpy has, in place through numpy (bfloat16 here still takes the gather). Buffers must be identical bit for bit.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import PreallocatedKVCache
from engine.tree import kept_rows
from engine.tuning import EXTRA_NODES, K_MAX
from kernels import kv_compact

DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def old_compact(keys: mx.array, values: mx.array, start: int,
                keep: list[int]) -> tuple[mx.array, mx.array]:
    """The compaction before the dispatcher existed (on copies of the buffers)."""
    keys, values = mx.array(keys), mx.array(values)
    idx = mx.array([start + i for i in keep])
    end = start + len(keep)
    keys[..., start:end, :] = keys[..., idx, :]
    values[..., start:end, :] = values[..., idx, :]
    return keys, values


def moved(buffer: np.ndarray, start: int, keep: list[int]) -> np.ndarray:
    out = buffer.copy()
    out[..., start : start + len(keep), :] = buffer[..., [start + i for i in keep], :]
    return out


def as_np(a: mx.array) -> np.ndarray:
    """Exact bits: bfloat16 has no numpy dtype, so compare it as float32 (lossless)."""
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


def filled_cache(rng: random.Random, dtype: mx.Dtype, head_dim: int, committed: int,
                 written: int, heads: int = 2) -> PreallocatedKVCache:
    cache = PreallocatedKVCache(chunk=rng.choice((8, 32, 256)))
    for n in (committed, written):
        shape = (1, heads, n, head_dim)
        k = mx.random.normal(shape, key=mx.random.key(rng.randrange(2**31))).astype(dtype)
        v = mx.random.normal(shape, key=mx.random.key(rng.randrange(2**31))).astype(dtype)
        cache.update_and_fetch(k, v)
    return cache


def check_compaction(cache: PreallocatedKVCache, start: int, keep: list[int]) -> None:
    assert cache.keys is not None and cache.values is not None
    before_k, before_v = as_np(cache.keys), as_np(cache.values)
    want_k, want_v = old_compact(cache.keys, cache.values, start, keep)
    # on the CPU backend compaction moves rows in the buffer itself (`move_rows_on_host`):
    # a copy still to be computed from it must be computed first (the engine holds none)
    mx.eval(want_k, want_v)
    cache.compact(start, keep)
    assert cache.offset == start + len(keep)
    for got, want, before in ((cache.keys, want_k, before_k), (cache.values, want_v, before_v)):
        np.testing.assert_array_equal(as_np(got), as_np(want))  # the old code's buffer
        np.testing.assert_array_equal(as_np(got), moved(before, start, keep))


def tree_keep(rng: random.Random, n_nodes: int, depth: int) -> list[int]:
    """An accepted path through a tree of `n_nodes` nodes (node indices increase along it)."""
    path = sorted(rng.sample(range(n_nodes), depth))
    return kept_rows(path)


def random_tree_case(seed: int) -> None:
    """One random tree's accepted path, compacted and checked (also run on Metal)."""
    rng = random.Random(seed)
    n_nodes = rng.randrange(1, K_MAX + EXTRA_NODES + 1)
    keep = tree_keep(rng, n_nodes, rng.randrange(0, min(n_nodes, K_MAX) + 1))
    committed = rng.randrange(1, 40)
    cache = filled_cache(rng, DTYPES[seed % 3], rng.choice((64, 72, 128)), committed,
                         1 + n_nodes)
    check_compaction(cache, committed, keep)


def largest_tree_case(dtype: mx.Dtype) -> None:
    """K_MAX deep, K_MAX + EXTRA_NODES nodes: 24 rows written, the 16-row path kept ends
    at the last node (also run on Metal)."""
    rng = random.Random(1)
    n_nodes = K_MAX + EXTRA_NODES
    path = [*sorted(rng.sample(range(n_nodes - 1), K_MAX - 1)), n_nodes - 1]
    keep = kept_rows(path)
    assert len(keep) == K_MAX + 1 == kv_compact.MAX_ROWS and keep[-1] == n_nodes
    check_compaction(filled_cache(rng, dtype, 64, 30, 1 + n_nodes), 30, keep)


@pytest.mark.parametrize("seed", range(24))
def test_random_tree_paths_equal_the_old_gather(seed: int) -> None:
    random_tree_case(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_largest_tree_equals_the_old_gather(dtype: mx.Dtype) -> None:
    largest_tree_case(dtype)


@pytest.mark.parametrize(("keep", "why"), [
    ([0], "the newest token alone (nothing accepted)"),
    ([5], "one row that moves"),
    ([0, 1, 2, 3], "a chain's prefix: nothing moves"),
    ([2, 3, 4, 5], "a contiguous run that moves"),
    ([0, 1, 4, 7], "in place, then moved"),
    ([3, 1], "rows out of order"),
])
def test_special_keeps_equal_the_old_gather(keep: list[int], why: str) -> None:
    rng = random.Random(len(keep))
    check_compaction(filled_cache(rng, mx.float16, 64, 9, 8), 9, keep)


def test_a_compaction_can_fail() -> None:
    """Negative control: the check notices a cache that kept the wrong row."""
    rng = random.Random(0)
    cache = filled_cache(rng, mx.float32, 64, 4, 6)
    before = as_np(cache.keys)
    cache.compact(4, [0, 2, 3])
    assert not np.array_equal(as_np(cache.keys), moved(before, 4, [0, 2, 4]))


def test_the_longest_accepted_path_fits_the_kernel() -> None:
    assert kv_compact.MAX_ROWS >= K_MAX + 1


def _pair(shape=(1, 2, 32, 64), v_shape=None, dtype=mx.float16):
    keys = mx.arange(int(np.prod(shape))).reshape(shape).astype(dtype)
    values = mx.arange(int(np.prod(v_shape or shape))).reshape(v_shape or shape).astype(dtype)
    return keys, values


@pytest.mark.parametrize(("kwargs", "n_rows", "why"), [
    ({"shape": (1, 2, 32, 72)}, 4, "head dim 72"),
    ({"v_shape": (1, 2, 32, 128)}, 4, "values wider than keys"),
    ({}, kv_compact.MAX_ROWS + 1, "a path longer than the kernel's rows"),
    ({"dtype": mx.int8}, 4, "a quantized (int8) cache"),
    ({"shape": (2, 32, 64)}, 4, "a 3-D buffer"),
])
def test_inputs_the_kernel_does_not_cover_take_the_reference(kwargs, n_rows: int,
                                                             why: str) -> None:
    keys, values = _pair(**kwargs)
    assert not kv_compact.covers(keys, values, n_rows), why
    rows = list(range(3, 3 + n_rows))
    # Every width allowed: were it not for `covers`, this would launch the kernel (and
    # fail here, where there is no Metal).
    got = kv_compact.gather(keys, values, rows, kernel_widths=set(range(1, 64)))
    want = kv_compact.reference(keys, values, mx.array(rows, dtype=mx.int32))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_covered_inputs_are_covered() -> None:
    """Control for the test above."""
    for dtype in kv_compact.KERNEL_DTYPES:
        for head_dim in kv_compact.HEAD_DIMS:
            keys, values = _pair((1, 8, 64, head_dim), dtype=dtype)
            assert kv_compact.covers(keys, values, 1)
            assert kv_compact.covers(keys, values, kv_compact.MAX_ROWS)
