"""An inference pass's attention on the CPU backend in one native call (kernels/cpu/attention.c).

Why: MLX's CPU backend computes attention as two batched products with a softmax between
them, and on a handful of query rows against a few hundred keys its time
goes to the calls around the arithmetic: ~6 ms of a 31 ms 1-token pass of the demo at 400
cached tokens, 22-36 ms of a 13-16 row verify pass, far more than the arithmetic needs.
The kernel is built into the library `engine.few_rows` preloads, so it is here exactly
where that library is; elsewhere (another OS, no compiler, UNDERSTUDY_FEW_ROWS=0) `run`
answers None and MLX's ops serve, as before.

Every inference pass comes here, prompt chunks too (their causal rows skip the keys they
cannot see, where MLX's products compute every score: the demo read 1,000-token prompts
at ~580 tok/s, ~450 with MLX's attention for chunks over 64 rows); training keeps MLX's ops
for the gradient.
"""

from __future__ import annotations

import ctypes
import functools

import mlx.core as mx
import numpy as np

MAX_ROWS = 1024  # query positions per call (the CPU's prompt chunks are at most 256)
MAX_DIM = 512  # the kernel's largest head dimension (a multiple of 8)


class _Attention(ctypes.Structure):
    """The kernel's argument (attention.c's `Attention`); strides in floats."""

    _fields_ = [
        ("q", ctypes.c_void_p), ("q_batch", ctypes.c_long), ("q_head", ctypes.c_long),
        ("q_row", ctypes.c_long),
        ("k", ctypes.c_void_p), ("k_batch", ctypes.c_long), ("k_head", ctypes.c_long),
        ("k_row", ctypes.c_long),
        ("v", ctypes.c_void_p), ("v_batch", ctypes.c_long), ("v_head", ctypes.c_long),
        ("v_row", ctypes.c_long),
        ("out", ctypes.c_void_p), ("out_batch", ctypes.c_long), ("out_head", ctypes.c_long),
        ("out_row", ctypes.c_long),
        ("mask", ctypes.c_void_p), ("mask_batch", ctypes.c_long), ("mask_row", ctypes.c_long),
        ("batch", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
        ("rows", ctypes.c_int), ("keys", ctypes.c_int), ("dim", ctypes.c_int),
        ("scale", ctypes.c_float),
    ]


@functools.cache
def kernel() -> ctypes._CFuncPtr | None:
    """The preloaded library's `understudy_attention`, or None where it is not loaded."""
    try:
        fn = ctypes.CDLL(None).understudy_attention
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.POINTER(_Attention)]
    fn.restype = ctypes.c_int
    return fn


def _rows(a: np.ndarray) -> np.ndarray:
    """`a` (batch, heads, n, d) with its last axis contiguous (copied only where it is not)."""
    return a if a.strides[-1] == 4 else np.ascontiguousarray(a)


def _mask_bytes(mask: mx.array | str | None, batch: int, rows: int,
                keys: int) -> tuple[np.ndarray | None, int] | None:
    """The mask as (1 or batch, rows, keys) bytes and its batch stride (0: one mask for
    every sequence); (None, 0) for causal; None where the kernel cannot take it (an
    additive mask, one that differs per head, none at all over several rows)."""
    if isinstance(mask, str):
        return (None, 0) if mask == "causal" else None
    if mask is None:
        return (None, 0) if rows == 1 else None
    shape = mask.shape
    if mask.dtype != mx.bool_ or mask.ndim < 2 or shape[-2:] != (rows, keys):
        return None
    lead = (1,) * (4 - mask.ndim) + tuple(shape[:-2])  # (batch, heads), as broadcast
    if lead[1] != 1 or lead[0] not in (1, batch):
        return None
    n = lead[0]
    m = np.ascontiguousarray(np.asarray(mask).reshape(n, rows, keys)).view(np.uint8)
    return m, (rows * keys if n > 1 else 0)


def run(q: mx.array, k: mx.array, v: mx.array, scale: float,
        mask: mx.array | str | None) -> mx.array | None:
    """softmax(q k^T * scale) v for q (B, heads, L, d), k/v (B, kv heads, S, d), as
    `models.attention.cpu_attention` defines it; None where the kernel does not apply
    (the caller computes it with MLX). Evaluates its inputs."""
    fn = kernel()
    B, H, L, d = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    if (fn is None or L > MAX_ROWS or d % 8 or d > MAX_DIM or v.shape[-1] != d
            or k.shape[0] != B or v.shape[0] != B or H % n_kv or S < L
            or not q.dtype == k.dtype == v.dtype == mx.float32):
        return None
    masked = _mask_bytes(mask, B, L, S)
    if masked is None:
        return None
    m, m_batch = masked
    mx.eval(q, k, v)  # one wait for the layer's work so far, not one per array
    qn, kn, vn = _rows(np.asarray(q)), _rows(np.asarray(k)), _rows(np.asarray(v))
    out = np.empty((B, H, L, d), np.float32)
    args = _Attention(
        qn.ctypes.data, *(x // 4 for x in qn.strides[:3]),
        kn.ctypes.data, *(x // 4 for x in kn.strides[:3]),
        vn.ctypes.data, *(x // 4 for x in vn.strides[:3]),
        out.ctypes.data, H * L * d, L * d, d,
        None if m is None else m.ctypes.data, m_batch, S,
        B, H, n_kv, L, S, d, scale)
    status = fn(ctypes.byref(args))
    if status == 2:
        raise MemoryError(f"attention over {S} keys: out of memory for its scores")
    if status != 0:
        return None
    return mx.array(out)
