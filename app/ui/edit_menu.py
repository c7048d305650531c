"""Edit ▸ Undo, Redo, Cut, Copy, Paste, Select All: the standard items, for whatever has
the keyboard.

A Mac app's Edit menu carries them (and users reach for them there, or expect to see the
keys); Qt's text widgets do the work themselves. Each item acts on the focused text field
or message, and is enabled only where it can act (no Paste into a message, no Copy from
the chat list). The widgets keep their own keys: a focused text box takes ⌘C before the
menu's shortcut does, so the keys do exactly what they did before.
"""

from __future__ import annotations

from PySide6.QtCore import QObject
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QApplication, QLineEdit, QMenu, QPlainTextEdit, QTextEdit, QWidget

TextWidget = QLineEdit | QPlainTextEdit | QTextEdit
ITEMS = (  # (text, key, the widget's method, whether it changes the text)
    ("Undo", QKeySequence.StandardKey.Undo, "undo", True),
    ("Redo", QKeySequence.StandardKey.Redo, "redo", True),
    None,
    ("Cut", QKeySequence.StandardKey.Cut, "cut", True),
    ("Copy", QKeySequence.StandardKey.Copy, "copy", False),
    ("Paste", QKeySequence.StandardKey.Paste, "paste", True),
    None,
    ("Select All", QKeySequence.StandardKey.SelectAll, "selectAll", False),
)


class EditActions(QObject):
    """The items, added to `menu`, following the focus (a child of `parent`, so the app's
    focus signal lets go of it with the window)."""

    def __init__(self, menu: QMenu, parent: QWidget) -> None:
        super().__init__(parent)
        self.actions: dict[str, QAction] = {}
        self._edits: set[str] = set()
        for item in ITEMS:
            if item is None:
                menu.addSeparator()
                continue
            text, key, method, edits = item
            action = QAction(text, parent)
            action.setShortcut(QKeySequence(key))
            action.triggered.connect(lambda _=False, m=method: self._run(m))
            menu.addAction(action)
            self.actions[method] = action
            if edits:
                self._edits.add(method)
        app = QApplication.instance()
        if isinstance(app, QApplication):
            app.focusChanged.connect(self._on_focus_changed)
        self.sync()

    def _on_focus_changed(self, _old: QWidget | None, _now: QWidget | None) -> None:
        self.sync()

    @staticmethod
    def _target() -> TextWidget | None:
        widget = QApplication.focusWidget()
        return widget if isinstance(widget, TextWidget) else None

    def sync(self) -> None:
        target = self._target()
        writable = target is not None and not target.isReadOnly()
        for method, action in self.actions.items():
            action.setEnabled(writable if method in self._edits else target is not None)

    def _run(self, method: str) -> None:
        target = self._target()
        if target is not None:
            getattr(target, method)()
