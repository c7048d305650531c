"""The window driven from the keyboard, and what it puts on the clipboard."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QTextCursor

from app.store import STOPPED
from app.ui.chat_view import TokenBrowser
from app.ui.token_render import user_message_html
from tests.app.test_gui import TIMEOUT, plain_settings, send_by_keyboard, wait_idle
from tests.app.test_tree_gui import STEPS, TEXT


def copy_all(browser: TokenBrowser) -> str:
    cursor = browser.textCursor()
    cursor.select(QTextCursor.SelectionType.Document)
    browser.setTextCursor(cursor)
    browser.copy()
    return QGuiApplication.clipboard().text()


def test_copying_a_selection_of_the_speculation_view_copies_the_reply_alone(qtbot) -> None:
    browser = TokenBrowser()
    qtbot.addWidget(browser)
    browser.resize(560, 60)
    browser.show_reply(STEPS, TEXT, speculation=True, show_rejected=True, dark=False)
    assert "France" in browser.document().toPlainText()  # ghosts, a bar and a marker shown
    assert copy_all(browser) == TEXT  # none of them copied
    assert QGuiApplication.clipboard().mimeData().formats() == ["text/plain"]  # no colours
    # part of it: from inside "capital" to inside "nice", across ghosts of two branches
    start = browser.document().toPlainText().index("pital")
    end = browser.document().toPlainText().index("ice") + 1
    cursor = browser.textCursor()
    cursor.setPosition(start)
    cursor.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
    browser.setTextCursor(cursor)
    browser.copy()
    assert QGuiApplication.clipboard().text() == "pital is Paris is ni"


def test_copying_a_message_with_code_leaves_out_the_code_blocks_label_and_link(qtbot) -> None:
    browser = TokenBrowser()
    qtbot.addWidget(browser)
    text = "Fix this:\n```python\ndef f(x):\n    return x + 1\n```\nplease"
    browser.setHtml(user_message_html(text).html)
    assert "Copy" in browser.document().toPlainText()
    # the code stands on lines of its own, as it was typed
    assert copy_all(browser) == "Fix this:\n\ndef f(x):\n    return x + 1\n\nplease"


def test_escape_stops_the_reply_and_up_edits_the_last_message(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4000))
    composer = gui.window.composer
    edit = composer.edit
    send_by_keyboard(qtbot, gui, "Count to a thousand")
    card = gui.window.chat_view.cards[-1]
    qtbot.waitUntil(lambda: card.text() != "", timeout=TIMEOUT)
    qtbot.keyClick(edit, Qt.Key.Key_Escape)  # stops, as Stop and Ctrl+. do
    wait_idle(qtbot, gui)
    user, reply = gui.controller.messages()
    assert reply.status == STOPPED and len(reply.content) < 4000

    qtbot.keyClicks(edit, "half-typed")
    qtbot.keyClick(edit, Qt.Key.Key_Up)  # in a box with text, Up is only a cursor key
    assert composer.editing_id is None and composer.text == "half-typed"
    edit.clear()
    qtbot.keyClick(edit, Qt.Key.Key_Up)  # in an empty box: edit the last message sent
    assert composer.editing_id == user.id and composer.text == "Count to a thousand"
    assert composer.edit_row.isVisible()
    qtbot.keyClick(edit, Qt.Key.Key_Escape)  # leaves the edit; nothing was sent
    assert composer.editing_id is None and composer.text == ""
    assert not composer.edit_row.isVisible()
    assert [m.id for m in gui.controller.messages()] == [user.id, reply.id]
    assert not gui.controller.generating
