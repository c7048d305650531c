"""The gated MLP's activation, act(gate) * up, with a CPU path that does not run MLX's `exp`.

MLX's CPU backend computes `sigmoid`, `exp` and `tanh` one element at a time (~14 ns an
element here, where a multiply takes under 1): SiLU over a 16-row verify pass's 16 x 1,536
gate took ~350 us a layer, 11 ms of a ~70 ms demo pass, more than the three products
around it. numpy's are vectorized, so every inference pass on the CPU
(`attention.inference_pass`: decode steps, verify passes, prompt chunks) takes the
activation on the host. Reading the gate back runs the pass up to there and takes the
overlap out of a pipelined plain step, yet even one-row steps gained: over the bundled
bench prompts plain decoding went from 30.4 to 35.4 tok/s, speculative from 39.9 to 45.1,
prompts from 355 to 474 tok/s; a 16-row demo pass from ~69 to ~60 ms. Every width takes
the same path, so a verify pass's rows see the numbers a one-token step sees. Training
keeps the MLX path: no gradient flows through numpy.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.models.attention import on_host

GELU_C = math.sqrt(2.0 / math.pi)


def gated(gate: mx.array, up: mx.array, gelu: bool = False) -> mx.array:
    """act(gate) * up: SiLU, or the tanh approximation of GELU (Gemma's) where `gelu`."""
    if not on_host(gate, minimum=1):
        return (nn.gelu_approx(gate) if gelu else nn.silu(gate)) * up
    g, u = np.asarray(gate), np.asarray(up)
    if gelu:
        act = 0.5 * g * (1.0 + np.tanh(GELU_C * (g + 0.044715 * g**3)))
    else:
        with np.errstate(over="ignore"):  # exp(-g) overflows to inf for g < -88: silu -0
            act = g / (1.0 + np.exp(-g))
    return mx.array(act * u)
