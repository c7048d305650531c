"""Small windows of their own over the main one (training, diagnostics, import progress).

They are plain widgets with the Tool flag rather than dialogs, so nothing in them is
modal; this base gives them what a dialog has for the keyboard: Escape closes the window
(what it follows keeps running: closing is not cancelling).
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QWidget


class ToolWindow(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent, Qt.WindowType.Tool)

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt override
        if event.key() == Qt.Key.Key_Escape and not event.modifiers():
            self.close()
            return
        super().keyPressEvent(event)
