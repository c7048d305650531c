"""The main window at the sizes people use: code that fits its card, a narrow window's
composer, legend and chat list, and Help ▸ About."""

from __future__ import annotations

import re

from app.store import COMPLETE
from engine.events import Step, Token, TokenKind
from tests.app.test_gui import fragments, kind_of, plain_settings

LONG = "print(os.path.join(dirpath, name), 'a long string that goes on and on past the edge')"
USER = f"Here is code:\n```python\ndef walk(root):\n    for name in files:\n        {LONG}\n```\nAdd type hints."
REPLY = (f"Sure:\n\n```python\ndef walk(root: str) -> None:\n    for name in files:\n"
         f"        {LONG}\n```\n\nThis prints every file.")


def seed_code_chat(gui) -> int:
    """A chat with code in the question and in a reply whose tokens carry their fates."""
    store = gui.store
    cid = store.create_conversation("Code").id
    store.add_message(cid, "user", USER)
    reply = store.begin_reply(cid, model="tiny", settings={})
    kinds = (TokenKind.ACCEPTED, TokenKind.REPLACED, TokenKind.TARGET, TokenKind.BONUS)
    for i, piece in enumerate(re.findall(r"\n|[^\S\n]*[^\s]+", REPLY)):
        store.append_step(reply.id, Step((Token(i, piece, kinds[i % 4], 0.5),)))
    store.finish_reply(reply.id, status=COMPLETE, text=REPLY)
    gui.controller.open_conversation(cid)
    return cid


def is_mono(fmt) -> bool:
    return any("Mono" in f or f == "monospace" for f in fmt.fontFamilies() or [])


def test_code_wider_than_the_card_wraps_in_both_views(qtbot, make_gui, tiny_pair,
                                                      screenshots_dir) -> None:
    gui = make_gui(plain_settings(tiny_pair[0]))
    window = gui.window
    seed_code_chat(gui)
    window.resize(700, 500)
    view = window.chat_view
    user, reply = view.cards

    def nothing_cut() -> bool:
        return all(c.isVisible() and c.width() < view.width()
                   and c.document().size().width() <= c.browser.viewport().width() + 1
                   for c in view.cards)

    for speculation in (False, True):
        view.set_show_speculation(speculation)
        qtbot.waitUntil(nothing_cut, timeout=5_000)
        for card in view.cards:
            assert LONG in card.document().toPlainText().replace("\u2029", "\n")
            assert card.browser.height() >= card.document().size().height()
        window.grab().save(str(screenshots_dir / f"code_700x500_{speculation=}.png"))

    # the question's code is a code block too (not ``` in a proportional font), with Copy
    assert user.browser.code_blocks == [USER.split("```python\n")[1].split("```")[0]]
    assert "```" not in user.document().toPlainText()
    assert any(is_mono(f) for t, f, _ in fragments(user.document()) if t == "def")
    # in speculation, the reply's code keeps its colours in a monospace font
    code = [(t, f) for t, f, _ in fragments(reply.document()) if t.strip() in ("def", "walk(root:")]
    assert code and all(is_mono(f) and kind_of(f) is not None for _, f in code)
    text = [f for t, f, _ in fragments(reply.document()) if t.strip() in ("Sure:", "prints")]
    assert text and not any(is_mono(f) for f in text)


def test_a_narrow_window_shrinks_the_chat_column_not_the_list(qtbot, make_gui, tiny_pair,
                                                             screenshots_dir) -> None:
    from app.ui.composer import PLACEHOLDER
    from app.ui.main_window import SIDEBAR_MIN_WIDTH

    gui = make_gui(plain_settings(tiny_pair[0]))
    window = gui.window
    cid = seed_code_chat(gui)
    title = "Write a Python function that walks a directory tree and prints every file"
    gui.controller.rename_conversation(cid, title)
    edit = window.composer.edit
    legend = window.chat_view.legend.label
    line = legend.fontMetrics().lineSpacing()

    def placeholder_fits() -> bool:
        room = edit.viewport().width() - 2 * edit.document().documentMargin()
        return edit.fontMetrics().horizontalAdvance(edit.placeholderText()) <= room

    window.resize(1280, 800)
    qtbot.waitUntil(lambda: window.width() == 1280 and legend.isVisible())
    assert edit.placeholderText() == PLACEHOLDER and placeholder_fits()
    assert legend.height() < 2 * line  # every chip on one line beside the check boxes
    wide_column = window.chat_view.width()

    window.resize(700, 500)
    qtbot.waitUntil(lambda: window.width() < 1000 and window.chat_view.width() < wide_column)
    qtbot.waitUntil(lambda: legend.height() < 3 * line, timeout=5_000)
    window.grab().save(str(screenshots_dir / "narrow_window.png"))
    assert window.width() <= 800  # a long title does not hold the window wide
    assert window.sidebar.width() >= SIDEBAR_MIN_WIDTH
    assert window.title_label.toolTip() == title  # cut short on screen, whole on hover
    assert placeholder_fits() and edit.placeholderText().startswith("Ask anything")
    # the legend wraps a few chips per line on a row of its own (it stacked one per line)
    assert legend.width() > 3 * window.chat_view.legend.one_line_width() // 5


def test_help_about_shows_the_version_model_and_mlx(qtbot, make_gui, tiny_pair,
                                                    screenshots_dir) -> None:
    import tomllib
    from pathlib import Path

    import mlx.core as mx
    from PySide6.QtGui import QAction, QTextDocumentFragment

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    version = tomllib.loads(pyproject.read_text())["project"]["version"]
    gui = make_gui(plain_settings(tiny_pair[0]))
    window = gui.window
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=60_000)
    help_menu = next(a.menu() for a in window.menuBar().actions() if a.text() == "&Help")
    assert window.about_action in help_menu.actions()
    assert window.about_action.text() == "About Understudy"
    assert window.about_action.menuRole() == QAction.MenuRole.AboutRole
    window.about_action.trigger()
    box = window.about_box
    qtbot.waitUntil(box.isVisible)
    assert f"Version {version}" in box.text()
    details = QTextDocumentFragment.fromHtml(box.informativeText()).toPlainText()
    assert f"Model: {gui.controller.model.name}" in details
    assert f"MLX {mx.__version__}" in details.splitlines() and "speculative decoding" in details
    box.grab().save(str(screenshots_dir / "about.png"))
    box.accept()


def test_a_reply_cut_short_keeps_its_actions_inside_a_narrow_column(qtbot, make_gui, tiny_pair,
                                                                   screenshots_dir) -> None:
    """Copy, Continue and Regenerate beside "Assistant" were wider than the column of an
    800 px window: the chat scrolled sideways. They move to a row of their own instead."""
    from app.store import STOPPED

    gui = make_gui(plain_settings(tiny_pair[0]))
    window = gui.window
    store = gui.store
    cid = store.create_conversation("Cut").id
    store.add_message(cid, "user", "Write python code to add two numbers.")
    reply = store.begin_reply(cid, model="tiny", settings={})
    store.finish_reply(reply.id, status=STOPPED, text="def add(a, b):")
    gui.controller.open_conversation(cid)
    view = window.chat_view
    card = view.cards[-1]
    qtbot.waitUntil(lambda: card.continue_button.isVisibleTo(window))

    window.resize(800, 780)
    scroll = view.scroll

    def fits() -> bool:
        return (view.isVisible() and scroll.widget().width() <= scroll.viewport().width()
                and card.regenerate_button.geometry().right() < card.width())

    qtbot.waitUntil(fits, timeout=5_000)
    qtbot.waitUntil(lambda: view.legend_row == 1, timeout=5_000)
    qtbot.wait(50)  # the layout applies the move on the next turn: settled, for the picture
    window.grab().save(str(screenshots_dir / "cut_reply_800.png"))
    assert scroll.horizontalScrollBar().maximum() == 0
    assert card.actions_row == 1  # below the role: beside it they did not fit
    assert card.regenerate_button.mapTo(card, card.regenerate_button.rect().topLeft()).y() \
        > card.role_label.geometry().bottom() - 1

    window.resize(1400, 780)  # room again: back beside the role
    qtbot.waitUntil(lambda: card.actions_row == 0, timeout=5_000)
    assert scroll.horizontalScrollBar().maximum() == 0
