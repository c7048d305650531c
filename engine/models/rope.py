"""Rotary position embeddings read from a cos/sin table: the CPU backend's RoPE.

Why: on MLX's CPU backend `mx.fast.rope` works out every angle's cos and sin again on each
call: ~45-55 us for one row's nine query heads on the demo model, twice a layer, about 8% of
a one-row pass. Read from a table and applied with a few elementwise ops it takes ~20 us, and
a 512-row prompt chunk's ~260 us instead of ~650. On a GPU the fused kernel stays
(`engine.models.decoder.Attention._rope` picks).

The table is computed in float64 on the host and held in float32, so its angles are exact
to float32 at every position; it grows on demand (doubling) up to the highest position a
pass has asked for, and one table serves every layer with the same dimensions and base.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import mlx.core as mx
import numpy as np

MIN_ROWS = 4096  # the first table's positions: a short chat never grows it


class RopeTable:
    """cos/sin of every (position, frequency) pair for HF-style ("rotate half") RoPE."""

    def __init__(self, dims: int, inverse_periods: tuple[float, ...], scale: float = 1.0) -> None:
        if dims % 2 or len(inverse_periods) != dims // 2:
            raise ValueError(f"RoPE over {dims} dims needs {dims // 2} frequencies, "
                             f"got {len(inverse_periods)}")
        self.dims = dims
        self._inverse = np.asarray(inverse_periods, dtype=np.float64)
        # LongRoPE's magnitude correction, baked into cos and sin: the rotated dims come
        # out this many times longer, as if they were scaled before the rotation
        self.scale = scale
        # host-made arrays (no stream): any thread's passes may read them
        self._cos: mx.array | None = None
        self._sin: mx.array | None = None
        self._lock = threading.Lock()

    @property
    def rows(self) -> int:
        """Positions the table holds now."""
        return 0 if self._cos is None else int(self._cos.shape[0])

    def apply(self, x: mx.array, offset: int, positions: mx.array | None = None) -> mx.array:
        """x (B, heads, L, dims) rotated to positions offset.., or to `positions` (L,):
        a draft tree's rows, each at most offset + L - 1 (committed length + depth)."""
        length = x.shape[-2]
        cos, sin = self._span(offset + length)
        if positions is None:
            cos, sin = cos[offset:offset + length], sin[offset:offset + length]
        else:
            cos, sin = cos[positions], sin[positions]
        if cos.dtype != x.dtype:
            cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        half = self.dims // 2
        rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    def _span(self, end: int) -> tuple[mx.array, mx.array]:
        """The table, grown to hold positions below `end`."""
        with self._lock:
            if end > self.rows:
                size = max(end, 2 * self.rows, MIN_ROWS)
                angles = np.arange(size, dtype=np.float64)[:, None] * self._inverse[None, :]
                angles = np.concatenate([angles, angles], axis=-1)
                self._cos = mx.array((self.scale * np.cos(angles)).astype(np.float32))
                self._sin = mx.array((self.scale * np.sin(angles)).astype(np.float32))
            assert self._cos is not None and self._sin is not None
            return self._cos, self._sin


def rope_table(dims: int, base: float | None, freqs: mx.array | None,
               scale: float = 1.0) -> RopeTable:
    """The shared table for `mx.fast.rope`'s parameters: `base` (frequency i is
    base^(-2i/dims)), or `freqs`, the periods over 2 pi (frequency i is 1 / freqs[i]);
    `scale` multiplies the rotated values (LongRoPE's)."""
    if freqs is not None:
        periods = tuple(float(f) for f in np.asarray(freqs, dtype=np.float64))
        return _shared(dims, periods, None, scale)
    if base is None:
        raise ValueError("RoPE needs a base or explicit frequencies")
    return _shared(dims, None, float(base), scale)


@lru_cache(maxsize=16)
def _shared(dims: int, periods: tuple[float, ...] | None, base: float | None,
            scale: float) -> RopeTable:
    if periods is not None:
        inverse = tuple(1.0 / p for p in periods)
    else:
        assert base is not None
        inverse = tuple(base ** (-i / dims) for i in range(0, dims, 2))
    return RopeTable(dims, inverse, scale)
