"""Light and dark: follow the system palette and say which one is showing.

Qt already gives each platform its palette (and on macOS switches it live); we only add a
small style sheet (`resources/app.qss`) written with `palette(...)` references so it
follows along, plus `resources/app-dark.qss` while the palette is dark (the error banner's
fixed colours, the Stop button's red), and a test of whether the current palette is dark,
which the token colours and code highlighting need.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject
from PySide6.QtGui import QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QWidget

from resources import resource_path


def is_dark(palette: QPalette | None = None) -> bool:
    """Whether text is light on a dark window in `palette` (default: the app's)."""
    pal = palette if palette is not None else QGuiApplication.palette()
    window = pal.color(QPalette.ColorRole.Window)
    text = pal.color(QPalette.ColorRole.WindowText)
    return window.lightnessF() < text.lightnessF()


def widget_is_dark(widget: QWidget) -> bool:
    return is_dark(widget.palette())


def style_sheet(dark: bool | None = None) -> str:
    """The app's style sheet for the palette showing (`dark`: default, the app's)."""
    dark = is_dark() if dark is None else dark
    sheets = ("app.qss", "app-dark.qss") if dark else ("app.qss",)
    try:
        return "\n".join(resource_path(name).read_text(encoding="utf-8") for name in sheets)
    except FileNotFoundError:
        return ""


class _PaletteWatcher(QObject):
    """Re-applies the style sheet when the system palette changes (light <-> dark).

    Qt resolves `palette(...)` in a style sheet when the sheet is set, so without this the
    message cards would keep their light backgrounds after the system turns dark; and the
    dark sheet comes or goes.
    """

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.ApplicationPaletteChange and isinstance(obj, QApplication):
            obj.setStyleSheet(style_sheet())
        return False


def apply_theme(app: QApplication) -> None:
    """Use the platform style and palette, plus our sheet, re-applied on palette changes.

    On Linux without a desktop palette, Fusion gives a consistent look; on macOS the native
    style is kept so menus, buttons and the dark mode switch behave as users expect.
    """
    if app.platformName() in ("offscreen", "minimal", "xcb", "wayland"):
        app.setStyle("Fusion")
    app.setStyleSheet(style_sheet())
    if app.findChild(_PaletteWatcher) is None:
        watcher = _PaletteWatcher(app)
        app.installEventFilter(watcher)


def muted_color(widget: QWidget) -> str:
    """A secondary text colour for footers and hints, readable in both palettes."""
    pal = widget.palette()
    return pal.color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.WindowText).name()
