"""View ▸ Zoom In / Zoom Out / Actual Size: the size of the conversation's text.

Chat apps and browsers let ⌘+ / ⌘- / ⌘0 (Ctrl on Linux) grow the text being read without
touching the system's font settings. Only what is read and typed scales — the messages, the
comparison's panes and the composer — so the side panel's numbers keep their layout.
"""

from __future__ import annotations

from PySide6.QtGui import QFont

LEVELS = (0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0)  # factors of the app's font size
DEFAULT = 1.0


def step(current: float, direction: int) -> float:
    """The next level up (`direction` > 0) or down from `current`; the last one stays."""
    if direction > 0:
        return next((z for z in LEVELS if z > current + 1e-6), LEVELS[-1])
    return next((z for z in reversed(LEVELS) if z < current - 1e-6), LEVELS[0])


def nearest(value: object) -> float:
    """A saved level read back (a string in QSettings' INI files), or the default."""
    try:
        factor = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return DEFAULT
    return min(LEVELS, key=lambda z: abs(z - factor))


def scaled(base: QFont, factor: float) -> QFont:
    font = QFont(base)
    font.setPointSizeF(base.pointSizeF() * factor)
    return font
