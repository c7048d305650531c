"""The small-batch quantized matmul's reference, and the packing the kernel assumes.

`unpack` decodes MLX's affine packing exactly as kernels/qmm.metal does (value j of a
uint32 at bits [bits*j, bits*(j+1)), w = scale * q + bias per group); if MLX packed
differently, the kernel would be wrong and this test would say so here, without a Mac.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernels import qmm


def unpack(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int,
           bits: int) -> np.ndarray:
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    q = (w[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)  # (N, packs, per)
    q = q.reshape(w.shape[0], -1).astype(np.float64)  # (N, K)
    scale = np.repeat(scales.astype(np.float64), group_size, axis=1)
    bias = np.repeat(biases.astype(np.float64), group_size, axis=1)
    return scale * q + bias


def quantized(n: int, k: int, group_size: int, bits: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    dense = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.1)
    return mx.quantize(dense, group_size=group_size, bits=bits)


CASES = [(rows, gs, bits) for rows in (1, 2, 5, 8, 16) for gs in (32, 64) for bits in (4, 8)]


@pytest.mark.parametrize(("rows", "group_size", "bits"), CASES)
def test_reference_is_dequantize_then_matmul(rows: int, group_size: int, bits: int) -> None:
    n, k = 48, 320
    w, scales, biases = quantized(n, k, group_size, bits, seed=rows)
    x = mx.array(np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32))
    dense = unpack(np.array(w), np.array(scales), np.array(biases), group_size, bits)
    want = np.array(x).astype(np.float64) @ dense.T
    got = np.array(qmm.reference(x, w, scales, biases, group_size, bits))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    builtin = np.array(qmm.builtin(x, w, scales, biases, group_size, bits))
    np.testing.assert_allclose(builtin, want, rtol=1e-4, atol=1e-4)


def test_unpack_is_a_real_check() -> None:
    """Negative control: the same check rejects a wrong layout (nibbles swapped)."""
    w, scales, biases = quantized(8, 64, 32, 4)
    dense = unpack(np.array(w), np.array(scales), np.array(biases), 32, 4)
    swapped = np.array(w)
    swapped = ((swapped & 0x0F0F0F0F) << 4) | ((swapped >> 4) & 0x0F0F0F0F)
    wrong = unpack(swapped, np.array(scales), np.array(biases), 32, 4)
    assert not np.allclose(wrong, dense, atol=1e-4)
    np.testing.assert_allclose(
        np.array(mx.dequantize(w, scales, biases, group_size=32, bits=4)), dense, atol=1e-6)


def test_batched_rows_keep_their_shape() -> None:
    w, scales, biases = quantized(16, 128, 64, 4)
    x = mx.ones((1, 3, 128))
    assert qmm.matmul(x, w, scales, biases, 64, 4).shape == (1, 3, 16)


def _inputs(rows=4, n=64, k=256, group_size=64, bits=4, dtype=mx.float16):
    w, scales, biases = quantized(n, k, group_size, bits)
    x = mx.ones((rows, k), dtype=dtype)
    return x, w, scales.astype(dtype), biases.astype(dtype)


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"rows": 17}, "more than 16 rows"),
    ({"rows": 1}, "one row (MLX's qmv is the right kernel)"),
    ({"dtype": mx.bfloat16}, "bfloat16 activations"),
    ({"n": 60}, "output channels not a multiple of 8"),
])
def test_inputs_the_kernel_does_not_cover_take_mlxs_matmul(kwargs, why) -> None:
    x, w, scales, biases = _inputs(**kwargs)
    assert not qmm.covers(x, w, scales, biases, 64, 4), why
    out = qmm.matmul(x, w, scales, biases, 64, 4, kernel_widths=set(range(1, 33)))
    want = qmm.builtin(x, w, scales, biases, 64, 4)
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)),
                                  np.array(want.astype(mx.float32)))


def test_odd_group_sizes_and_bits_are_not_covered() -> None:
    w, scales, biases = quantized(64, 256, 128, 4)
    x = mx.ones((4, 256))
    assert not qmm.covers(x, w, scales, biases, 128, 4)
    w3, s3, b3 = quantized(64, 256, 64, 3)
    assert not qmm.covers(x, w3, s3, b3, 64, 3)
    x, w, scales, biases = _inputs()
    assert qmm.covers(x, w, scales, biases, 64, 4)  # control: a covered case


def test_quantized_decoder_layers_go_through_the_dispatcher() -> None:
    """nn.quantize turns the decoder's Linear into its QuantizedLinear, whose product is
    `kernels.dispatch.quantized_matmul` (here: MLX's, as no kernel is allowed)."""
    import mlx.nn as nn

    from engine.models.decoder import Linear, QuantizedLinear

    holder = nn.Sequential(Linear(128, 32, bias=True))
    nn.quantize(holder, group_size=64, bits=4)
    layer = holder.layers[0]
    assert type(layer) is QuantizedLinear and isinstance(layer, nn.QuantizedLinear)
    x = mx.array(np.random.default_rng(0).standard_normal((1, 5, 128)).astype(np.float32))
    want = nn.QuantizedLinear.__call__(layer, x)
    np.testing.assert_array_equal(np.array(layer(x)), np.array(want))
