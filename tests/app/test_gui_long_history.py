"""A history used for months: a conversation of many long replies opens at its newest
messages, at once, and its earlier ones come a batch at a time."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from app.store import COMPLETE, Message, Store
from app.ui.chat_paging import batch_start
from app.ui.chat_view import TokenBrowser
from app.ui.theme import widget_is_dark
from app.ui.token_render import markdown_refresh_ms
from engine.events import Stats, Step, Token, TokenKind
from tests.app.test_gui import (
    TIMEOUT,
    fragments,
    kind_of,
    plain_settings,
    spec_settings,
    wait_idle,
)

TURNS = 60
STEPS = 20  # per reply, of 100 characters each: a reply of 2,000


def reply_steps(turn: int) -> list[Step]:
    """A reply as the engine stores it: steps of drafted tokens, most accepted, then a
    rejected ghost and the target's own token in its place."""
    steps = []
    for _ in range(STEPS):
        words = [Token(1000 + i, f" {turn:02d}{i:02d}", TokenKind.ACCEPTED, 0.9)
                 for i in range(19)]
        steps.append(Step((*words, Token(7, "zz", TokenKind.REJECTED, 0.1),
                           Token(8, " end.", TokenKind.REPLACED, 0.8)),
                          n_drafted=20, n_accepted=19, k=20, drafter="ngram"))
    return steps


def write_long_chat(path: Path, *, dropped: int = 0) -> tuple[int, list[int]]:
    """A conversation of TURNS exchanges through the real store; returns its id and its
    message ids, oldest first. The last reply left `dropped` messages out of its prompt."""
    store = Store(path)
    conv = store.create_conversation("Months of work")
    ids = []
    for turn in range(TURNS):
        ids.append(store.add_message(conv.id, "user", f"Question {turn}").id)
        reply = store.begin_reply(conv.id, model="demo", settings={})
        for step in reply_steps(turn):
            store.append_step(reply.id, step)
        store.finish_reply(reply.id, status=COMPLETE,
                           stats=Stats(generated_tokens=100, decode_s=1.0, target_passes=20,
                                       finish_reason="eos",
                                       dropped_messages=dropped if turn == TURNS - 1 else 0))
        ids.append(reply.id)
    store.close()
    return conv.id, ids


def test_a_batch_is_the_newest_messages_that_fit_and_keeps_a_reply_with_its_question():
    def msg(i: int, role: str, n: int) -> Message:
        return Message(i, 1, i, role, "x" * n)

    msgs = [msg(0, "user", 10), msg(1, "assistant", 500), msg(2, "user", 10),
            msg(3, "assistant", 500), msg(4, "user", 10), msg(5, "assistant", 500)]
    assert batch_start(msgs, 6, chars=1_100) == 2  # two exchanges fit
    assert batch_start(msgs, 6, chars=600) == 4  # one: the reply brings its question
    assert batch_start(msgs, 6, chars=100) == 4  # never less than the newest exchange
    assert batch_start(msgs, 6, chars=10_000, count=3) == 3  # at most `count` messages
    assert batch_start(msgs, 2, chars=10_000) == 0
    assert batch_start(msgs, 0) == 0


def test_a_long_conversation_opens_at_its_newest_messages(qtbot, make_gui, tiny_pair, tmp_path,
                                                          monkeypatch, screenshots_dir) -> None:
    db = tmp_path / "history.sqlite3"
    conversation, ids = write_long_chat(db)
    read: list[int] = []
    real_steps = Store.steps

    def counting_steps(self: Store, message_id: int):
        read.append(message_id)
        return real_steps(self, message_id)

    monkeypatch.setattr(Store, "steps", counting_steps)
    gui = make_gui(plain_settings(tiny_pair[0]), db)
    gui.window.resize(1100, 800)
    view = gui.window.chat_view
    assert gui.controller.conversation_id == conversation

    # the newest 40k characters: 19 replies of 2,000 and their questions
    assert len(gui.store.messages(conversation, with_steps=False)[1].content) == 2_000
    shown = [c.message_id for c in view.cards]
    assert shown == ids[-38:]
    assert [m.id for m in view.earlier] == ids[:-38]
    # only the replies shown had their token fates read
    assert sorted(read) == sorted(ids[-38:][1::2])
    assert all(len(c.steps) == STEPS for c in view.cards[1::2])
    assert view.earlier_button.isVisible()
    assert view.earlier_button.text() == "Show Earlier Messages (82 more)"

    # the user scrolls up and asks for more: the message they were reading stays put
    bar = view.scroll.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0)
    bar.setValue(0)
    first = view.cards[0]
    viewport = view.scroll.viewport()

    def top_of(card) -> int:
        return card.mapTo(viewport, card.rect().topLeft()).y()

    before, in_column = top_of(first), first.y()
    view.earlier_button.click()
    assert [c.message_id for c in view.cards] == ids[-76:]
    qtbot.waitUntil(lambda: first.y() > in_column)  # laid out below the new cards
    qtbot.waitUntil(lambda: top_of(first) == before)
    assert bar.value() > 0
    counts = []
    while view.earlier_button.isVisible():
        view.earlier_button.click()
        counts.append(len(view.cards))
    assert counts == [114, 120]
    assert [c.message_id for c in view.cards] == ids
    assert not view.earlier
    assert sorted(read) == sorted(ids[1::2])

    # another chat and back: the long one opens at its newest again
    gui.controller.new_conversation()
    assert not view.cards and not view.earlier_button.isVisible()
    gui.controller.open_conversation(conversation)
    assert [c.message_id for c in view.cards] == ids[-38:]
    gui.window.grab().save(str(screenshots_dir / "long_chat_opened.png"))
    bar.setValue(0)
    qtbot.waitUntil(lambda: bar.value() == 0)
    gui.window.grab().save(str(screenshots_dir / "long_chat_earlier_button.png"))


def test_show_earlier_messages_is_reached_with_tab_and_pressed_from_the_keyboard(
        qtbot, make_gui, tiny_pair, tmp_path) -> None:
    """The button was not in the window's Tab order, so a long chat's earlier messages
    could only be reached with the mouse; the cards it brought in were not either."""
    conversation, ids = write_long_chat(tmp_path / "history.sqlite3")
    gui = make_gui(plain_settings(tiny_pair[0]), tmp_path / "history.sqlite3")
    view = gui.window.chat_view
    button = view.earlier_button
    assert button.accessibleName() == "Show earlier messages"
    assert button.accessibleDescription() == "82 earlier messages are not shown"

    gui.window.activateWindow()  # the keyboard goes to the active window
    qtbot.waitUntil(gui.window.isActiveWindow)
    view.speculation_box.setFocus()
    seen = []
    for _ in range(4):
        qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab)
        seen.append(QApplication.focusWidget())
    # after the conversation's scroll area, before the oldest message shown
    assert seen[:3] == [view.scroll, button, view.cards[0].focus_order()[0]]

    first_shown = view.cards[0]
    button.setFocus()
    qtbot.keyClick(button, Qt.Key.Key_Return)
    assert [c.message_id for c in view.cards] == ids[-76:]
    assert button.hasFocus()  # ready to be pressed again
    assert button.accessibleDescription() == "44 earlier messages are not shown"
    # the cards it brought in come next in the Tab order, oldest first, then the others
    order = [w for card in view.cards for w in card.focus_order() if w.isVisible()]
    qtbot.keyClick(button, Qt.Key.Key_Tab)
    assert QApplication.focusWidget() is order[0]
    for expected in order[1:]:
        qtbot.keyClick(QApplication.focusWidget(), Qt.Key.Key_Tab)
        assert QApplication.focusWidget() is expected
        if expected is first_shown.focus_order()[0]:
            break

    button.setFocus()
    qtbot.keyClick(button, Qt.Key.Key_Space)
    assert len(view.cards) == 114
    qtbot.keyClick(button, Qt.Key.Key_Space)
    assert [c.message_id for c in view.cards] == ids and not button.isVisible()
    # the button is gone: the keyboard is on the oldest message, not thrown elsewhere
    assert QApplication.focusWidget() is view.cards[0].focus_order()[0]
    bar = view.scroll.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.value() == 0)  # and in view


def test_the_context_divider_counts_the_messages_not_shown(qtbot, make_gui, tiny_pair,
                                                           tmp_path) -> None:
    """`dropped_messages` counts from the conversation's first message, shown or not."""
    db = tmp_path / "history.sqlite3"
    _, ids = write_long_chat(db, dropped=2 * TURNS - 38 + 6)
    gui = make_gui(plain_settings(tiny_pair[0]), db)
    view = gui.window.chat_view
    layout = view.column_layout
    assert view.context_divider.isVisibleTo(view)
    # the model read from the fourth exchange shown on
    assert layout.indexOf(view.context_divider) == layout.indexOf(view.card_for(ids[-32])) - 1

    gui.close()
    db.unlink()
    _, ids = write_long_chat(db, dropped=10)  # the cut lies among the messages not shown
    again = make_gui(plain_settings(tiny_pair[0]), db)
    assert not again.window.chat_view.context_divider.isVisibleTo(again.window.chat_view)
    again.window.chat_view.earlier_button.click()
    again.window.chat_view.earlier_button.click()
    view = again.window.chat_view
    assert view.context_divider.isVisibleTo(view)
    assert (view.column_layout.indexOf(view.context_divider)
            == view.column_layout.indexOf(view.card_for(ids[10])) - 1)


def test_a_streaming_reply_writes_each_step_once(qtbot, make_gui, tiny_pair) -> None:
    """Each refresh adds the new steps' tokens to the card: a reply of n steps is written
    as HTML n times in all, not once per step in full (quadratic in its length), and
    reads exactly as the reply rendered whole."""
    gui = make_gui(spec_settings(*tiny_pair, max_tokens=120))
    gui.controller.send("Write at length")
    card = gui.window.chat_view.cards[-1]
    qtbot.waitUntil(lambda: len(card.steps) >= 10, timeout=TIMEOUT)
    wait_idle(qtbot, gui)
    reply = gui.store.messages(gui.controller.conversation_id)[-1]
    assert len(reply.steps) > 30
    assert card.browser.steps_rendered == len(reply.steps)
    whole = TokenBrowser()
    qtbot.addWidget(whole)
    whole.show_reply(reply.steps, reply.content, speculation=True, show_rejected=True,
                     dark=widget_is_dark(gui.window.chat_view))
    assert list(fragments(card.document())) == list(fragments(whole.document()))
    kinds = {kind_of(f) for _, f, _ in fragments(card.document())}
    assert {TokenKind.REJECTED, TokenKind.REPLACED} <= kinds

    # a view toggle renders the reply again, in full, once
    gui.window.chat_view.set_show_rejected(False)
    assert card.browser.steps_rendered == 2 * len(reply.steps)


def test_a_long_markdown_reply_is_refreshed_less_often_than_a_short_one(
        qtbot, make_gui, tiny_pair, tmp_path) -> None:
    """Shown as Markdown, a streaming reply is rendered whole at each refresh, so the wait
    between refreshes grows with its length; its coloured tokens need no wait."""
    assert markdown_refresh_ms(500) == 5
    assert markdown_refresh_ms(30_000) == 300
    assert markdown_refresh_ms(10**6) == 400  # at most
    db = tmp_path / "history.sqlite3"
    write_long_chat(db)
    gui = make_gui(plain_settings(tiny_pair[0]), db)
    view = gui.window.chat_view
    reply = view.cards[-1]
    assert view.refresh_delay_ms(reply) == 0
    view.set_show_speculation(False)
    assert view.refresh_delay_ms(reply) == 20  # 2,000 characters
    assert view.refresh_delay_ms(view.cards[-2]) == 0  # "Question 59"


def test_renaming_or_deleting_far_down_a_long_chat_list_keeps_the_list_in_place(
        qtbot, make_gui, tiny_pair, tmp_path) -> None:
    db = tmp_path / "history.sqlite3"
    store = Store(db)
    for i in range(120):
        conv = store.create_conversation(f"Chat {i}")
        store.add_message(conv.id, "user", f"question {i}")
    store.close()
    gui = make_gui(plain_settings(tiny_pair[0]), db)
    gui.window.resize(1000, 600)
    sidebar = gui.window.sidebar
    view, model = sidebar.list_view, sidebar.model
    assert model.conversation_at(0).id == gui.controller.conversation_id  # the newest, open
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0)
    bar.setValue(bar.maximum())  # down among the oldest chats

    def top_row() -> int:
        return view.indexAt(view.viewport().rect().topLeft()).row()

    first = top_row()
    assert first > 50
    row = model.rowCount() - 2
    model.setData(model.index(row), "Old chat, renamed")  # as the list's editor does
    assert model.index(row).data() == "Old chat, renamed"
    assert top_row() == first
    doomed = model.conversation_at(model.rowCount() - 3).id
    gui.controller.delete_conversation(doomed)
    assert gui.store.conversation(doomed) is None and model.rowCount() == 119
    assert top_row() == first - 1  # the list lost a row above the bottom: it moves by one
    assert model.conversation_at(0).id == gui.controller.conversation_id
