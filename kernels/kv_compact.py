"""KV compaction for tree verification: the accepted path's rows gathered in one dispatch.

A tree's verify pass writes one cache row per node after the committed rows; on acceptance
the path's rows move to start, start + 1, ... (`engine/cache.py`). In MLX ops that is a
gather of the keys, a gather of the values and one slice update each, per layer. The kernel
gathers a layer's keys and values together (one dispatch instead of two); the cache then
writes them into place with the same slice updates as before.

Why not in place: an `mx.fast.metal_kernel` output is always a fresh buffer (MLX never
aliases one with an input), so a kernel that wrote rows into the cache itself would have to
copy the whole buffer. Gathering into a separate buffer also means no row is overwritten
before it is read, whatever the order of the kept rows. Whether one dispatch per layer wins
is a property of the device, so the dispatcher uses it only at the row counts where
`understudy doctor` measured a win.

Covered (`covers`): 4-D (B, kv_heads, capacity, head_dim) float32/float16/bfloat16 keys and
values of the same shape, head_dim in HEAD_DIMS, 1 <= rows <= MAX_ROWS. Anything else
(other head dims, keys and values of different widths, quantized caches, longer paths)
takes the reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

import mlx.core as mx

from kernels.source import metal_available, metal_source

MAX_ROWS = 16  # the longest accepted path: 15 drafts (engine.tuning.K_MAX) + the newest token
HEAD_DIMS = (64, 80, 96, 128, 256)
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
MAX_ELEMENTS = 2**32  # the kernel's offsets are 32-bit


def reference(keys: mx.array, values: mx.array, rows: mx.array) -> tuple[mx.array, mx.array]:
    """The rows `rows` of keys and values, in that order: the gather `cache.compact` did in
    MLX ops before the kernel existed.

    Shapes:
        keys, values: (B, kv_heads, capacity, head_dim); rows: (N,) int32 absolute rows.
        Returns (B, kv_heads, N, head_dim) each, in the input dtypes.
    """
    return keys[..., rows, :], values[..., rows, :]


def covers(keys: mx.array, values: mx.array, n_rows: int) -> bool:
    """True when the kernel was written for these shapes and dtypes (else: reference)."""
    if keys.ndim != 4 or values.shape != keys.shape or values.dtype != keys.dtype:
        return False
    return (keys.dtype in KERNEL_DTYPES and keys.shape[-1] in HEAD_DIMS
            and 1 <= n_rows <= MAX_ROWS and keys.size < MAX_ELEMENTS)


@lru_cache(maxsize=1)
def make_kernel() -> object:
    """The `metal_kernel` object; constructible anywhere, runs only on Metal. MLX compiles
    one variant per (dtype, head dim, whether `rows` is small enough for constant memory)."""
    return mx.fast.metal_kernel(
        name="understudy_kv_compact",
        input_names=["keys", "values", "rows"],
        output_names=["keys_out", "values_out"],
        source=metal_source("kv_compact"),
    )


def build() -> object | None:
    """The kernel, or None where Metal is unavailable."""
    return make_kernel() if metal_available() else None


def run_kernel(keys: mx.array, values: mx.array, rows: mx.array,
               verbose: bool = False) -> tuple[mx.array, mx.array]:
    """The kernel; same contract as `reference`, only for inputs `covers` accepts. Rows
    must lie inside the buffer (the cache checks them against its written rows)."""
    n = rows.shape[0]
    assert covers(keys, values, n)
    B, H, _, D = keys.shape
    out_shape = (B, H, n, D)
    k_out, v_out = make_kernel()(  # type: ignore[operator]
        inputs=[keys, values, rows.astype(mx.int32)],
        template=[("T", keys.dtype), ("D", D)],
        grid=(D, n, B * H),
        threadgroup=(D, 1, 1),
        output_shapes=[out_shape, out_shape],
        output_dtypes=[keys.dtype, keys.dtype],
        verbose=verbose,
    )
    return k_out, v_out


def gather(keys: mx.array, values: mx.array, rows: Sequence[int],
           kernel_widths: Iterable[int] = frozenset()) -> tuple[mx.array, mx.array]:
    """The kernel at the row counts in `kernel_widths` (where it passed and won on this
    device) when it covers the input; the reference everywhere else."""
    idx = mx.array(list(rows), dtype=mx.int32)
    if kernel_widths and len(rows) in kernel_widths and covers(keys, values, len(rows)):
        return run_kernel(keys, values, idx)
    return reference(keys, values, idx)
