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
