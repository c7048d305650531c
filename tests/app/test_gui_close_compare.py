"""Closing the app under a reply, and the comparison's edges: real engine thread, SQLite,
widgets on tiny random models."""

from __future__ import annotations

import threading

from PySide6.QtCore import Qt

from app.store import STOPPED, stats_from_dict
from app.ui.comparison import NO_PROMPT_TIP, REPLAY_TIP
from app.ui.main_window import COMPARE_BUSY_TIP, COMPARE_TIP
from tests.app.test_gui import TIMEOUT, plain_settings, send_by_keyboard, spec_settings, wait_idle


def test_closing_mid_reply_keeps_its_numbers(qtbot, make_gui, tiny_pair) -> None:
    """Quit while a reply streams: it is saved as stopped with the totals of the steps it
    kept (they were lost: stats_json NULL, after a restart the card said only "stopped")."""
    target = tiny_pair[0]
    gui = make_gui(plain_settings(target, max_tokens=5000))
    gui.controller.send("Count forever")
    qtbot.waitUntil(lambda: len(gui.window.chat_view.cards[-1].steps) >= 3, timeout=TIMEOUT)
    gui.close()

    again = make_gui(plain_settings(target))
    [_, reply] = again.store.messages(again.controller.conversation_id)
    stats = stats_from_dict(reply.stats)
    assert reply.status == STOPPED and reply.content
    assert stats is not None and stats.finish_reason == "cancelled"
    assert stats.generated_tokens == sum(len(s.committed) for s in reply.steps) >= 3
    assert stats.decode_s > 0 and stats.prompt_tokens > 0
    footer = again.window.chat_view.cards[-1].footer.text()
    assert footer == (f"{stats.decode_tps:.1f} tok/s · {stats.generated_tokens} tokens · "
                      f"{stats.tau:.1f} tokens/pass · stopped")


def test_closing_while_the_prompt_is_read_saves_it_as_stop_would(qtbot, make_gui,
                                                                 tiny_pair) -> None:
    """Quit between two chunks of a long prompt: the empty reply is kept as Stop keeps it
    (stopped, no tokens, finish "cancelled"), and says it stopped before it began."""
    target = tiny_pair[0]
    gui = make_gui(plain_settings(target, max_tokens=50))
    release = threading.Event()
    progress: list[tuple[int, int]] = []

    def hold_engine(_request: int, done: int, total: int) -> None:
        """On the engine thread: the first chunk is read; wait there until the app closed."""
        progress.append((done, total))
        release.wait(timeout=TIMEOUT / 1000)

    gui.host.worker.prompt_progressed.connect(hold_engine, Qt.ConnectionType.DirectConnection)
    with qtbot.waitSignal(gui.controller.prompt_progressed, timeout=TIMEOUT):
        gui.controller.send(" ".join(f"word{i}" for i in range(150)))  # ~1,150 tokens
    gui.window.close()
    release.set()
    gui.close()

    again = make_gui(plain_settings(target))
    [_, reply] = again.store.messages(again.controller.conversation_id)
    stats = stats_from_dict(reply.stats)
    done, total = progress[0]
    assert reply.status == STOPPED and reply.content == "" and reply.steps == ()
    assert stats.finish_reason == "cancelled" and stats.generated_tokens == 0
    assert (stats.prompt_tokens, stats.prefilled_tokens) == (total, done) and done < total
    assert again.window.chat_view.cards[-1].footer.text() == "stopped before the reply began"


def test_comparison_note_shows_on_the_card_when_the_race_ends(qtbot, make_gui,
                                                              tiny_pair) -> None:
    """The card's "× vs plain" note came only after a restart: the comparison was saved
    after the card had taken the finished reply."""
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft, max_tokens=30))
    gui.window.compare_action.trigger()
    with qtbot.waitSignal(gui.controller.comparison_finished, timeout=TIMEOUT) as blocker:
        send_by_keyboard(qtbot, gui, "Tell me about cats")
    wait_idle(qtbot, gui)
    result = blocker.args[0]
    note = f"{result.speedup:.2f}× vs plain (identical output)"
    gui.window.compare_action.trigger()  # back to the chat
    assert gui.window.chat_view.cards[-1].footer.text().endswith(" · " + note)


def test_replay_is_offered_only_with_a_prompt_to_replay(qtbot, make_gui, tiny_pair) -> None:
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft, max_tokens=12))
    view = gui.window.comparison_view
    gui.window.compare_action.trigger()
    gui.controller.new_conversation()
    assert not view.replay_button.isEnabled()
    assert view.replay_button.toolTip() == NO_PROMPT_TIP
    assert not gui.controller.replay_comparison()

    with qtbot.waitSignal(gui.controller.comparison_finished, timeout=TIMEOUT):
        send_by_keyboard(qtbot, gui, "Tell me about cats")
        assert not view.replay_button.isEnabled()  # while the race runs
    wait_idle(qtbot, gui)
    assert view.replay_button.isEnabled() and view.replay_button.toolTip() == REPLAY_TIP

    gui.controller.new_conversation()  # a new, empty chat again
    assert not view.replay_button.isEnabled()


def test_comparison_cannot_open_over_a_chat_reply(qtbot, make_gui, tiny_pair) -> None:
    """Turned on while a chat reply streamed, the comparison showed two empty panes and hid
    the reply: the toggle waits for the reply to finish (leaving a race is still fine)."""
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft, max_tokens=5000))
    window = gui.window
    assert window.compare_button.isEnabled() and window.compare_button.toolTip() == COMPARE_TIP
    gui.controller.send("Count forever")
    qtbot.waitUntil(lambda: len(window.chat_view.cards[-1].steps) >= 2, timeout=TIMEOUT)
    assert not window.compare_button.isEnabled() and not window.compare_action.isEnabled()
    assert window.compare_button.toolTip() == COMPARE_BUSY_TIP
    window.compare_action.trigger()
    qtbot.mouseClick(window.compare_button, Qt.MouseButton.LeftButton)
    assert not window.comparison_mode and window.stack.currentWidget() is window.chat_view
    gui.controller.stop()
    wait_idle(qtbot, gui)
    assert window.compare_button.isEnabled() and window.compare_action.isEnabled()

    # a race may be left for the chat and opened again while it runs
    window.compare_action.trigger()
    gui.controller.send("Count forever", compare=True)
    qtbot.waitUntil(lambda: len(window.comparison_view.plain.steps) >= 2, timeout=TIMEOUT)
    window.compare_action.trigger()
    assert window.stack.currentWidget() is window.chat_view
    assert window.compare_button.isEnabled()
    window.compare_action.trigger()
    assert window.stack.currentWidget() is window.comparison_view
    gui.controller.stop()
    wait_idle(qtbot, gui)
