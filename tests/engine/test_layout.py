"""Choosing the weight layout of the CPU policy (`engine.layout`): the decision's margin,
the user's pin, the probe's sample of the model, and a real probe on a real model."""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import pytest

from engine.layout import (
    ENV,
    MARGIN,
    PROBE_BYTES,
    LayoutProbe,
    choose_layout,
    measure,
    probe_groups,
    requested_layout,
)
from engine.loading import load_weights
from engine.models.decoder import product_modules
from tests.engine.test_models import is_column_major
from tests.fixtures.tiny_models import write_tiny_model


def test_row_major_must_win_clearly_to_replace_column_major() -> None:
    assert LayoutProbe(row_s=0.049, column_s=0.065).layout == "row"  # Cooperlake's kernels
    assert LayoutProbe(row_s=0.065, column_s=0.052).layout == "column"  # Haswell's
    # inside the margin a noisy probe must not flip the layout: the default stays
    assert LayoutProbe(row_s=1.0, column_s=1.0 + MARGIN * 0.9).layout == "column"
    assert LayoutProbe(row_s=1.0, column_s=1.0 + MARGIN * 1.1).layout == "row"


def test_the_pin_overrides_the_probe_and_a_bad_one_is_named(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    weights = [mx.zeros((8, 8))]
    for value, want in (("row", "row"), ("Column", "column"), (" auto ", None), ("", None)):
        monkeypatch.setenv(ENV, value)
        assert requested_layout() == want
    monkeypatch.setenv(ENV, "row")
    assert choose_layout(weights) == "row"
    monkeypatch.setenv(ENV, "diagonal")
    with caplog.at_level(logging.WARNING, logger="engine.layout"):
        assert requested_layout() is None
    assert "diagonal" in caplog.text and ENV in caplog.text


def test_the_probe_samples_the_whole_model_as_a_pass_weighs_it() -> None:
    mats = [mx.zeros((1024, 1024)) for _ in range(100)]  # 4 MiB each, 400 MiB in all
    head = mx.zeros((50_000, 512))  # an output layer: 98 MiB in one matrix
    layers, out = probe_groups([*mats, head])
    picked = layers.matrices
    assert PROBE_BYTES <= sum(m.nbytes for m in picked) < 2 * PROBE_BYTES
    assert picked[0] is mats[0] and picked[-1] is mats[-4]  # every 4th: from end to end
    assert layers.scale * sum(m.nbytes for m in picked) == sum(m.nbytes for m in mats)
    # the output layer is timed on a slice of its rows that stands for all of them
    [piece] = out.matrices
    assert piece.shape[1] == 512 and piece.nbytes <= PROBE_BYTES // 2
    assert out.scale * piece.shape[0] == 50_000
    small = probe_groups(mats[:3])
    assert len(small) == 1 and small[0].matrices == tuple(mats[:3]) and small[0].scale == 1


def test_a_real_probe_times_both_layouts_on_a_models_own_matrices(tmp_path: Path,
                                                                  monkeypatch) -> None:
    monkeypatch.setenv(ENV, "column")
    model, _ = load_weights(write_tiny_model(tmp_path / "tiny"), backend="cpu")
    monkeypatch.delenv(ENV)
    rows = [mx.contiguous(m.weight) for m in product_modules(model)]
    probe = measure(probe_groups(rows))
    assert 0 < probe.row_s < 1 and 0 < probe.column_s < 1
    assert probe.layout in ("row", "column")
    # the probe's copies are its own: the model's matrices keep the layout they were given
    assert all(is_column_major(m.weight) for m in product_modules(model))
    assert not any(is_column_major(r) for r in rows)


def test_a_busy_machine_cuts_the_probe_short_but_still_gets_a_verdict(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.layout as layout

    sweeps = []
    real_perf = layout.time.perf_counter
    monkeypatch.setattr(layout, "PROBE_BUDGET_S", 0.0)
    monkeypatch.setattr(layout.time, "perf_counter", lambda: sweeps.append(1) or real_perf())
    probe = measure(probe_groups([mx.ones((64, 64)) for _ in range(3)]))
    assert 0 < probe.row_s < 1 and 0 < probe.column_s < 1  # one repeat each, not none
    # one repeat: 2 layouts x 2 widths x 1 group, two clock reads each, plus start and check
    assert len(sweeps) == 2 * 2 * 2 + 2
