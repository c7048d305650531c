"""The message composer: multi-line input where Enter sends and Shift+Enter breaks the line.

Escape stops the open chat's reply, or leaves an edit; Up in an empty box edits the last
message sent, as in Slack or Messages (Escape gives the box back); Page Up and Page Down
scroll the conversation (`page_requested`), so a long reply is read without leaving the box.

While a reply is generating in the open chat the Send button becomes Stop; in another
chat Send waits, and a line names the chat that is replying. The composer only reports what
the user wants (`message_submitted`); the main window decides where it goes (a chat reply
or a comparison run).
"""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent, QKeySequence, QResizeEvent
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

NATIVE = QKeySequence.SequenceFormat.NativeText  # ⌘ on macOS, Ctrl elsewhere
MAX_LINES = 8
PLACEHOLDER = "Ask anything…  (Enter sends, Shift+Enter for a new line)"
SHORT_PLACEHOLDER = "Ask anything…"  # where the keys' hint would wrap and be cut in half


class ComposerEdit(QPlainTextEdit):
    """A text box that grows with its content up to MAX_LINES lines."""

    submitted = Signal()
    escape_pressed = Signal()
    recall_requested = Signal()  # Up in an empty box: edit the last message sent
    page_requested = Signal(int)  # Page Up (-1) or Page Down (+1): scroll the conversation

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
        if event.key() == Qt.Key.Key_Escape and not mods:
            self.escape_pressed.emit()
            return
        if event.key() == Qt.Key.Key_Up and not mods and not self.toPlainText():
            self.recall_requested.emit()
            return
        if event.key() in (Qt.Key.Key_PageUp, Qt.Key.Key_PageDown) and not mods:
            self.page_requested.emit(-1 if event.key() == Qt.Key.Key_PageUp else 1)
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
    """Input box plus Send/Stop; can be put in "edit a previous message" mode.

    What is typed and not sent is a draft of the open chat: switching chats keeps it with
    that chat (in memory while the app runs) and brings back the new chat's own.
    """

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
        self.stop_button.setToolTip("Stop writing this reply (Esc, "
                                    f"{QKeySequence('Ctrl+.').toString(NATIVE)})")
        self.stop_button.hide()
        self.editing_id: int | None = None
        self._pre_edit_draft = ""  # what the box held when an edit began
        self._conversation_id = controller.conversation_id  # whose draft the box holds
        self._drafts: dict[int | None, str] = {}  # the other chats' drafts
        self.editing_label = QLabel("Editing an earlier message: sending replaces it and "
                                    "everything after it.")
        self.editing_label.setObjectName("editingHint")
        self.cancel_edit_button = QToolButton()
        self.cancel_edit_button.setText("Cancel edit")
        self.cancel_edit_button.setToolTip("Keep the message as it was (Esc)")
        self.cancel_edit_button.clicked.connect(self.cancel_edit)
        edit_row = QHBoxLayout()
        edit_row.setContentsMargins(0, 0, 0, 0)
        edit_row.addWidget(self.editing_label, 1)
        edit_row.addWidget(self.cancel_edit_button)
        self.edit_row = QWidget()
        self.edit_row.setLayout(edit_row)
        self.edit_row.hide()
        # a reply runs in another chat: say which, and offer to go there (Stop is there)
        self.busy_label = QLabel()
        self.busy_label.setObjectName("busyHint")
        self.busy_label.setWordWrap(True)
        self.busy_label.setTextFormat(Qt.TextFormat.RichText)
        self.busy_label.linkActivated.connect(self._on_busy_link)
        self.busy_label.hide()
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.edit, 1)
        row.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        row.addWidget(self.stop_button, 0, Qt.AlignmentFlag.AlignBottom)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 4, 8, 8)
        layout.setSpacing(2)
        layout.addWidget(self.edit_row)
        layout.addWidget(self.busy_label)
        layout.addLayout(row)

        self.edit.submitted.connect(self._on_submitted)
        self.edit.escape_pressed.connect(self._on_escape)
        self.edit.recall_requested.connect(self.edit_last_message)
        self.send_button.clicked.connect(self._on_submitted)
        self.stop_button.clicked.connect(controller.stop)
        controller.generating_changed.connect(self._on_generating_changed)
        controller.conversation_opened.connect(self._on_conversation_opened)
        controller.conversations_changed.connect(self._update_send_stop)  # (a renamed chat)

    @property
    def text(self) -> str:
        return self.edit.toPlainText()

    def set_text(self, text: str) -> None:
        self.edit.setPlainText(text)
        self.edit.moveCursor(self.edit.textCursor().MoveOperation.End)
        self.edit.setFocus()

    def begin_edit(self, message_id: int, text: str) -> None:
        """Load an earlier user message for editing; the next send replaces it."""
        if self.editing_id is None:
            self._pre_edit_draft = self.text
        self.editing_id = message_id
        self.edit_row.show()
        self.set_text(text)

    def cancel_edit(self) -> None:
        """Leave edit mode; the box gets back the draft the edit covered."""
        if self.editing_id is None:
            return
        self._end_edit()

    def edit_last_message(self) -> None:
        """Edit the open chat's last message sent (nothing while a reply is written)."""
        if self.editing_id is not None or self.controller.generating:
            return
        sent = [m for m in self.controller.messages() if m.role == "user"]
        if sent:
            self.begin_edit(sent[-1].id, sent[-1].content)

    def _on_escape(self) -> None:
        """Escape leaves an edit, else stops the reply being written here."""
        if self.editing_id is not None:
            self.cancel_edit()
        elif self.controller.generating_here:
            self.controller.stop()

    def _end_edit(self) -> None:
        self.editing_id = None
        self.edit_row.hide()
        self._show_draft(self._pre_edit_draft)
        self._pre_edit_draft = ""

    def _show_draft(self, text: str) -> None:
        self.edit.setPlainText(text)
        self.edit.moveCursor(self.edit.textCursor().MoveOperation.End)

    def _on_conversation_opened(self, _messages: object) -> None:
        """Another chat: an edit in progress ends, and the draft stays with its chat."""
        if self.editing_id is not None:
            self._end_edit()
        self._update_send_stop()
        now = self.controller.conversation_id
        if now == self._conversation_id:
            return
        if self.text:
            self._drafts[self._conversation_id] = self.text
        self._conversation_id = now
        self._show_draft(self._drafts.pop(now, ""))

    def _on_submitted(self) -> None:
        text = self.edit.toPlainText()
        if not text.strip() or self.controller.generating:
            return
        self.edit.clear()
        if self.editing_id is not None:
            message_id = self.editing_id
            self._end_edit()
            self.edit_submitted.emit(message_id, text)
        else:
            self.message_submitted.emit(text)

    def _on_generating_changed(self, _generating: bool) -> None:
        self._update_send_stop()

    def _update_send_stop(self) -> None:
        """Stop in the chat whose reply runs; elsewhere Send, greyed out until it ends,
        under a line that names that chat."""
        controller = self.controller
        here = controller.generating_here
        running = controller.generating_conversation_id
        self.send_button.setVisible(not here)
        self.send_button.setEnabled(not controller.generating)
        self.stop_button.setVisible(here)
        elsewhere = running is not None and not here
        if elsewhere:
            conv = controller.store.conversation(running)
            title = html.escape(conv.title) if conv is not None else "another chat"
            self.busy_label.setText(f"Writing a reply in “{title}”: you can send once it "
                                    'finishes. <a href="open">Go to that chat</a>')
        self.busy_label.setVisible(elsewhere)

    def _on_busy_link(self, _link: str) -> None:
        running = self.controller.generating_conversation_id
        if running is not None:
            self.controller.open_conversation(running)
