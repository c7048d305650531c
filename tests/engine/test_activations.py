"""The gated MLP activation's host path against MLX's own ops."""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.models import activations
from engine.models.activations import gated
from engine.models.attention import inference_pass


def _inputs(rows: int, width: int = 1536, seed: int = 0) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    gate = mx.random.normal((1, rows, width)) * 4
    # the tails: where exp(-g) overflows, and where it underflows
    gate[0, 0, :4] = mx.array([-200.0, -88.5, 88.5, 200.0])
    return gate, mx.random.normal((1, rows, width))


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu-tanh"])
def test_the_host_activation_matches_mlx(gelu: bool) -> None:
    gate, up = _inputs(16)
    mlx_act = nn.gelu_approx if gelu else nn.silu
    expected = np.array(mlx_act(gate) * up)
    with inference_pass(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning escapes to the user's log
        got = gated(gate, up, gelu)
    got = np.array(got)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6)
    assert got[0, 0, 0] == 0.0 and got[0, 0, 3] == pytest.approx(200.0 * float(up[0, 0, 3]))


def test_the_host_path_is_taken_in_inference_passes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = activations.np.exp
    monkeypatch.setattr(activations.np, "exp", lambda x: calls.append(x.shape) or real(x))
    gate, up = _inputs(3)
    outside = gated(gate, up)
    assert calls == []
    with inference_pass():
        inside = gated(gate, up)
    assert calls == [(1, 3, 1536)]
    np.testing.assert_allclose(np.array(inside), np.array(outside), rtol=2e-6, atol=1e-6)


def test_training_keeps_a_gradient() -> None:
    gate, up = _inputs(2, 64)
    grad = mx.grad(lambda g: gated(g, up).sum())(gate)
    expected = mx.grad(lambda g: (nn.silu(g) * up).sum())(gate)
    assert mx.array_equal(grad, expected)


def test_a_row_gets_the_same_numbers_whatever_the_pass_width() -> None:
    """A verify pass's rows equal the one-token step's: numpy's vectorized exp does not
    change with where a value falls in the array (a 1,536-wide row, a 17-row pass)."""
    gate, up = _inputs(17)
    with inference_pass():
        wide = np.array(gated(gate, up))
        rows = [np.array(gated(gate[:, i:i + 1], up[:, i:i + 1])) for i in range(17)]
    assert all(np.array_equal(wide[:, i:i + 1], row) for i, row in enumerate(rows))
