"""Which memory layout of its weight matrices makes this machine's CPU passes fastest.

A layer computes x @ W.T. Held row-major (as a checkpoint stores it), W.T reaches BLAS as a
transposed operand; held column-major (`store_column_major`), it reaches BLAS as stored. Which
of the two OpenBLAS runs faster depends on the kernels it picked for the CPU: with its
Haswell kernels a 1-row pass of the demo took ~1.25x as long row-major, and with its
Cooperlake (SkylakeX-family) kernels the reverse, 65 ms column-major against 49 row-major
(the whole pass; 16 rows 93 against 87). So the CPU policy measures the model's own
products both ways when it loads, instead of fixing one layout for every machine.

The probe multiplies matrices from across the model (enough bytes to stream from memory, as
a pass does, not from cache; `probe_groups`) at 1 and 4 rows, alternating the layouts, and
keeps each layout's best estimate of a pass's products (fewer repeats on a machine too
busy to finish them in `PROBE_BUDGET_S`). Column-major stays unless row-major is clearly
faster (`MARGIN`): on a machine where the two are close, a noisy probe must not flip the
layout from one load to the next (each layout has its own cost table:
`calibration.weight_form`). `UNDERSTUDY_WEIGHT_LAYOUT=row|column` skips the probe.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

log = logging.getLogger(__name__)

ENV = "UNDERSTUDY_WEIGHT_LAYOUT"
LAYOUTS = ("row", "column")
# bytes of weights a probe streams per sweep: past any CPU's last-level cache, as a pass is
PROBE_BYTES = 96 * 2**20
PROBE_ROWS = (1, 4)  # a plain step and a typical verify pass
PROBE_REPEATS = 3
# row-major must be this much faster to replace the default
MARGIN = 0.10
# the probe stops repeating past this: on a machine busy enough for OpenBLAS's threads to
# contend (two spinning processes on 2 cores made a sweep ~40x slower, 3.5 s), a full probe
# would add half a minute to loading, for a verdict that noise decides anyway
PROBE_BUDGET_S = 1.5


@dataclass(frozen=True)
class LayoutProbe:
    """Seconds of a pass's products at every PROBE_ROWS width (estimated from the probe's
    sample), in each layout."""

    row_s: float
    column_s: float

    @property
    def layout(self) -> str:
        return "row" if self.row_s * (1 + MARGIN) < self.column_s else "column"


def requested_layout() -> str | None:
    """The layout the user pinned with UNDERSTUDY_WEIGHT_LAYOUT, or None (measure)."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value or value == "auto":
        return None
    if value not in LAYOUTS:
        log.warning("%s=%r is not one of row, column, auto: measuring instead", ENV, value)
        return None
    return value


@dataclass(frozen=True)
class ProbeGroup:
    """Matrices timed together, standing for `scale` times their bytes of the model."""

    matrices: tuple[mx.array, ...]
    scale: float


def probe_groups(matrices: Sequence[mx.array]) -> list[ProbeGroup]:
    """A sample of the model's products that costs what a pass does, per byte.

    The layers' matrices: every k-th, PROBE_BYTES of them, scaled up to all of theirs. A
    matrix too big to sample that way (an output layer: 21% of the demo's bytes in one
    matrix, and the product where the layouts differ most) is timed on a slice of its rows,
    scaled up to its size: taking it whole would let it dominate the probe, and copying a
    large vocabulary's output layer costs seconds."""
    cap = PROBE_BYTES // 2
    big = [m for m in matrices if m.nbytes > cap]
    rest = [m for m in matrices if m.nbytes <= cap]
    groups = []
    if rest:
        total = sum(m.nbytes for m in rest)
        sample = rest[::max(1, int(total // PROBE_BYTES))]
        groups.append(ProbeGroup(tuple(sample), total / sum(m.nbytes for m in sample)))
    for m in big:
        rows = max(1, cap // (m.shape[1] * m.itemsize))
        groups.append(ProbeGroup((m[:rows],), m.shape[0] / rows))
    return groups


def measure(groups: Sequence[ProbeGroup]) -> LayoutProbe:
    """Time x @ W.T over the groups' matrices (row-major, as loaded) and their column-major
    copies (which live only as long as the probe); each layout's estimate of a pass's
    products is its groups' times, scaled."""
    row = [list(g.matrices) for g in groups]
    column = [[mx.contiguous(w.T).T for w in ws] for ws in row]
    mx.eval(column)
    widths = {w.shape[1] for ws in row for w in ws}
    inputs = {(n, d): mx.random.normal((n, d), key=mx.random.key(n))
              for n in PROBE_ROWS for d in widths}
    mx.eval(list(inputs.values()))

    def sweep(layout: list[list[mx.array]]) -> float:
        """Seconds for one pass's worth of products. Widths outermost: between a group's
        two readings the others stream through the cache, as the layers of a pass do."""
        total = 0.0
        for n in PROBE_ROWS:
            for group, weights in zip(groups, layout, strict=True):
                start = time.perf_counter()
                mx.eval([inputs[n, w.shape[1]] @ w.T for w in weights])
                total += (time.perf_counter() - start) * group.scale
        return total

    # warm-up, one product per group and layout: first-call costs must not favour either
    mx.eval([inputs[1, ws[0].shape[1]] @ ws[0].T for layout in (row, column) for ws in layout])
    start = time.perf_counter()
    best = {"row": float("inf"), "column": float("inf")}
    for _ in range(PROBE_REPEATS):
        best["row"] = min(best["row"], sweep(row))
        best["column"] = min(best["column"], sweep(column))
        if time.perf_counter() - start > PROBE_BUDGET_S:
            break
    return LayoutProbe(row_s=best["row"], column_s=best["column"])


def choose_layout(matrices: Sequence[mx.array]) -> str:
    """"row" or "column" for these (row-major, float) matrices on this machine."""
    pinned = requested_layout()
    if pinned is not None:
        return pinned
    probe = measure(probe_groups(matrices))
    log.info("weight layout: %s (a pass's products at 1 and 4 rows: %.1f ms row-major, "
             "%.1f ms column-major)",
             probe.layout, probe.row_s * 1e3, probe.column_s * 1e3)
    return probe.layout
