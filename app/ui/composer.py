"""The message composer: multi-line input where Enter sends and Shift+Enter breaks the line.

While a reply is generating the Send button becomes Stop. The composer only reports what
the user wants (`message_submitted`); the main window decides where it goes (a chat reply
or a comparison run).
"""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent, QResizeEvent
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.ui.controller import ChatController

MAX_LINES = 8
PLACEHOLDER = "Ask anything…  (Enter sends, Shift+Enter for a new line)"
SHORT_PLACEHOLDER = "Ask anything…"  # where the keys' hint would wrap and be cut in half


class ComposerEdit(QPlainTextEdit):
    """A text box that grows with its content up to MAX_LINES lines."""

    submitted = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTabChangesFocus(True)
        self.setPlaceholderText(PLACEHOLDER)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)
        self._fit_height()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt override
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        mods = event.modifiers()
        newline = mods & (Qt.KeyboardModifier.ShiftModifier | Qt.KeyboardModifier.AltModifier)
        if enter and not newline:
            self.submitted.emit()
            return
        if enter:  # Shift+Enter inserts a plain newline, not a paragraph separator
            self.insertPlainText("\n")
            return
        super().keyPressEvent(event)

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self._fit_placeholder()

    def _fit_placeholder(self) -> None:
        """The full hint where it fits on the box's one line, else the short one (the box
        is one line tall while empty, so a wrapped hint showed half its second line)."""
        room = self.viewport().width() - 2 * self.document().documentMargin()
        fits = self.fontMetrics().horizontalAdvance(PLACEHOLDER) <= room
        self.setPlaceholderText(PLACEHOLDER if fits else SHORT_PLACEHOLDER)

    def _fit_height(self, *_: object) -> None:
        line = self.fontMetrics().lineSpacing()
        lines = max(1, min(MAX_LINES, int(self.document().size().height())))
        margins = self.contentsMargins()
        doc_margin = self.document().documentMargin()
        self.setFixedHeight(int(lines * line + 2 * doc_margin + margins.top() + margins.bottom()) + 2)


class Composer(QWidget):
    """Input box plus Send/Stop; can be put in "edit a previous message" mode."""

    message_submitted = Signal(str)
    edit_submitted = Signal(int, str)  # message id being edited, its new text

    def __init__(self, controller: ChatController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.edit = ComposerEdit()
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setObjectName("stopButton")
        self.stop_button.hide()
        self.editing_id: int | None = None
        self.editing_label = QLabel("Editing an earlier message: sending replaces it and "
                                    "everything after it.")
        self.editing_label.setObjectName("editingHint")
        self.cancel_edit_button = QToolButton()
        self.cancel_edit_button.setText("Cancel edit")
        self.cancel_edit_button.clicked.connect(self.cancel_edit)
        edit_row = QHBoxLayout()
        edit_row.setContentsMargins(0, 0, 0, 0)
        edit_row.addWidget(self.editing_label, 1)
        edit_row.addWidget(self.cancel_edit_button)
        self.edit_row = QWidget()
        self.edit_row.setLayout(edit_row)
        self.edit_row.hide()
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.edit, 1)
        row.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        row.addWidget(self.stop_button, 0, Qt.AlignmentFlag.AlignBottom)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 8)
        layout.setSpacing(2)
        layout.addWidget(self.edit_row)
        layout.addLayout(row)

        self.edit.submitted.connect(self._on_submitted)
        self.send_button.clicked.connect(self._on_submitted)
        self.stop_button.clicked.connect(controller.stop)
        controller.generating_changed.connect(self._on_generating_changed)

    @property
    def text(self) -> str:
        return self.edit.toPlainText()

    def set_text(self, text: str) -> None:
        self.edit.setPlainText(text)
        self.edit.moveCursor(self.edit.textCursor().MoveOperation.End)
        self.edit.setFocus()

    def begin_edit(self, message_id: int, text: str) -> None:
        """Load an earlier user message for editing; the next send replaces it."""
        self.editing_id = message_id
        self.edit_row.show()
        self.set_text(text)

    def cancel_edit(self) -> None:
        self.editing_id = None
        self.edit_row.hide()
        self.edit.clear()

    def _on_submitted(self) -> None:
        text = self.edit.toPlainText()
        if not text.strip() or self.controller.generating:
            return
        self.edit.clear()
        if self.editing_id is not None:
            message_id, self.editing_id = self.editing_id, None
            self.edit_row.hide()
            self.edit_submitted.emit(message_id, text)
        else:
            self.message_submitted.emit(text)

    def _on_generating_changed(self, generating: bool) -> None:
        self.send_button.setVisible(not generating)
        self.stop_button.setVisible(generating)
