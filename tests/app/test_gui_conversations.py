"""Conversation handling as a user meets it: deleting, regenerating, renaming, drafts, a
reply running in another chat, and New chat."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QAbstractItemView, QApplication, QLineEdit, QMessageBox

from app.ui.sidebar import ConversationIdRole
from tests.app.test_gui import TIMEOUT, plain_settings, send_by_keyboard, wait_idle


def answer_next_dialog(button: QMessageBox.StandardButton) -> list[str]:
    """Press `button` in the next message box that opens (a real, modal one); the list
    it returns gets the box's text, so a test can tell whether one opened at all."""
    seen: list[str] = []
    tries = iter(range(100))  # looks for 2 s

    def answer() -> None:
        box = QApplication.activeModalWidget()
        if isinstance(box, QMessageBox):
            seen.append(f"{box.text()}\n{box.informativeText()}".strip())
            box.button(button).click()
        elif next(tries, None) is not None:
            QTimer.singleShot(20, answer)  # not open yet

    QTimer.singleShot(20, answer)
    return seen


def open_from_sidebar(qtbot, gui, conversation_id: int) -> None:
    """Click a chat's row in the list, as a user does."""
    sidebar = gui.window.sidebar
    row = sidebar.model.row_of(conversation_id)
    assert row >= 0
    rect = sidebar.list_view.visualRect(sidebar.model.index(row))
    qtbot.mouseClick(sidebar.list_view.viewport(), Qt.MouseButton.LeftButton,
                     pos=rect.center())
    assert gui.controller.conversation_id == conversation_id


def edit_button_of(card):
    [button] = [b for b in card.findChildren(type(card.copy_button)) if b.text() == "Edit"]
    return button


def sidebar_titles(gui) -> list[str]:
    model = gui.window.sidebar.model
    return [model.index(r).data() for r in range(model.rowCount())]


def start_long_reply(qtbot, gui, text: str) -> int:
    """Send `text` with no practical token limit and wait for the first words; returns
    the conversation the reply runs in."""
    gui.controller.set_settings(replace(gui.controller.settings, max_tokens=5000))
    assert gui.controller.send(text)
    card = gui.window.chat_view.cards[-1]
    qtbot.waitUntil(lambda: len(card.steps) >= 2, timeout=TIMEOUT)
    return gui.controller.conversation_id


def test_deleting_a_chat_while_it_replies_deletes_it(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
    gui.controller.send("Keep this chat")
    wait_idle(qtbot, gui)
    kept = gui.controller.conversation_id
    gui.controller.new_conversation()
    doomed = start_long_reply(qtbot, gui, "Count forever")
    assert gui.controller.generating

    seen = answer_next_dialog(QMessageBox.StandardButton.Yes)
    gui.window._delete_current()  # Chat ▸ Delete Chat…
    assert seen and "Count forever" in seen[0]
    # gone at once: the list, the header and the chat shown follow
    assert gui.store.conversation(doomed) is None
    assert sidebar_titles(gui) == ["Keep this chat"]
    assert gui.controller.conversation_id == kept
    assert gui.window.title_label.text() == "Keep this chat"
    assert [c.message.content for c in gui.window.chat_view.cards][0] == "Keep this chat"
    wait_idle(qtbot, gui)  # the engine stopped within a step
    # nothing of it was written after the delete, and no error was raised for it
    assert gui.store.messages(doomed) == []
    db = gui.store._db
    assert db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?",
                      (doomed,)).fetchone()[0] == 0
    assert db.execute("SELECT COUNT(*) FROM steps WHERE message_id NOT IN "
                      "(SELECT id FROM messages)").fetchone()[0] == 0
    assert not gui.window.banner.isVisible()
    assert gui.store.conversation(kept) is not None
    # the app goes on
    assert gui.controller.send("Go on")
    wait_idle(qtbot, gui)
    assert [m.role for m in gui.store.messages(kept)] == ["user", "assistant"] * 2


def test_closing_right_after_deleting_a_replying_chat_writes_nothing_for_it(
        qtbot, make_gui, tiny_pair) -> None:
    """The app closes before the engine has stopped a deleted chat's reply: closing saves
    a reply in flight as stopped, but not one whose chat is gone."""
    gui = make_gui(plain_settings(tiny_pair[0]))
    doomed = start_long_reply(qtbot, gui, "Count forever")
    finished = []
    gui.controller.reply_finished.connect(finished.append)
    gui.controller.delete_conversation(doomed)
    gui.controller.close()
    assert finished == [] and not gui.controller.generating
    assert gui.store.conversation(doomed) is None and gui.store.messages(doomed) == []


def test_regenerating_an_earlier_reply_asks_first(qtbot, make_gui, tiny_pair,
                                                  screenshots_dir) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
    for text in ("First question", "Second question"):
        gui.controller.send(text)
        wait_idle(qtbot, gui)
    cid = gui.controller.conversation_id
    before = [m.id for m in gui.store.messages(cid)]
    view = gui.window.chat_view
    first_reply, last_reply = view.cards[1], view.cards[3]
    assert "everything after it" in first_reply.regenerate_button.toolTip()
    assert "everything after it" not in last_reply.regenerate_button.toolTip()

    # an earlier reply: a confirmation first; Cancel keeps everything
    seen = answer_next_dialog(QMessageBox.StandardButton.Cancel)
    qtbot.mouseClick(first_reply.regenerate_button, Qt.MouseButton.LeftButton)
    assert seen and "all 2 later messages will be deleted" in seen[0]
    assert not gui.controller.generating
    assert [m.id for m in gui.store.messages(cid)] == before
    assert len(view.cards) == 4

    # Yes regenerates it, dropping what came after
    seen = answer_next_dialog(QMessageBox.StandardButton.Yes)
    qtbot.mouseClick(view.cards[1].regenerate_button, Qt.MouseButton.LeftButton)
    assert seen
    wait_idle(qtbot, gui)
    msgs = gui.store.messages(cid)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[0].id == before[0] and msgs[1].id > before[-1]

    # the last reply stays one click: no dialog, the reply starts at once
    gui.controller.send("Third question")
    wait_idle(qtbot, gui)
    seen = answer_next_dialog(QMessageBox.StandardButton.Cancel)
    last = view.cards[-1]
    qtbot.mouseClick(last.regenerate_button, Qt.MouseButton.LeftButton)
    assert gui.controller.generating
    wait_idle(qtbot, gui)
    qtbot.wait(100)
    assert seen == []
    assert [m.role for m in gui.store.messages(cid)] == ["user", "assistant"] * 2
    view.grab().save(str(screenshots_dir / "regenerate_tooltip.png"))


def test_a_draft_survives_switching_chats(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
    composer = gui.window.composer
    gui.controller.send("First chat")
    wait_idle(qtbot, gui)
    first = gui.controller.conversation_id
    qtbot.keyClicks(composer.edit, "half-typed draft")

    qtbot.mouseClick(gui.window.sidebar.new_button, Qt.MouseButton.LeftButton)
    assert composer.text == ""
    qtbot.keyClicks(composer.edit, "new chat draft")
    open_from_sidebar(qtbot, gui, first)
    assert composer.text == "half-typed draft"
    gui.window.new_action.trigger()
    assert composer.text == "new chat draft"
    open_from_sidebar(qtbot, gui, first)

    # an edit in progress is cancelled by leaving; the draft it covered comes back
    edit_button = edit_button_of(gui.window.chat_view.cards[0])
    qtbot.mouseClick(edit_button, Qt.MouseButton.LeftButton)
    assert composer.text == "First chat" and composer.editing_id is not None
    gui.window.new_action.trigger()
    assert composer.editing_id is None and not composer.edit_row.isVisible()
    assert composer.text == "new chat draft"
    open_from_sidebar(qtbot, gui, first)
    assert composer.text == "half-typed draft"
    qtbot.mouseClick(edit_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(composer.cancel_edit_button, Qt.MouseButton.LeftButton)
    assert composer.text == "half-typed draft"

    # what is sent is no draft any more
    qtbot.keyClick(composer.edit, Qt.Key.Key_Return)
    wait_idle(qtbot, gui)
    assert gui.store.messages(first)[-2].content == "half-typed draft"
    gui.window.new_action.trigger()
    open_from_sidebar(qtbot, gui, first)
    assert composer.text == ""

    # sending an edit brings back the draft it covered
    qtbot.keyClicks(composer.edit, "later draft")
    qtbot.mouseClick(edit_button_of(gui.window.chat_view.cards[0]), Qt.MouseButton.LeftButton)
    assert composer.editing_id is not None
    composer.set_text("First chat, edited")
    qtbot.keyClick(composer.edit, Qt.Key.Key_Return)
    wait_idle(qtbot, gui)
    assert [m.content for m in gui.store.messages(first)][0] == "First chat, edited"
    assert len(gui.store.messages(first)) == 2
    assert composer.text == "later draft" and composer.editing_id is None


def rename_inline(qtbot, gui, text: str) -> None:
    editor = gui.window.sidebar.list_view.findChild(QLineEdit)
    assert editor is not None and editor.isVisible()
    editor.selectAll()
    qtbot.keyClick(editor, Qt.Key.Key_Delete)
    if text:
        qtbot.keyClicks(editor, text)
    qtbot.keyClick(editor, Qt.Key.Key_Return)
    # (the delegate commits on the next event-loop turn)
    view = gui.window.sidebar.list_view
    qtbot.waitUntil(lambda: view.state() != QAbstractItemView.State.EditingState)


def test_renaming_a_chat_updates_the_header_and_window_title(qtbot, make_gui,
                                                             tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
    gui.controller.send("Tell me about cats")
    wait_idle(qtbot, gui)
    cid = gui.controller.conversation_id
    window = gui.window
    assert window.title_label.text() == "Tell me about cats"

    window._rename_current()  # Chat ▸ Rename Chat…
    rename_inline(qtbot, gui, "Cats")
    assert sidebar_titles(gui) == ["Cats"]
    assert gui.store.conversation(cid).title == "Cats"
    assert window.title_label.text() == "Cats"
    assert window.windowTitle() == "Cats — Understudy"

    # double-click in the list, and an empty name
    sidebar = window.sidebar
    rect = sidebar.list_view.visualRect(sidebar.model.index(0))
    # (a double click's second press is the one that edits: the view checks the first)
    qtbot.mousePress(sidebar.list_view.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    qtbot.mouseDClick(sidebar.list_view.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    rename_inline(qtbot, gui, "")
    assert sidebar_titles(gui) == ["Untitled"]
    assert window.title_label.text() == "Untitled"
    assert window.windowTitle() == "Untitled — Understudy"
    assert sidebar.list_view.currentIndex().data(ConversationIdRole) == cid


def test_a_reply_running_in_another_chat_is_named_not_stoppable_here(qtbot, make_gui,
                                                                     tiny_pair,
                                                                     screenshots_dir) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
    window, composer = gui.window, gui.window.composer
    gui.controller.send("Quiet chat")
    wait_idle(qtbot, gui)
    quiet = gui.controller.conversation_id
    gui.controller.new_conversation()
    busy = start_long_reply(qtbot, gui, "Tell me about dragons")
    assert composer.stop_button.isVisible() and not composer.send_button.isVisible()
    assert window.stop_action.isEnabled()

    open_from_sidebar(qtbot, gui, quiet)
    assert gui.controller.generating
    assert composer.send_button.isVisible() and not composer.send_button.isEnabled()
    assert not composer.stop_button.isVisible()
    assert not window.stop_action.isEnabled()
    assert composer.busy_label.isVisible()
    assert "“Tell me about dragons”" in composer.busy_label.text()
    qtbot.wait(50)  # (the cards of the chat left are deleted on the next turn)
    window.grab().save(str(screenshots_dir / "reply_running_in_another_chat.png"))
    # Enter keeps the text (nothing can be sent yet) and the other reply runs on
    send_by_keyboard(qtbot, gui, "Hello again")
    assert composer.text == "Hello again"
    assert len(gui.store.messages(quiet)) == 2
    assert gui.controller.generating

    # the hint's link goes to the chat that replies: Stop is there, and stops it
    assert composer.busy_label.textInteractionFlags() & Qt.TextInteractionFlag.LinksAccessibleByMouse
    composer.busy_label.linkActivated.emit("open")
    assert gui.controller.conversation_id == busy
    assert composer.stop_button.isVisible() and not composer.busy_label.isVisible()
    assert window.stop_action.isEnabled()
    qtbot.mouseClick(composer.stop_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, gui)

    open_from_sidebar(qtbot, gui, quiet)
    assert composer.send_button.isEnabled() and not composer.busy_label.isVisible()
    assert composer.text == "Hello again"  # (the draft stayed with its chat)
    qtbot.keyClick(composer.edit, Qt.Key.Key_Return)
    wait_idle(qtbot, gui)
    assert [m.content for m in gui.store.messages(quiet)][2] == "Hello again"


def test_new_chat_saves_no_empty_chats(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
    new_button = gui.window.sidebar.new_button
    qtbot.mouseClick(new_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(new_button, Qt.MouseButton.LeftButton)
    assert gui.store.conversations() == [] and sidebar_titles(gui) == []
    assert gui.window.title_label.text() == "New chat"

    gui.controller.send("Hello there")
    wait_idle(qtbot, gui)
    assert sidebar_titles(gui) == ["Hello there"]
    qtbot.mouseClick(new_button, Qt.MouseButton.LeftButton)
    gui.window.new_action.trigger()
    assert sidebar_titles(gui) == ["Hello there"]
    assert gui.controller.conversation_id is None
    assert gui.window.title_label.text() == "New chat"
    assert gui.window.chat_view.cards == []
    assert not gui.window.sidebar.list_view.selectionModel().hasSelection()

    # the first message makes it a chat of its own
    gui.controller.send("Second topic")
    wait_idle(qtbot, gui)
    assert sidebar_titles(gui) == ["Second topic", "Hello there"]
    qtbot.mouseClick(new_button, Qt.MouseButton.LeftButton)
    gui.close()
    again = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
    assert sidebar_titles(again) == ["Second topic", "Hello there"]
