"""The conversation list: new, search, open, rename (double-click or menu), delete, export.

`ConversationListModel` is a QAbstractListModel over the store that knows no widgets;
`Sidebar` is a thin view on it that forwards intents to the controller.

From the keyboard: the arrow keys open the chat they move to, Enter opens it and hands the
keyboard to the composer (`chat_chosen`), Delete or Backspace asks to delete it, F2 renames
it; in the search field Down goes to the list, Enter opens the first match and Escape
clears the search.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from PySide6.QtCore import (
    QAbstractListModel,
    QEvent,
    QModelIndex,
    QObject,
    QPersistentModelIndex,
    QPoint,
    Qt,
    Signal,
)
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QHBoxLayout,
    QLineEdit,
    QListView,
    QMenu,
    QMessageBox,
    QPushButton,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QVBoxLayout,
    QWidget,
)

from app.store import Conversation, Store
from app.ui.controller import ChatController

ConversationIdRole = Qt.ItemDataRole.UserRole + 1
Index = QModelIndex | QPersistentModelIndex


class ConversationListModel(QAbstractListModel):
    """Conversations, most recent first, optionally filtered by a search string."""

    title_edited = Signal(int, str)  # conversation id, the title typed in the list

    def __init__(self, store: Store, parent=None) -> None:
        super().__init__(parent)
        self.store = store
        self.search = ""
        self._rows: list[Conversation] = store.conversations()

    def refresh(self, search: str | None = None) -> None:
        if search is not None:
            self.search = search
        self.beginResetModel()
        self._rows = self.store.conversations(self.search)
        self.endResetModel()

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: N802, B008 - Qt override
        return 0 if parent.isValid() else len(self._rows)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._rows):
            return None
        conv = self._rows[index.row()]
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole):
            return conv.title
        if role == Qt.ItemDataRole.ToolTipRole:
            when = _dt.datetime.fromtimestamp(conv.updated_at).strftime("%Y-%m-%d %H:%M")
            return f"{conv.title}\nlast active {when}"
        if role == ConversationIdRole:
            return conv.id
        return None

    def setData(self, index: Index, value: Any, role: int = Qt.ItemDataRole.EditRole) -> bool:  # noqa: N802
        """A title typed in the list goes to whoever renames (the controller), so the
        header and window title follow; the rows come back through `refresh`."""
        if role != Qt.ItemDataRole.EditRole or not index.isValid():
            return False
        self.title_edited.emit(self._rows[index.row()].id, str(value))
        return True

    def flags(self, index: Index) -> Qt.ItemFlag:
        base = super().flags(index)
        return base | Qt.ItemFlag.ItemIsEditable if index.isValid() else base

    def row_of(self, conversation_id: int | None) -> int:
        return next((i for i, c in enumerate(self._rows) if c.id == conversation_id), -1)

    def conversation_at(self, row: int) -> Conversation:
        return self._rows[row]


class ElidingDelegate(QStyledItemDelegate):
    """Rows that ask for no width of their own.

    A list view lays rows out at their text's width and scrolls sideways for a long title;
    asking for none makes every row as wide as the view, so the title is elided ("…") and
    the full one is in the tooltip.
    """

    def sizeHint(self, option: QStyleOptionViewItem, index: Index):  # noqa: N802 - Qt override
        size = super().sizeHint(option, index)
        size.setWidth(1)
        return size


class ChatListView(QListView):
    """The list, knowing whether the row it moved to was moved to by a key (`keying`): the
    arrows open a chat and leave the keyboard in the list, a click hands it on."""

    keying = False

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802 - Qt override
        self.keying = True
        try:
            super().keyPressEvent(event)
        finally:
            self.keying = False


class Sidebar(QWidget):
    export_requested = Signal(int)  # conversation id
    chat_chosen = Signal()  # picked from the keyboard (Enter): typing goes to the composer

    def __init__(self, controller: ChatController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.model = ConversationListModel(controller.store, self)
        self.search_edit = QLineEdit()
        self.search_edit.setPlaceholderText("Search chats")
        self.search_edit.setClearButtonEnabled(True)
        self.new_button = QPushButton("New chat")
        self.list_view = ChatListView()
        self.list_view.setModel(self.model)
        self.list_view.setEditTriggers(QAbstractItemView.EditTrigger.DoubleClicked
                                       | QAbstractItemView.EditTrigger.EditKeyPressed)
        self.list_view.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list_view.setUniformItemSizes(True)
        self.list_view.setItemDelegate(ElidingDelegate(self.list_view))
        self.list_view.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list_view.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self._return_focus: QWidget | None = None  # where focus goes when a rename ends
        # True while the arrow keys open a chat: the window then leaves the keyboard in the
        # list (a chat opened otherwise hands it to the composer)
        self.browsing = False

        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.search_edit, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 4, 8)
        layout.addWidget(self.new_button)
        layout.addLayout(top)
        layout.addWidget(self.list_view, 1)

        self.new_button.clicked.connect(controller.new_conversation)
        self.model.title_edited.connect(controller.rename_conversation)
        self.search_edit.textChanged.connect(self._on_search_changed)
        self.list_view.clicked.connect(self._on_clicked)
        self.list_view.activated.connect(self._on_activated)
        self.list_view.selectionModel().currentChanged.connect(self._on_current_changed)
        self.list_view.itemDelegate().closeEditor.connect(self._on_editor_closed)
        self.list_view.installEventFilter(self)
        self.search_edit.installEventFilter(self)
        self.list_view.customContextMenuRequested.connect(self._on_context_menu)
        controller.conversations_changed.connect(self._on_conversations_changed)
        controller.conversation_opened.connect(self._on_conversation_opened)

    def _select_current(self) -> None:
        row = self.model.row_of(self.controller.conversation_id)
        if row >= 0:
            self.list_view.setCurrentIndex(self.model.index(row))
        else:
            self.list_view.clearSelection()

    def _on_search_changed(self, text: str) -> None:
        self.model.refresh(text)
        self._select_current()

    def _on_conversations_changed(self) -> None:
        # a rename typed in the list resets the model under its editor, which threw the
        # keyboard to the next widget in the window (the comparison toggle). The list stays
        # where the user scrolled it: selecting the open chat again scrolls to it, so
        # renaming or deleting a chat far down a long list jumped back to the top, and
        # clearing out old chats meant scrolling down again after each one.
        had_focus = self._holds_focus()
        bar = self.list_view.verticalScrollBar()
        at = bar.value()
        self.model.refresh()
        self._select_current()
        bar.setValue(at)
        if had_focus and not self._holds_focus():
            self.list_view.setFocus(Qt.FocusReason.OtherFocusReason)

    def _holds_focus(self) -> bool:
        focus = QApplication.focusWidget()
        return focus is not None and (focus is self.list_view
                                      or self.list_view.isAncestorOf(focus))

    def _on_conversation_opened(self, _messages: object) -> None:
        self._select_current()

    def _on_clicked(self, index: QModelIndex) -> None:
        conversation_id = index.data(ConversationIdRole)
        if conversation_id is not None and conversation_id != self.controller.conversation_id:
            self.controller.open_conversation(int(conversation_id))

    def _on_current_changed(self, current: QModelIndex, _previous: QModelIndex) -> None:
        """The arrow keys open the chat they land on (a click, the model's resets and
        `_select_current` move the current row too: not those)."""
        if current.isValid() and self.list_view.keying:
            self._browse_to(current)

    def _browse_to(self, index: QModelIndex) -> None:
        self.browsing = True  # the keyboard stays in the list (see `browsing`)
        try:
            self._on_clicked(index)
        finally:
            self.browsing = False

    def _on_activated(self, index: QModelIndex) -> None:
        self._on_clicked(index)
        self.chat_chosen.emit()

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.KeyPress and isinstance(event, QKeyEvent):
            if watched is self.list_view:
                return self._list_key(event)
            if watched is self.search_edit:
                return self._search_key(event)
        return super().eventFilter(watched, event)

    def _list_key(self, event: QKeyEvent) -> bool:
        index = self.list_view.currentIndex()
        editing = self.list_view.state() == QAbstractItemView.State.EditingState
        if (event.key() in (Qt.Key.Key_Delete, Qt.Key.Key_Backspace) and index.isValid()
                and not editing):
            self.confirm_delete(int(index.data(ConversationIdRole)))
            return True
        return False

    def _search_key(self, event: QKeyEvent) -> bool:
        key = event.key()
        if key == Qt.Key.Key_Escape:
            self.search_edit.clear()
            self.chat_chosen.emit()
            return True
        if self.model.rowCount() == 0:
            return False
        if key == Qt.Key.Key_Down:
            self.list_view.setFocus(Qt.FocusReason.TabFocusReason)
            self.list_view.setCurrentIndex(self.model.index(0))
            self._browse_to(self.model.index(0))
            return True
        if key in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            self._on_activated(self.model.index(0))
            return True
        return False

    def rename(self, conversation_id: int) -> None:
        """Edit the title in place; the keyboard goes back where it was when it ends."""
        row = self.model.row_of(conversation_id)
        if row >= 0:
            focus = QApplication.focusWidget()
            self._return_focus = None if focus is None or self._holds_focus() else focus
            self.list_view.edit(self.model.index(row))

    def _on_editor_closed(self, *_: object) -> None:
        back, self._return_focus = self._return_focus, None
        if back is not None and QApplication.focusWidget() in (None, self.list_view):
            back.setFocus(Qt.FocusReason.OtherFocusReason)

    def confirm_delete(self, conversation_id: int) -> None:
        """Ask before deleting, with the safe answer the default (Enter keeps the chat)."""
        conv = self.controller.store.conversation(conversation_id)
        if conv is None:
            return
        box = QMessageBox(QMessageBox.Icon.Warning, "Delete Chat",
                          f"Delete “{conv.title}”?", parent=self)
        box.setInformativeText("Its messages are deleted too. This cannot be undone.")
        box.setStandardButtons(QMessageBox.StandardButton.Yes
                               | QMessageBox.StandardButton.Cancel)
        box.button(QMessageBox.StandardButton.Yes).setText("Delete")
        box.setDefaultButton(QMessageBox.StandardButton.Cancel)
        if box.exec() == QMessageBox.StandardButton.Yes:
            self.controller.delete_conversation(conversation_id)

    def _on_context_menu(self, pos: QPoint) -> None:
        index = self.list_view.indexAt(pos)
        if not index.isValid():
            return
        conversation_id = int(index.data(ConversationIdRole))
        menu = QMenu(self)
        menu.addAction("Rename", lambda: self.rename(conversation_id))
        menu.addAction("Export as Markdown…", lambda: self.export_requested.emit(conversation_id))
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.confirm_delete(conversation_id))
        menu.exec(self.list_view.viewport().mapToGlobal(pos))
