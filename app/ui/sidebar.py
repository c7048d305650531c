"""The conversation list: new, search, open, rename (double-click or menu), delete, export.

`ConversationListModel` is a QAbstractListModel over the store that knows no widgets;
`Sidebar` is a thin view on it that forwards intents to the controller.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from PySide6.QtCore import (
    QAbstractListModel,
    QModelIndex,
    QPersistentModelIndex,
    QPoint,
    Qt,
    Signal,
)
from PySide6.QtWidgets import (
    QAbstractItemView,
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


class Sidebar(QWidget):
    export_requested = Signal(int)  # conversation id

    def __init__(self, controller: ChatController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.model = ConversationListModel(controller.store, self)
        self.search_edit = QLineEdit()
        self.search_edit.setPlaceholderText("Search chats")
        self.search_edit.setClearButtonEnabled(True)
        self.new_button = QPushButton("New chat")
        self.list_view = QListView()
        self.list_view.setModel(self.model)
        self.list_view.setEditTriggers(QAbstractItemView.EditTrigger.DoubleClicked
                                       | QAbstractItemView.EditTrigger.EditKeyPressed)
        self.list_view.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list_view.setUniformItemSizes(True)
        self.list_view.setItemDelegate(ElidingDelegate(self.list_view))
        self.list_view.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list_view.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)

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
        # The list stays where the user scrolled it: selecting the open chat again scrolls
        # to it, so renaming or deleting a chat far down a long list jumped back to the
        # top, and clearing out old chats meant scrolling down again after each one.
        bar = self.list_view.verticalScrollBar()
        at = bar.value()
        self.model.refresh()
        self._select_current()
        bar.setValue(at)

    def _on_conversation_opened(self, _messages: object) -> None:
        self._select_current()

    def _on_clicked(self, index: QModelIndex) -> None:
        conversation_id = index.data(ConversationIdRole)
        if conversation_id is not None and conversation_id != self.controller.conversation_id:
            self.controller.open_conversation(int(conversation_id))

    def rename(self, conversation_id: int) -> None:
        row = self.model.row_of(conversation_id)
        if row >= 0:
            self.list_view.edit(self.model.index(row))

    def confirm_delete(self, conversation_id: int) -> None:
        conv = self.controller.store.conversation(conversation_id)
        if conv is None:
            return
        answer = QMessageBox.question(self, "Delete chat",
                                      f"Delete “{conv.title}” and all its messages?")
        if answer == QMessageBox.StandardButton.Yes:
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
