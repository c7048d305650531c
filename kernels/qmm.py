"""Small-batch quantized matmul: dequantize each weight group once, use it for every row.

A verify pass multiplies 2-16 rows by every quantized weight. MLX's `quantized_matmul`
re-reads each weight group per row at these widths (on an M3 Ultra, 4-bit, 2/4/8 rows cost
1.83x/3.26x/6.12x one row); this kernel reads and dequantizes each packed word once and
accumulates it into all M rows. Whether it actually wins is a property of the device, so
the dispatcher uses it only at the widths where `understudy doctor` measured a win.

Covered (`covers`): affine 4- and 8-bit, group 32 or 64, float32/float16 activations and
scales, 2 <= M <= MAX_ROWS rows, output channels a multiple of CHANNELS_PER_TG. Anything else
(bfloat16, odd group sizes, wider batches) takes MLX's `quantized_matmul`.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from math import prod

import mlx.core as mx

from kernels.source import metal_available, metal_source

MAX_ROWS = 16
BITS = (4, 8)
GROUP_SIZES = (32, 64)
ROWS_PER_SIMDGROUP = 4
SIMDGROUPS = 2
CHANNELS_PER_TG = ROWS_PER_SIMDGROUP * SIMDGROUPS
KERNEL_DTYPES = (mx.float32, mx.float16)


def reference(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
              group_size: int, bits: int) -> mx.array:
    """x @ dequantize(w).T in plain MLX ops, summed in float32: the contract the kernel is
    checked against.

    Shapes:
        x: (..., K); w: (N, K * bits / 32) uint32; scales, biases: (N, K / group_size).
        Returns (..., N) in x's dtype.
    """
    dense = mx.dequantize(w.astype(mx.uint32), scales.astype(mx.float32),
                          biases.astype(mx.float32), group_size=group_size, bits=bits)
    return (x.astype(mx.float32) @ dense.T).astype(x.dtype)  # float32 sums, as the kernel's


def builtin(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
            group_size: int, bits: int) -> mx.array:
    """MLX's own quantized matmul (what runs wherever the kernel does not)."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True,
                               group_size=group_size, bits=bits)


def covers(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
           group_size: int, bits: int) -> bool:
    """True when the kernel was written for these shapes, dtypes and quantization."""
    if bits not in BITS or group_size not in GROUP_SIZES or w.dtype != mx.uint32:
        return False
    if x.dtype not in KERNEL_DTYPES or scales.dtype != x.dtype or biases.dtype != x.dtype:
        return False
    if x.ndim < 1 or w.ndim != 2:
        return False
    k = x.shape[-1]
    n = w.shape[0]
    rows = prod(x.shape[:-1])
    return (2 <= rows <= MAX_ROWS and k % group_size == 0 and w.shape[1] * 32 == k * bits
            and scales.shape == (n, k // group_size) and biases.shape == scales.shape
            and n % CHANNELS_PER_TG == 0)


@lru_cache(maxsize=1)
def make_kernel() -> object:
    """The `metal_kernel` object; constructible anywhere, runs only on Metal."""
    return mx.fast.metal_kernel(
        name="understudy_qmm_small",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=metal_source("qmm"),
    )


def build() -> object | None:
    """The kernel, or None where Metal is unavailable."""
    return make_kernel() if metal_available() else None


def run_kernel(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array,
               group_size: int, bits: int, verbose: bool = False) -> mx.array:
    """The kernel; same contract as `reference`, only for inputs `covers` accepts."""
    assert covers(x, w, scales, biases, group_size, bits)
    kernel = make_kernel()
    k = x.shape[-1]
    n = w.shape[0]
    rows = prod(x.shape[:-1])
    (y,) = kernel(  # type: ignore[operator]
        inputs=[x.reshape(rows, k), w, scales, biases],
        template=[("T", x.dtype), ("M", rows), ("K", k), ("N", n), ("BITS", bits),
                  ("GS", group_size), ("ROWS", ROWS_PER_SIMDGROUP),
                  ("SIMDGROUPS", SIMDGROUPS)],
        grid=(n // CHANNELS_PER_TG * 32 * SIMDGROUPS, 1, 1),
        threadgroup=(32 * SIMDGROUPS, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
        verbose=verbose,
    )
    return y.reshape(*x.shape[:-1], n)


def matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
           bits: int, kernel_widths: Iterable[int] = frozenset()) -> mx.array:
    """The kernel at the row counts in `kernel_widths` (where it passed and won on this
    device) when it covers the input; MLX's `quantized_matmul` everywhere else."""
    if kernel_widths and prod(x.shape[:-1]) in kernel_widths and covers(
            x, w, scales, biases, group_size, bits):
        return run_kernel(x, w, scales, biases, group_size, bits)
    return builtin(x, w, scales, biases, group_size, bits)
