"""The live speed gauge: tokens/s, tokens per target pass, acceptance, and a sparkline.

Speculative decoding commits tokens in bursts (several accepted tokens per target pass), so
an instantaneous per-token rate would jump wildly. The headline number is the engine's
wall-time rate over the whole reply (`Stats.decode_tps`); the sparkline plots a rate over a
trailing window of at least `window_s` seconds of wall time, measured between step
boundaries, so a burst is averaged with the wait that preceded it. Even so the first steps
of a reply can read far above the rest (a burst over a sliver of decode time), so the
sparkline's full height is a high percentile of the later values (`sparkline_top`), and the
few values above it are clipped rather than flattening the whole line.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPalette, QPen
from PySide6.QtWidgets import QGridLayout, QLabel, QProgressBar, QSizePolicy, QVBoxLayout, QWidget

from app.ui.token_render import footer_text, stopped_reading
from engine.context_fit import dropped_note
from engine.events import Stats


@dataclass
class RateTracker:
    """Windowed tokens/s from (decode time, total tokens) samples taken at step ends."""

    window_s: float = 1.0
    _times: list[float] = field(default_factory=list)
    _totals: list[int] = field(default_factory=list)
    history: list[float] = field(default_factory=list)  # one windowed rate per step

    def reset(self) -> None:
        self._times.clear()
        self._totals.clear()
        self.history.clear()

    def add(self, t: float, total_tokens: int) -> float:
        """Record a step ending at decode time `t`; returns (and keeps) the windowed rate."""
        self._times.append(t)
        self._totals.append(total_tokens)
        rate = self.rate()
        self.history.append(rate)
        return rate

    def rate(self) -> float:
        """Tokens/s between the newest sample and the newest one at least a window older.

        Until a full window has passed, the span starts at time 0 (the start of decoding), so
        the rate is the plain average so far: never the size of one burst over its own time.
        """
        if not self._times:
            return 0.0
        t_now, n_now = self._times[-1], self._totals[-1]
        t_then, n_then = 0.0, 0
        for i in range(len(self._times) - 2, -1, -1):  # (no copy of the whole history)
            if t_now - self._times[i] >= self.window_s:
                t_then, n_then = self._times[i], self._totals[i]
                break
        span = t_now - t_then
        return (n_now - n_then) / span if span > 0 else 0.0


SPARK_SKIP = 3  # the first steps' rates are the least settled; they never set the scale
SPARK_PERCENTILE = 95  # values above this percentile are clipped to the top


def sparkline_top(values: Sequence[float], skip: int = SPARK_SKIP,
                  percentile: int = SPARK_PERCENTILE) -> float:
    """The value a sparkline draws at full height: robust to a first burst and outliers.

    The `percentile`-th percentile of the positive values after the first `skip` (of all
    of them while there are too few); 1.0 when none is positive.
    """
    body = [v for v in values[skip:] if v > 0] if len(values) > skip + 1 else []
    body = body or [v for v in values if v > 0]
    if not body:
        return 1.0
    if len(body) == 1:
        return body[0]
    return statistics.quantiles(body, n=100, method="inclusive")[percentile - 1]


def spark_points(values: Sequence[float], width: int) -> list[float]:
    """At most `width` values to draw: `values` themselves when they fit, else the mean
    of each of `width` consecutive runs of them. A reply of thousands of steps drew a
    point per step in a widget 200 pixels wide, and took its percentile over them all,
    at every step: the gauge's repaint grew with the reply."""
    n = len(values)
    width = max(2, width)
    if n <= width:
        return list(values)
    out = []
    for b in range(width):
        lo, hi = b * n // width, (b + 1) * n // width
        out.append(sum(values[lo:hi]) / (hi - lo))
    return out


class Sparkline(QWidget):
    """A small line chart of the recent tokens/s values, scaled by `sparkline_top`."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.values: list[float] = []
        self.setAccessibleName("Speed over the reply")  # a drawing: say what it shows
        self.setMinimumHeight(36)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(160, 40)

    def set_values(self, values: list[float]) -> None:
        self.values = list(values)
        summary = (f"tokens/s from {min(values):.1f} to {max(values):.1f}, now {values[-1]:.1f}"
                   if values else "")
        self.setAccessibleDescription(summary)
        self.setToolTip(summary)
        self.update()

    def points(self) -> list[float]:
        """The values the line is drawn through (`spark_points` at this width)."""
        return spark_points(self.values, int(self.width()) - 4)

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = QRectF(self.rect()).adjusted(2, 4, -2, -4)
        base = self.palette().color(QPalette.ColorRole.Mid)
        painter.setPen(QPen(base, 1))
        painter.drawLine(rect.bottomLeft(), rect.bottomRight())
        vals = self.points()
        if len(vals) < 2:
            return
        top = sparkline_top(vals)
        step = rect.width() / (len(vals) - 1)
        path = QPainterPath()
        for i, v in enumerate(vals):
            height = rect.height() * min(max(v, 0.0) / top, 1.0)
            point = QPointF(rect.left() + i * step, rect.bottom() - height)
            path.lineTo(point) if i else path.moveTo(point)
        accent = self.palette().color(QPalette.ColorRole.Highlight)
        fill = QPainterPath(path)
        fill.lineTo(rect.right(), rect.bottom())
        fill.lineTo(rect.left(), rect.bottom())
        fill.closeSubpath()
        shade = QColor(accent)
        shade.setAlpha(50)
        painter.fillPath(fill, shade)
        painter.setPen(QPen(accent, 1.6))
        painter.drawPath(path)


class GaugeWidget(QWidget):
    """Headline tokens/s with tau, acceptance, token count and a sparkline.

    A passive view: whoever owns the reply feeds it `reset`, `show_prompt_progress`,
    `show_stats` and `show_final` (the side panel and each comparison pane have one).
    """

    def __init__(self, title: str = "Speed", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.tracker = RateTracker()
        self.title = QLabel(title)
        self.title.setObjectName("gaugeTitle")
        self.rate_label = QLabel("— tok/s")
        self.rate_label.setObjectName("gaugeRate")
        self.tau_label = QLabel("—")
        self.accept_label = QLabel("—")
        self.tokens_label = QLabel("0")
        self.context_label = QLabel("—")
        self.prompt_label = QLabel("—")
        self.context_window = 0  # the model's, once known (`set_context_window`)
        self.sparkline = Sparkline()
        self.progress = QProgressBar()
        self.progress.setTextVisible(True)
        self.progress.setFormat("prompt %v / %m")
        self.progress.hide()

        grid = QGridLayout()
        grid.setContentsMargins(0, 0, 0, 0)
        for row, (name, label) in enumerate(
            (("tokens/pass", self.tau_label), ("accepted", self.accept_label),
             ("tokens", self.tokens_label), ("context", self.context_label),
             ("prompt read", self.prompt_label))
        ):
            caption = QLabel(name)
            caption.setObjectName("gaugeCaption")
            grid.addWidget(caption, row, 0)
            grid.addWidget(label, row, 1, Qt.AlignmentFlag.AlignRight)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addWidget(self.title)
        layout.addWidget(self.rate_label)
        layout.addWidget(self.sparkline)
        layout.addLayout(grid)
        layout.addWidget(self.progress)

    def reset(self) -> None:
        self.tracker.reset()
        self.sparkline.set_values([])
        self.rate_label.setText("— tok/s")
        self.tau_label.setText("—")
        self.accept_label.setText("—")
        self.tokens_label.setText("0")
        self.context_label.setText("—")
        self.context_label.setToolTip("")
        self.prompt_label.setText("—")
        self.prompt_label.setToolTip("")
        self.progress.hide()

    def set_context_window(self, tokens: int) -> None:
        """The loaded model's context window (0: unknown), which `context` is out of."""
        self.context_window = tokens

    def show_prompt_progress(self, done: int, total: int) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(done)
        self.progress.setVisible(done < total)

    def show_stats(self, stats: Stats) -> None:
        """Update from the totals after a step (never from one step alone)."""
        self.progress.hide()
        self.tracker.add(stats.decode_s, stats.generated_tokens)
        self.sparkline.set_values(self.tracker.history)
        self.rate_label.setText(f"{stats.decode_tps:.1f} tok/s")
        self.tau_label.setText(f"{stats.tau:.2f}")
        self.accept_label.setText(f"{stats.acceptance:.0%}" if stats.n_drafted else "—")
        self.tokens_label.setText(str(stats.generated_tokens))
        self._show_context(stats)
        self._show_prompt(stats)

    def _show_prompt(self, stats: Stats) -> None:
        """How long the prompt took to read: the wait before the first token. A prompt the
        cache already held (a follow-up, a conversation come back to) reads only its end."""
        if not stats.prompt_tokens:
            return
        self.prompt_label.setText(f"{stats.prompt_s:.2f} s")
        tip = (f"read {stats.prefilled_tokens:,} of the prompt's {stats.prompt_tokens:,} "
               f"tokens in {stats.prompt_s:.2f} s")
        if stopped_reading(stats):
            self.prompt_label.setToolTip(tip + ", then stopped")
            return
        if stats.cached_tokens:
            tip += f"; the other {stats.cached_tokens:,} were already in the cache"
        self.prompt_label.setToolTip(tip)

    def _show_context(self, stats: Stats) -> None:
        """How much of the context window the reply's prompt and text take."""
        used = stats.prompt_tokens + stats.generated_tokens
        window = self.context_window
        self.context_label.setText(f"{used:,} / {window:,}" if window else f"{used:,}")
        tip = "tokens the model reads for this reply: the prompt and the reply so far"
        if window:
            tip += f", of the {window:,} its context window holds"
        if stats.dropped_messages:
            tip += f"; {dropped_note(stats.dropped_messages)}"
        self.context_label.setToolTip(tip)

    def show_final(self, stats: Stats | None) -> None:
        """The reply's final totals (the message footer carries the same line)."""
        self.progress.hide()
        if stats is not None:
            self.rate_label.setText("— tok/s" if stopped_reading(stats)
                                    else f"{stats.decode_tps:.1f} tok/s")
            self.tau_label.setText(f"{stats.tau:.2f}")
            self.accept_label.setText(f"{stats.acceptance:.0%}" if stats.n_drafted else "—")
            self.tokens_label.setText(str(stats.generated_tokens))
            self._show_context(stats)
            self._show_prompt(stats)
            self.setToolTip(footer_text(stats))

    @property
    def rate_text(self) -> str:
        return self.rate_label.text()
