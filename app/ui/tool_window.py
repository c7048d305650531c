"""Small windows of their own over the main one (training, diagnostics, import progress).

They are plain widgets with the Tool flag rather than dialogs, so nothing in them is
modal; this base gives them what a dialog has for the keyboard: Escape closes the window
(what it follows keeps running: closing is not cancelling). Every window but the main one
also closes with Ctrl/⌘+W (`close_with_keys` for the dialogs), as a Mac user expects of
the front window: File ▸ Close Window's shortcut belongs to the main window and did nothing
in the others.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QKeyEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import QWidget


def close_with_keys(window: QWidget) -> QShortcut:
    """Ctrl/⌘+W (all the platform's Close keys: Ctrl+F4 too elsewhere) closes `window`."""
    shortcut = QShortcut(window)
    shortcut.setKeys(QKeySequence.StandardKey.Close)
    shortcut.activated.connect(window.close)
    return shortcut


class ToolWindow(QWidget):
    """Escape or Ctrl/⌘+W closes it. (A shortcut of its own would not do for Ctrl+W: Qt
    counts a tool window as part of its parent's, whose File ▸ Close Window has the same
    keys, and the two cancelled out; so the window claims the keys before any shortcut.)"""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent, Qt.WindowType.Tool)

    def event(self, event: QEvent) -> bool:
        if (event.type() == QEvent.Type.ShortcutOverride and isinstance(event, QKeyEvent)
                and event.matches(QKeySequence.StandardKey.Close)):
            event.accept()  # the key press comes here (`keyPressEvent`), not to a shortcut
            return True
        return super().event(event)

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt override
        if ((event.key() == Qt.Key.Key_Escape and not event.modifiers())
                or event.matches(QKeySequence.StandardKey.Close)):
            self.close()
            return
        super().keyPressEvent(event)
