"""The window driven from the keyboard, and what it puts on the clipboard."""

from __future__ import annotations

from collections import Counter

import pytest
from PySide6.QtCore import QPoint, QPointF, QRect, Qt, QTimer
from PySide6.QtGui import QColor, QGuiApplication, QPalette, QTextCursor, QWheelEvent
from PySide6.QtWidgets import QApplication, QMenu, QMessageBox

from app.store import STOPPED
from app.ui.chat_view import TokenBrowser
from app.ui.theme import apply_theme
from app.ui.token_render import user_message_html
from engine.events import Step, Token, TokenKind
from tests.app.test_gui import TIMEOUT, plain_settings, send_by_keyboard, spec_settings, wait_idle
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


def code_links(browser: TokenBrowser) -> list[tuple[str, int]]:
    """Each "Copy" link in the box: its target and where its text starts."""
    links = []
    block = browser.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.charFormat().anchorHref() and frag.text() == "Copy":
                links.append((frag.charFormat().anchorHref(), frag.position()))
            it += 1
        block = block.next()
    return links


def click_at(qtbot, browser: TokenBrowser, position: int) -> None:
    cursor = QTextCursor(browser.document())
    cursor.setPosition(position + 1)
    point = browser.cursorRect(cursor).center()
    qtbot.mouseClick(browser.viewport(), Qt.MouseButton.LeftButton, pos=point)


def test_code_blocks_in_the_coloured_reply_have_a_copy_link_that_copies_the_code_alone(
        qtbot, screenshots_dir) -> None:
    def tok(i: int, text: str, kind: TokenKind = TokenKind.ACCEPTED) -> Token:
        return Token(i, text, kind, 0.5)

    rejected = TokenKind.REJECTED
    steps = [
        Step((tok(1, "Try:\n```"), tok(2, "py"), tok(3, "thon\ndef"))),  # a fence line ends mid-token
        Step((tok(4, " f():"), tok(5, " bad", rejected), tok(6, "\n    return"),
              tok(7, " 1\n"))),
        Step((tok(8, "```\nand\n~~~\n"), tok(9, "x = 2"))),  # the second block still open
    ]
    browser = TokenBrowser()
    qtbot.addWidget(browser)
    browser.resize(560, 60)
    browser.show()
    browser.show_reply(steps[:2], "", speculation=True, show_rejected=True, dark=False)
    links = code_links(browser)
    assert [href for href, _ in links] == ["copy-code:0"]
    click_at(qtbot, browser, links[0][1])  # a block still streaming copies what it has
    assert QGuiApplication.clipboard().text() == "def f():\n    return 1\n"

    browser.show_reply(steps, "", speculation=True, show_rejected=True, dark=False)  # streams on
    assert "bad" in browser.document().toPlainText()  # the ghost is shown, never copied
    links = code_links(browser)
    assert [href for href, _ in links] == ["copy-code:0", "copy-code:1"]
    with qtbot.waitSignal(browser.code_copied):
        click_at(qtbot, browser, links[0][1])
    assert QGuiApplication.clipboard().text() == "def f():\n    return 1\n"
    click_at(qtbot, browser, links[1][1])
    assert QGuiApplication.clipboard().text() == "x = 2"
    browser.grab().save(str(screenshots_dir / "coloured_code_copy.png"))
    # right-click on the link: Copy Code, not Qt's Copy Link Location ("copy-code:1")
    cursor = QTextCursor(browser.document())
    cursor.setPosition(links[1][1] + 1)
    menu = browser.context_menu(browser.cursorRect(cursor).center())
    names = [a.text() for a in menu.actions() if not a.isSeparator()]
    qt_names = [a.text() for a in browser.createStandardContextMenu(
        browser.cursorRect(cursor).center()).actions()]
    assert "Copy &Link Location" in qt_names  # the control: what Qt offers there
    assert names[0] == "Copy Code" and not any("Link" in n for n in names), names
    QGuiApplication.clipboard().clear()
    menu.actions()[0].trigger()
    assert QGuiApplication.clipboard().text() == "x = 2"
    # elsewhere the menu is Qt's own
    plain_menu = browser.context_menu(QPoint(2, 2))
    assert "Copy Code" not in [a.text() for a in plain_menu.actions()]
    # the link ends the fence's line, and a selection copied leaves it out
    plain = browser.document().toPlainText()
    assert "```python  Copy\ndef f():" in plain
    assert copy_all(browser) == "".join(t.text for s in steps for t in s.tokens
                                        if t.kind is not rejected)


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


def two_chats(qtbot, gui) -> tuple[int, int]:
    """Two chats, "Python decorators" and the newer "Sourdough bread" (open)."""
    ids = []
    for text in ("Python decorators", "Sourdough bread"):
        gui.controller.new_conversation()
        gui.controller.send(text)
        wait_idle(qtbot, gui)
        ids.append(gui.controller.conversation_id)
    return ids[0], ids[1]


def answer_next_box(qtbot, *, check, key: Qt.Key, button=None) -> None:
    """When the next modal box opens, run `check` on it and press `key` (on `button`)."""

    def answer() -> None:
        box = QApplication.activeModalWidget()
        assert isinstance(box, QMessageBox)
        check(box)
        qtbot.keyClick(box.button(button) if button is not None else box, key)

    QTimer.singleShot(0, answer)


def test_chats_are_searched_opened_renamed_and_deleted_from_the_keyboard(
        qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
    python, bread = two_chats(qtbot, gui)
    window, sidebar = gui.window, gui.window.sidebar
    edit, lst = window.composer.edit, sidebar.list_view
    # a click opens a chat and hands the keyboard to the composer (the arrows keep it)
    qtbot.mouseClick(lst.viewport(), Qt.MouseButton.LeftButton,
                     pos=lst.visualRect(sidebar.model.index(1)).center())
    assert gui.controller.conversation_id == python and QApplication.focusWidget() is edit
    gui.controller.open_conversation(bread)

    # Ctrl+F searches; Enter opens the first match and hands the keyboard back
    qtbot.keyClick(edit, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    assert QApplication.focusWidget() is sidebar.search_edit
    qtbot.keyClicks(sidebar.search_edit, "python")
    qtbot.keyClick(sidebar.search_edit, Qt.Key.Key_Return)
    assert gui.controller.conversation_id == python
    assert QApplication.focusWidget() is edit
    # Escape in the search field clears it and goes back to the composer
    qtbot.keyClick(edit, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    qtbot.keyClick(sidebar.search_edit, Qt.Key.Key_Escape)
    assert sidebar.search_edit.text() == "" and sidebar.model.rowCount() == 2
    assert QApplication.focusWidget() is edit

    # Down goes from the search field to the list; the arrows open what they land on
    qtbot.keyClick(edit, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    qtbot.keyClick(sidebar.search_edit, Qt.Key.Key_Down)
    assert QApplication.focusWidget() is lst and gui.controller.conversation_id == bread
    qtbot.keyClick(lst, Qt.Key.Key_Down)
    assert gui.controller.conversation_id == python
    assert window.chat_view.cards[0].message.content == "Python decorators"
    qtbot.keyClick(lst, Qt.Key.Key_Up)
    assert gui.controller.conversation_id == bread

    # F2 renames in place; Enter keeps the new title and the keyboard stays in the list
    qtbot.keyClick(lst, Qt.Key.Key_F2)
    qtbot.keyClicks(QApplication.focusWidget(), "Bread")
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: gui.store.conversation(bread).title == "Bread")  # (queued)
    assert QApplication.focusWidget() is lst
    # Chat ▸ Rename Chat… from the composer: the keyboard comes back to the composer
    edit.setFocus()
    window._rename_current()
    qtbot.keyClicks(QApplication.focusWidget(), "Rye bread")
    qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: gui.store.conversation(bread).title == "Rye bread")
    assert window.title_label.text() == "Rye bread"
    assert QApplication.focusWidget() is edit

    # Delete asks first, and Enter is the safe answer
    def named_buttons(box: QMessageBox) -> None:
        assert box.defaultButton() is box.button(QMessageBox.StandardButton.Cancel)
        assert box.button(QMessageBox.StandardButton.Yes).text() == "Delete"
        assert "Rye bread" in box.text()

    lst.setFocus()
    answer_next_box(qtbot, check=named_buttons, key=Qt.Key.Key_Return)
    qtbot.keyClick(lst, Qt.Key.Key_Delete)
    assert gui.store.conversation(bread) is not None
    answer_next_box(qtbot, check=named_buttons, key=Qt.Key.Key_Space,
                    button=QMessageBox.StandardButton.Yes)
    qtbot.keyClick(lst, Qt.Key.Key_Backspace)
    assert gui.store.conversation(bread) is None
    assert sidebar.model.rowCount() == 1


def test_zoom_keys_size_the_conversations_text_and_are_kept(qtbot, make_gui, tiny_pair) -> None:
    settings = plain_settings(tiny_pair[0], max_tokens=4)
    gui = make_gui(settings)
    window, edit = gui.window, gui.window.composer.edit
    send_by_keyboard(qtbot, gui, "Hello")
    wait_idle(qtbot, gui)
    card = window.chat_view.cards[-1]
    base = window.font().pointSizeF()

    def size(widget) -> float:
        return widget.font().pointSizeF() / base

    def doc_size() -> float:
        return card.document().defaultFont().pointSizeF() / base

    ctrl = Qt.KeyboardModifier.ControlModifier
    qtbot.keyClick(edit, Qt.Key.Key_Plus, ctrl)
    assert doc_size() == pytest.approx(1.1) and size(edit) == pytest.approx(1.1)
    qtbot.keyClick(edit, Qt.Key.Key_Equal, ctrl)  # the unshifted key works too
    assert doc_size() == pytest.approx(1.25)
    assert size(window.comparison_view.plain.browser) == pytest.approx(1.25)
    assert window.settings_panel.font().pointSizeF() == base  # the side panel keeps its size
    height = card.browser.height()
    send_by_keyboard(qtbot, gui, "Again")  # new cards are as large
    wait_idle(qtbot, gui)
    assert window.chat_view.cards[-1].document().defaultFont().pointSizeF() / base == \
        pytest.approx(1.25)
    for _ in range(10):
        qtbot.keyClick(edit, Qt.Key.Key_Minus, ctrl)
    assert doc_size() == pytest.approx(0.8) and not window.zoom_out_action.isEnabled()
    assert card.browser.height() < height  # the card shrank with its text
    qtbot.keyClick(edit, Qt.Key.Key_0, ctrl)
    assert doc_size() == pytest.approx(1.0) and not window.actual_size_action.isEnabled()

    qtbot.keyClick(edit, Qt.Key.Key_Plus, ctrl)
    window.close()  # saves the size; the next window opens with it
    again = make_gui(settings)
    assert again.window.zoom == pytest.approx(1.1)
    assert again.window.composer.edit.font().pointSizeF() / base == pytest.approx(1.1)


def test_windows_open_with_the_keyboard_in_place_and_escape_closes_them(
        qtbot, make_gui, tiny_pair, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the Models panel searches nothing
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
    window = gui.window

    panel = window.show_models()
    qtbot.waitUntil(lambda: QApplication.focusWidget() is panel.search_edit)
    qtbot.keyClick(panel.search_edit, Qt.Key.Key_Escape)
    assert not panel.isVisible()
    # Ctrl/⌘+W closes the front window, not only the main one (which stays open)
    for show in (window.show_models, window.show_hub_settings, window.show_server_panel,
                 window.show_train_drafter):
        shown = show() or window.train_dialog
        qtbot.waitUntil(lambda shown=shown: shown.isActiveWindow())
        qtbot.keyClick(QApplication.focusWidget() or shown, Qt.Key.Key_W,
                       Qt.KeyboardModifier.ControlModifier)
        assert not shown.isVisible() and window.isVisible()

    window.show_train_drafter()
    train = window.train_dialog
    qtbot.waitUntil(train.isVisible)
    qtbot.keyClick(train.minutes, Qt.Key.Key_Escape)  # from its field, as from a dialog's
    assert not train.isVisible()

    window.show_diagnostics()
    diagnostics = window.diagnostics_dialog
    qtbot.waitUntil(diagnostics.isVisible)
    qtbot.keyClick(diagnostics.report, Qt.Key.Key_Escape)
    assert not diagnostics.isVisible()
    qtbot.waitUntil(lambda: diagnostics.recheck_button.isEnabled(), timeout=TIMEOUT)  # (ends)


def dark_palette() -> QPalette:
    """A dark palette as a desktop's dark mode gives (the offscreen platform has none)."""
    pal = QPalette()
    role = QPalette.ColorRole
    for r, color in ((role.Window, "#2b2b2b"), (role.WindowText, "#e6e6e6"),
                     (role.Base, "#1e1e1e"), (role.AlternateBase, "#323232"),
                     (role.Text, "#e6e6e6"), (role.Button, "#3a3a3a"),
                     (role.ButtonText, "#e6e6e6"), (role.Mid, "#555555"),
                     (role.Midlight, "#444444"), (role.PlaceholderText, "#8a8a8a")):
        pal.setColor(r, QColor(color))
    return pal


def contrast(a: QColor, b: QColor) -> float:
    """WCAG's contrast ratio of two colours."""

    def lum(c: QColor) -> float:
        def ch(v: float) -> float:
            return v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4
        return 0.2126 * ch(c.redF()) + 0.7152 * ch(c.greenF()) + 0.0722 * ch(c.blueF())

    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def glyph_contrast(widget) -> float:
    """The strongest contrast between a pixel of `widget` as its window shows it and its
    background (the colour most of its pixels inside its frame have)."""
    window = widget.window()
    image = window.grab(QRect(widget.mapTo(window, QPoint(0, 0)), widget.size())).toImage()
    pixels = [image.pixel(x, y) for x in range(3, image.width() - 3)
              for y in range(3, image.height() - 3)]
    background = QColor.fromRgb(Counter(pixels).most_common(1)[0][0])
    return max(contrast(QColor.fromRgb(p), background) for p in set(pixels))


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
def test_the_error_banner_and_stop_button_read_in_light_and_dark(
        qtbot, make_gui, tiny_pair, dark, screenshots_dir) -> None:
    app = QApplication.instance()
    before = app.palette()
    if dark:
        app.setPalette(dark_palette())
    try:
        gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
        window = gui.window
        window.banner.show_message("Could not load model: the file is damaged")
        qtbot.waitUntil(window.banner.close_button.isVisible)
        assert window.banner.close_button.accessibleName() == "Dismiss message"
        assert glyph_contrast(window.banner.close_button) >= 3.0  # the ✕ was invisible
        assert glyph_contrast(window.banner.label) >= 4.5
        window.composer.stop_button.show()
        assert glyph_contrast(window.composer.stop_button) >= 3.0
        window.composer.stop_button.hide()
        window.grab().save(str(screenshots_dir / f"banner_{'dark' if dark else 'light'}.png"))
    finally:
        app.setPalette(before)
        apply_theme(app)


def test_controls_that_show_no_words_have_names_for_a_screen_reader(qtbot, make_gui,
                                                                    tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=8))
    send_by_keyboard(qtbot, gui, "Hello")
    wait_idle(qtbot, gui)
    user, reply = gui.window.chat_view.cards
    assert user.copy_button.accessibleName() == "Copy your message"  # one "Copy" of many
    assert reply.regenerate_button.accessibleName() == "Regenerate the assistant's reply"
    assert reply.browser.accessibleName() == "The assistant's reply"
    spark = gui.window.gauge.sparkline  # a drawing: its name and what it shows
    assert spark.accessibleName() == "Speed over the reply"
    assert spark.accessibleDescription().startswith("tokens/s from ")


def test_tab_goes_through_the_window_in_reading_order(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=8))
    window, sidebar, chat, composer = (gui.window, gui.window.sidebar, gui.window.chat_view,
                                       gui.window.composer)
    send_by_keyboard(qtbot, gui, "Hello")
    wait_idle(qtbot, gui)
    user, reply = chat.cards
    sidebar.new_button.setFocus()
    seen = [sidebar.new_button]
    for _ in range(80):
        qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab)
        if QApplication.focusWidget() is sidebar.new_button:
            break  # round the window and back: nothing held the keyboard
        seen.append(QApplication.focusWidget())
    else:
        pytest.fail(f"Tab never came back to the chat list; stuck at {seen[-3:]}")
    expected = [sidebar.new_button, sidebar.search_edit, sidebar.list_view,
                window.compare_button, chat.rejected_box, chat.speculation_box, chat.scroll,
                user.copy_button, user.browser, reply.copy_button, reply.regenerate_button,
                reply.browser, composer.edit, composer.send_button,
                window.settings_panel.system_prompt]
    at = [seen.index(w) if w in seen else -1 for w in expected]
    assert -1 not in at, [w for w, i in zip(expected, at, strict=True) if i < 0]
    assert at == sorted(at)  # in this order
    # the side panel comes after the composer, and ends the round
    assert seen.index(window.settings_panel.temperature) > at[expected.index(composer.edit)]
    assert seen[-1] is window.settings_panel.system_prompt


def test_copying_from_the_keyboard_says_it_copied(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=8))
    window = gui.window
    window.composer.set_text("Fix:\n```python\nprint(1)\n```")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    wait_idle(qtbot, gui)
    user, reply = window.chat_view.cards

    qtbot.keyClick(reply.copy_button, Qt.Key.Key_Space)
    assert QGuiApplication.clipboard().text() == reply.message.content
    assert reply.copy_button.text() == "Copied"
    assert window.statusBar().currentMessage() == "Message copied"
    qtbot.waitUntil(lambda: reply.copy_button.text() == "Copy", timeout=3000)

    # a code block's Copy link: Tab reaches it in the message's text, Enter follows it
    user.browser.setFocus()
    qtbot.keyClick(user.browser, Qt.Key.Key_Tab)
    assert user.browser.textCursor().selectedText() == "Copy"
    qtbot.keyClick(user.browser, Qt.Key.Key_Return)
    assert QGuiApplication.clipboard().text() == "print(1)\n"
    assert window.statusBar().currentMessage() == "Code copied"


def test_page_keys_in_the_composer_scroll_the_conversation(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=200))
    window, edit = gui.window, gui.window.composer.edit
    window.resize(900, 500)
    for text in ("One", "Two"):
        send_by_keyboard(qtbot, gui, text)
        wait_idle(qtbot, gui)
    bar = window.chat_view.scroll.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > bar.pageStep() and bar.value() == bar.maximum())
    bottom = bar.maximum()
    qtbot.keyClick(edit, Qt.Key.Key_PageUp)
    assert bar.value() == bottom - bar.pageStep()
    qtbot.keyClick(edit, Qt.Key.Key_PageDown)
    assert bar.value() == bottom
    assert QApplication.focusWidget() is edit  # the keyboard stayed in the box


def test_the_edit_menu_acts_on_what_has_the_keyboard(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=8))
    window = gui.window
    send_by_keyboard(qtbot, gui, "Hello")
    wait_idle(qtbot, gui)
    items = window.edit_actions.actions
    edit = window.composer.edit
    edit.setFocus()
    qtbot.keyClicks(edit, "draft text")
    assert all(a.isEnabled() for a in items.values())
    items["selectAll"].trigger()
    items["cut"].trigger()
    assert edit.toPlainText() == "" and QGuiApplication.clipboard().text() == "draft text"
    items["paste"].trigger()
    items["paste"].trigger()
    assert edit.toPlainText() == "draft textdraft text"
    items["undo"].trigger()
    assert edit.toPlainText() == "draft text"

    reply = window.chat_view.cards[-1].browser  # a message: Copy and Select All only
    reply.setFocus()
    assert [m for m, a in items.items() if a.isEnabled()] == ["copy", "selectAll"]
    items["selectAll"].trigger()
    items["copy"].trigger()
    assert QGuiApplication.clipboard().text() == gui.controller.messages()[-1].content
    window.sidebar.list_view.setFocus()  # no text here: nothing to do
    assert not any(a.isEnabled() for a in items.values())
    assert "&Edit" in [m.title() for m in window.menuBar().findChildren(QMenu)]


def test_ctrl_wheel_over_a_message_zooms_the_whole_conversation(qtbot, make_gui,
                                                                  tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=8))
    window = gui.window
    send_by_keyboard(qtbot, gui, "Hello")
    wait_idle(qtbot, gui)
    user, reply = window.chat_view.cards
    viewport = reply.browser.viewport()
    center = QPointF(viewport.rect().center())
    wheel = QWheelEvent(center, QPointF(viewport.mapToGlobal(center.toPoint())), QPoint(),
                        QPoint(0, 120), Qt.MouseButton.NoButton,
                        Qt.KeyboardModifier.ControlModifier, Qt.ScrollPhase.NoScrollPhase,
                        False)
    QApplication.sendEvent(viewport, wheel)
    assert window.zoom == pytest.approx(1.1)
    sizes = [c.browser.font().pointSizeF() for c in (user, reply)]
    assert sizes == pytest.approx([window.font().pointSizeF() * 1.1] * 2)  # every message


def test_page_keys_scroll_the_races_panes_in_the_comparison(qtbot, make_gui, tiny_pair) -> None:
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft, max_tokens=300))
    window, edit = gui.window, gui.window.composer.edit
    window.resize(900, 420)
    window.compare_action.trigger()
    with qtbot.waitSignal(gui.controller.comparison_finished, timeout=TIMEOUT):
        send_by_keyboard(qtbot, gui, "Count")
    wait_idle(qtbot, gui)
    bars = [p.browser.verticalScrollBar()
            for p in (window.comparison_view.speculative, window.comparison_view.plain)]
    qtbot.waitUntil(lambda: all(b.maximum() > b.pageStep() for b in bars))
    for bar in bars:
        bar.setValue(bar.maximum())
    qtbot.keyClick(edit, Qt.Key.Key_PageUp)
    assert [b.value() for b in bars] == [b.maximum() - b.pageStep() for b in bars]
