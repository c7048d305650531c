"""The fused CPU attention (kernels/cpu/attention.c through `kernels.host_attention`).

It must give MLX's attention (to float32 rounding) for every mask the engine passes:
causal, a draft tree's ancestors, a sliding window; and a row must not depend on the rows
beside it: a verify pass's row equals the 1-token pass at its position bit for bit, and a
tree node's row equals the pass made once its path is committed (the lossless rules
compare those). Shapes it does not take are left to MLX (None).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from engine.models.attention import cpu_attention, inference_pass
from kernels import host_attention

pytestmark = pytest.mark.skipif(host_attention.kernel() is None,
                                reason="the native library is not preloaded here")


def _qkv(seed: int, heads: int, kv_heads: int, rows: int, keys: int, dim: int,
         spare: int = 24) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
    """q, and k/v as a cache hands them out: views of longer buffers (K, V)."""
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((1, heads, rows, dim)).astype(np.float32))
    K = mx.array(rng.standard_normal((1, kv_heads, keys + spare, dim)).astype(np.float32))
    V = mx.array(rng.standard_normal((1, kv_heads, keys + spare, dim)).astype(np.float32))
    return q, K[..., :keys, :], V[..., :keys, :], K, V


def _tree_mask(seed: int, rows: int, keys: int) -> np.ndarray:
    """Committed keys visible to all; row 0 the newest token, each later row a node whose
    parent is an earlier row (its ancestors' keys visible, and its own)."""
    rng = np.random.default_rng(seed)
    past = keys - rows
    mask = np.zeros((rows, keys), bool)
    mask[:, :past] = True
    for r in range(rows):
        if r:
            mask[r, past:] = mask[int(rng.integers(0, r)), past:]
        mask[r, past + r] = True
    return mask


def test_the_library_preloaded_by_the_launcher_carries_the_kernel() -> None:
    assert "libunderstudyblas" in os.environ.get("LD_PRELOAD", "")
    assert host_attention.kernel() is not None


@pytest.mark.parametrize(("heads", "kv_heads", "rows", "keys", "dim"), [
    (9, 3, 1, 300, 64), (9, 3, 13, 700, 64), (8, 8, 5, 37, 128), (4, 2, 3, 9, 256),
    (6, 2, 7, 50, 80), (16, 4, 64, 130, 64), (3, 1, 2, 2, 8), (9, 3, 256, 600, 64)])
def test_matches_mlx_for_causal_tree_and_window_masks(heads: int, kv_heads: int, rows: int,
                                                      keys: int, dim: int) -> None:
    q, k, v, _, _ = _qkv(rows * keys + dim, heads, kv_heads, rows, keys, dim)
    scale = dim ** -0.5
    window = np.tril(np.ones((rows, keys), bool), keys - rows)
    window &= ~np.tril(np.ones((rows, keys), bool), keys - rows - 6)  # the last 6 keys
    masks: list[mx.array | str] = ["causal", mx.array(_tree_mask(dim, rows, keys)),
                                   mx.array(window)]
    for mask in masks:
        want = cpu_attention(q, k, v, scale, mask)  # outside a pass: MLX's ops
        got = host_attention.run(q, k, v, scale, mask)
        assert got is not None
        assert got.shape == want.shape
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=2e-6)


def test_inference_passes_take_it() -> None:
    q, k, v, _, _ = _qkv(1, 9, 3, 4, 200, 64)
    calls: list[int] = []
    real = host_attention.run

    def counted(*args: object) -> mx.array | None:
        out = real(*args)  # type: ignore[arg-type]
        calls.append(out is not None)
        return out

    host_attention.run, before = counted, host_attention.run
    try:
        with inference_pass():
            inside = cpu_attention(q, k, v, 0.125, "causal")
        outside = cpu_attention(q, k, v, 0.125, "causal")
    finally:
        host_attention.run = before
    assert calls == [True]  # training (outside a pass) keeps MLX's ops for the gradient
    np.testing.assert_allclose(np.array(inside), np.array(outside), atol=2e-6)


def test_a_verify_row_equals_the_one_token_pass_at_its_position_bit_for_bit() -> None:
    rows, keys = 13, 411
    q, k, v, K, V = _qkv(7, 9, 3, rows, keys, 64)
    wide = np.array(host_attention.run(q, k, v, 0.125, "causal"))
    for r in range(rows):
        n = keys - rows + r + 1
        one = host_attention.run(q[:, :, r : r + 1], K[..., :n, :], V[..., :n, :], 0.125, None)
        assert one is not None
        assert np.array_equal(wide[0, :, r], np.array(one)[0, :, 0]), f"row {r}"


def test_a_tree_row_equals_the_pass_after_its_path_is_committed_bit_for_bit() -> None:
    """Node rows see the committed keys and their ancestors' keys, which sit apart in the
    pass; committed, the path's keys are contiguous. Same bits either way."""
    rows, keys = 9, 300
    q, k, v, K, V = _qkv(11, 9, 3, rows, keys, 64)
    mask = _tree_mask(5, rows, keys)
    tree = np.array(host_attention.run(q, k, v, 0.125, mx.array(mask)))
    ks, vs = np.array(k), np.array(v)
    for r in range(rows):
        seen = np.flatnonzero(mask[r])  # committed keys, then the path to row r
        one = host_attention.run(q[:, :, r : r + 1], mx.array(ks[:, :, seen]),
                                 mx.array(vs[:, :, seen]), 0.125, None)
        assert one is not None
        assert np.array_equal(tree[0, :, r], np.array(one)[0, :, 0]), f"row {r}"
    # negative control: a committed key 0.1% off changes the row (the check can fail)
    ks[0, 0, 0] *= np.float32(1.001)
    seen = np.flatnonzero(mask[0])
    off = host_attention.run(q[:, :, :1], mx.array(ks[:, :, seen]), mx.array(vs[:, :, seen]),
                             0.125, None)
    assert not np.array_equal(tree[0, :3, 0], np.array(off)[0, :3, 0])


def test_a_row_that_sees_no_key_is_zero() -> None:
    q, k, v, _, _ = _qkv(3, 4, 2, 3, 10, 64)
    mask = np.ones((3, 10), bool)
    mask[1] = False
    out = np.array(host_attention.run(q, k, v, 0.125, mx.array(mask)))
    assert (out[0, :, 1] == 0).all()
    assert np.abs(out[0, :, 0]).sum() > 0


def test_shapes_it_does_not_take_are_left_to_mlx() -> None:
    q, k, v, _, _ = _qkv(2, 4, 2, 3, 20, 64)
    assert host_attention.run(q, k, v, 0.125, mx.zeros((3, 20))) is None  # additive mask
    assert host_attention.run(q.astype(mx.bfloat16), k.astype(mx.bfloat16),
                              v.astype(mx.bfloat16), 0.125, "causal") is None
    per_head = mx.array(np.ones((1, 4, 3, 20), bool))
    assert host_attention.run(q, k, v, 0.125, per_head) is None  # one mask per head
    assert host_attention.run(q[..., :60], k[..., :60], v[..., :60], 0.125, "causal") is None
    rows = host_attention.MAX_ROWS
    long_q, lk, lv, _, _ = _qkv(2, 4, 2, rows + 1, rows + 8, 8)
    assert host_attention.run(long_q, lk, lv, 0.125, "causal") is None
    assert host_attention.run(long_q[:, :, 1:], lk, lv, 0.125, "causal") is not None
    assert host_attention.run(q, k, v, 0.125, None) is None  # several rows, no mask
    assert host_attention.run(q, k, v, 0.125, "causal") is not None


def test_short_lived_threads_get_their_own_buffers_and_the_same_rows() -> None:
    """Each thread grows its own scratch (freed as it exits): threads that come and go,
    over more keys each time, compute what the main thread does."""
    import threading

    q, k, v, _, _ = _qkv(9, 9, 3, 5, 3000, 64)
    want = np.array(host_attention.run(q, k, v, 0.125, "causal"))
    got: list[np.ndarray] = []

    def work(keys: int) -> None:
        out = host_attention.run(q, k[..., :keys, :], v[..., :keys, :], 0.125, "causal")
        got.append(np.array(out))

    for keys in (100, 3000, 700, 3000):
        t = threading.Thread(target=work, args=(keys,))
        t.start()
        t.join()
    assert len(got) == 4
    assert np.array_equal(got[1], want) and np.array_equal(got[3], want)
    assert not np.array_equal(got[0], want)


def test_a_batch_with_a_mask_per_sequence_matches_mlx_and_each_sequence_alone() -> None:
    """Batched generation (a head's training data): left-padded sequences side by side,
    each with its own mask, as `training.data.read_positions` builds them."""
    B, rows, keys = 3, 4, 90
    rng = np.random.default_rng(4)
    q = mx.array(rng.standard_normal((B, 9, rows, 64)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, 3, keys, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, 3, keys, 64)).astype(np.float32))
    pads = (0, 7, 30)
    causal = np.tril(np.ones((rows, keys), bool), keys - rows)
    mask = np.stack([causal & (np.arange(keys) >= p)[None] for p in pads])[:, None]
    got = host_attention.run(q, k, v, 0.125, mx.array(mask))
    assert got is not None
    want = cpu_attention(q, k, v, 0.125, mx.array(mask))  # outside a pass: MLX's ops
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=2e-6)
    for b in range(B):
        alone = host_attention.run(q[b : b + 1], k[b : b + 1], v[b : b + 1], 0.125,
                                   mx.array(mask[b : b + 1]))
        assert np.array_equal(np.array(got)[b], np.array(alone)[0]), f"sequence {b}"
    shared = host_attention.run(q, k, v, 0.125, mx.array(causal))  # one mask for all
    np.testing.assert_allclose(np.array(shared),
                               np.array(cpu_attention(q, k, v, 0.125, "causal")), atol=2e-6)
