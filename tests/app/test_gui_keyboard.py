"""The window driven from the keyboard, and what it puts on the clipboard."""

from __future__ import annotations

from PySide6.QtGui import QGuiApplication, QTextCursor

from app.ui.chat_view import TokenBrowser
from app.ui.token_render import user_message_html
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
