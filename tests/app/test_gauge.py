"""The sparkline's scale: a first burst or an outlier must not flatten the rest of the line."""

from __future__ import annotations

import pytest
from PySide6.QtGui import QColor

from app.ui.gauge import Sparkline, sparkline_top

# What the speculative pane saw: a burst over a sliver of decode time, then a steady pace.
BURST_THEN_STEADY = [480.0, 160.0, 60.0] + [20.0 + (i % 5) for i in range(60)]


def test_the_scale_ignores_the_first_burst_and_clips_outliers() -> None:
    assert max(BURST_THEN_STEADY) == 480.0  # what the old max-scaling drew at full height
    assert sparkline_top(BURST_THEN_STEADY) == pytest.approx(24.0)
    spiked = BURST_THEN_STEADY[:30] + [900.0] + BURST_THEN_STEADY[30:]
    assert sparkline_top(spiked) == pytest.approx(24.0)  # one outlier is clipped, not the scale
    assert sparkline_top([0.0, 0.0, 0.0]) == 1.0
    assert sparkline_top([]) == 1.0
    assert sparkline_top([5.0, 7.0]) == pytest.approx(6.9)  # too few to skip any


def _filled_fraction(line: Sparkline, x: int) -> float:
    """How high the shaded area under the line reaches in pixel column `x` (0..1)."""
    image = line.grab().toImage()
    background = image.pixelColor(x, 0)
    bottom = image.height() - 5  # the baseline is drawn 4 px above the bottom edge
    top = next((y for y in range(image.height()) if image.pixelColor(x, y) != background),
               bottom)
    return (bottom - top) / (bottom - 4)


def test_the_steady_part_fills_the_height(qtbot, screenshots_dir) -> None:
    line = Sparkline()
    qtbot.addWidget(line)
    line.resize(200, 40)
    line.set_values(BURST_THEN_STEADY)
    line.show()
    qtbot.waitExposed(line)
    assert line.palette().color(line.backgroundRole()) != QColor(0, 0, 0, 0)
    # three quarters along the reply the pace is ~22 tok/s: most of the height, not a sliver
    assert _filled_fraction(line, 150) > 0.6
    line.grab().save(str(screenshots_dir / "sparkline_burst_then_steady.png"))


def test_a_long_reply_draws_a_point_per_pixel_not_per_step(qtbot) -> None:
    """Thousands of steps are averaged down to the widget's width, so a repaint costs the
    same at the end of a long reply as at its start; a short reply is drawn as it is."""
    line = Sparkline()
    qtbot.addWidget(line)
    line.resize(204, 40)  # 200 pixels to draw in
    steady = [20.0 + (i % 5) for i in range(6_000)]
    line.set_values(steady)
    points = line.points()
    assert len(points) == 200
    assert points == pytest.approx([22.0] * 200, abs=0.01)  # 30 steps a point: their mean
    line.set_values(BURST_THEN_STEADY)
    assert line.points() == BURST_THEN_STEADY
