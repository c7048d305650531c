"""Scaled dot-product attention, with a CPU path that does not spend the pass in `exp`.

On Apple GPUs (and CUDA) `mx.fast.scaled_dot_product_attention` is a fused kernel and is
used as is. On MLX's CPU backend it falls back to plain ops, and there the softmax's `exp`
runs one element at a time: ~20 ns an element here, ~4 ms of a layer's attention for 11
rows over 2,048 keys, 30 layers a pass. A long chat's verify passes went to attention, not
to the weights. The CPU path here computes the same softmax with `exp` built from
multiply-adds that MLX's compiler fuses and vectorizes: 2^y = 2^floor(y) * 2^frac(y), the
first by writing the float's exponent bits, the second by a polynomial accurate to ~3e-9
(float32 rounding dominates, as it does in `mx.exp`). Masked keys still weigh exactly 0,
and gradients flow (training runs the same attention).

It also folds grouped query heads into rows: the query heads that share a key/value head
are one matrix product with that head's keys, not a broadcast copy of them.

An inference pass (`inference_pass`: a prompt's chunk, a decode step, a verify pass, a
training job's data passes) takes its softmax on the host instead, with numpy's vectorized
`exp`, and a causal one its mask too, on the last L keys only. The fused softmax is only
compiled on the main thread (the app's and the server's engine threads run it op by op),
and either way it cost more than its share: at 8,000 cached keys a 64-row prompt chunk's
softmax took 45-60 ms a layer against 3 ms for each of its two matrix products, numpy's
~5; a 17-row verify pass's 15-19 ms, numpy's ~1. Reading the scores back runs the pass up
to that layer there and then, which takes most of the overlap out of pipelined decoding
(`steps.pipelined_step`), and still plain decoding on the engine thread went from 18.9 to
22.4 tok/s at 1,000 cached tokens and from 17.0 to 21.1 at 2,000; whole verify passes got
5-12% cheaper at 400 and 15-28% at 2,300. Training keeps the MLX path: no gradient flows
through numpy, so only passes marked as inference take the host's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
import numpy as np

from kernels import host_attention
from kernels.compile import compiled_on_main_thread
from kernels.noise import cpu_backend

LOG2E = 1.4426950408889634
# 2^f on [0, 1]: a least-squares fit on Chebyshev nodes (relative error 2.6e-9), lowest
# power first
EXP2_POLY = (1.0000000025868891, 0.6931469286930303, 0.2402305020449802,
             0.05548042632584226, 0.009684580452206756, 0.0012387821480084604,
             0.00021877504766075584)
# below this many scores the plain softmax wins: the fused one is two compiled calls
FAST_SOFTMAX_MIN = 8192
_inference_pass: ContextVar[bool] = ContextVar("inference_pass", default=False)


@contextmanager
def inference_pass() -> Iterator[None]:
    """Mark the passes built inside as inference (no gradient will flow through them), so
    their softmaxes may run on the host."""
    token = _inference_pass.set(True)
    try:
        yield
    finally:
        _inference_pass.reset(token)


def _exp2_parts(scores: mx.array) -> tuple[mx.array, mx.array]:
    """2^frac(y) and the float32 bits of 2^floor(y), for y = (scores - row max) * log2(e).

    y is clamped at -127, whose bits are those of 0.0: a masked (-inf) score weighs
    exactly nothing, and so does anything below 2^-126."""
    y = mx.maximum((scores - mx.max(scores, axis=-1, keepdims=True)) * LOG2E, -127.0)
    n = mx.floor(y)
    f = y - n
    p = EXP2_POLY[-1]
    for c in reversed(EXP2_POLY[:-1]):
        p = p * f + c
    return p, (n.astype(mx.int32) + 127) << 23


def _normalize(p: mx.array, scale: mx.array) -> mx.array:
    e = p * scale
    return e / mx.sum(e, axis=-1, keepdims=True)


# shapeless: the key count grows every step, and a retrace per shape would cost more than
# it saves; the bit view cannot be traced shapeless, so it sits between the two. Compiled
# on the main thread only (`kernels.compile`): elsewhere the same ops run one by one,
# the same numbers at about half the speed
_exp2_parts_compiled = compiled_on_main_thread(_exp2_parts, shapeless=True)
_normalize_compiled = compiled_on_main_thread(_normalize, shapeless=True)


@mx.custom_function
def _fast_softmax(scores: mx.array) -> mx.array:
    p, bits = _exp2_parts_compiled(scores)
    return _normalize_compiled(p, bits.view(mx.float32))


@_fast_softmax.vjp
def _fast_softmax_vjp(primals: list[mx.array], cotangent: mx.array,
                      output: mx.array) -> tuple[mx.array]:
    """Softmax's own gradient, from its output alone. Differentiating through the
    polynomial instead kept a dozen score-sized intermediates per attention alive for the
    backward pass: most of a training step's memory when the head was unrolled 3 steps."""
    return (output * (cotangent - mx.sum(cotangent * output, axis=-1, keepdims=True)),)


def host_softmax(scores: mx.array, causal: int = 0) -> mx.array:
    """Softmax over the last axis of float32 scores, computed by numpy (it evaluates them).

    `causal` = L: the scores' rows are groups of L queries at the last L of S positions, and
    query i sees keys up to S - L + i. Only the last L keys are masked, in place of a
    masking pass over every score."""
    a = np.asarray(scores)
    if not causal:
        e = np.exp(a - a.max(axis=-1, keepdims=True))
    else:
        L, S = causal, a.shape[-1]
        grid = a.reshape(*a.shape[:-2], -1, L, S)  # (..., groups, L, S)
        past = S - L
        tail = grid[..., past:] + np.triu(np.full((L, L), -np.inf, np.float32), 1)
        top = tail.max(axis=-1, keepdims=True)
        if past:
            top = np.maximum(top, grid[..., :past].max(axis=-1, keepdims=True))
        e = np.empty(grid.shape, np.float32)
        np.exp(np.subtract(grid[..., :past], top, out=e[..., :past]), out=e[..., :past])
        np.exp(tail - top, out=e[..., past:])
        e = e.reshape(a.shape)
    e /= e.sum(axis=-1, keepdims=True)
    return mx.array(e)


def on_host(values: mx.array, minimum: int = FAST_SOFTMAX_MIN) -> bool:
    """Whether an inference pass's elementwise work on `values` (a softmax's scores, an
    activation's inputs: `models.activations`) runs on the host: float32 on the CPU
    backend, at least `minimum` of them."""
    return (values.size >= minimum and values.dtype == mx.float32 and _inference_pass.get()
            and cpu_backend())


def softmax_last(scores: mx.array) -> mx.array:
    """Softmax over the last axis, as `mx.softmax(..., precise=True)` computes it for float32
    scores (within a few float32 ulps), without `mx.exp` on large inputs."""
    if scores.size < FAST_SOFTMAX_MIN or scores.dtype != mx.float32:
        return mx.softmax(scores, axis=-1, precise=True)
    if on_host(scores):
        return host_softmax(scores)
    return _fast_softmax(scores)


def _grouped(mask: mx.array, n_kv: int, group: int) -> mx.array:
    """A mask broadcastable to (B, heads, L, S) reshaped to (B, kv heads, group, L, S)."""
    while mask.ndim < 4:
        mask = mask[None]
    b, h, rows, keys = mask.shape
    if h == 1:
        return mask.reshape(b, 1, 1, rows, keys)
    return mask.reshape(b, n_kv, group, rows, keys)


def cpu_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                  mask: mx.array | str | None = None) -> mx.array:
    """q (B, heads, L, d), k/v (B, kv heads, S, d) -> (B, heads, L, d). `mask`: None,
    "causal" (row r sees keys up to S - L + r), a boolean mask (True = attend) or an additive
    one, broadcastable to (B, heads, L, S)."""
    if on_host(q, 0):
        fused = host_attention.run(q, k, v, scale, mask)
        if fused is not None:
            return fused
    B, H, L, d = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    group = H // n_kv
    scores = (q * scale).reshape(B, n_kv, group * L, d) @ k.swapaxes(-1, -2)
    if isinstance(mask, str) and mask == "causal" and on_host(scores):
        weights = host_softmax(scores, causal=L)  # masked there, on the last L keys only
    else:
        if mask is not None:
            if isinstance(mask, str):
                if mask != "causal":
                    raise ValueError(f"unknown attention mask {mask!r}")
                mask = mx.arange(S)[None, :] <= (S - L + mx.arange(L))[:, None]
            grid = scores.reshape(B, n_kv, group, L, S)
            m = _grouped(mask, n_kv, group)
            grid = mx.where(m, grid, -mx.inf) if m.dtype == mx.bool_ else grid + m
            scores = grid.reshape(B, n_kv, group * L, S)
        weights = softmax_last(scores)
    return (weights.astype(v.dtype) @ v).reshape(B, H, L, d)


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
              mask: mx.array | str | None = None) -> mx.array:
    """The fused kernel on a GPU, `cpu_attention` on the CPU backend."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return cpu_attention(q, k, v, scale, mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def slide_window(k: mx.array, v: mx.array, mask: mx.array | str | None, n_new: int,
                 positions: mx.array | None, window: int, base: int = 0,
                 ) -> tuple[mx.array, mx.array, mx.array | str | None]:
    """Keys, values and mask of a sliding-window layer (Gemma's local layers): a row at
    position p sees keys at positions above p - window only.

    k/v hold the keys from position `base` on (a windowed cache dropped the ones before:
    `engine.cache.WindowedKVCache`), the pass's own `n_new` rows last; those rows sit at
    `positions` (a draft tree's) or consecutively after the committed keys, the first
    right after them either way, so committed keys more than `window` before it are out of
    every row's reach and are cut off before the product: a long chat's local layers
    attend over about `window` keys, not all of them. A one-row pass needs no mask after
    that cut; a wider one gets the window folded into its own (causal, or a tree's
    ancestors), whose columns are positions from 0.
    """
    n_keys = k.shape[2]
    if base == 0 and n_keys <= window:  # no row sits `window` past any key
        return k, v, mask
    end = base + n_keys
    start = end - n_new
    lo = max(base, start - window + 1)
    k, v = k[..., lo - base:, :], v[..., lo - base:, :]
    if n_new == 1 and not isinstance(mask, mx.array):
        return k, v, None
    rows = (positions.astype(mx.int32) if positions is not None
            else start + mx.arange(n_new, dtype=mx.int32))
    keys = mx.concatenate([mx.arange(lo, start, dtype=mx.int32), rows])
    near = keys[None, :] > (rows[:, None] - window)
    if mask is None:
        return k, v, near
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        causal = (lo + mx.arange(end - lo))[None, :] <= (start + mx.arange(n_new))[:, None]
        return k, v, near & causal
    cut = mask[..., lo:]
    if cut.dtype == mx.bool_:
        return k, v, cut & near
    return k, v, mx.where(near, cut, -mx.inf)
