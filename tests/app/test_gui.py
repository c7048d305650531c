"""The desktop app end to end on tiny random models: real engine thread, SQLite, widgets."""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import QEvent, QPoint, Qt
from PySide6.QtGui import QGuiApplication, QHelpEvent, QTextCursor, QTextDocument
from PySide6.QtWidgets import QApplication, QToolTip

from app.store import COMPLETE, STOPPED, stats_from_dict
from app.ui.theme import is_dark
from app.ui.token_render import KIND_STYLES
from app.ui.worker import ChatSettings
from engine.events import Step, TokenKind, without_cut_mark
from engine.tuning import K_MAX
from tests.engine.test_decode import CHAIN_TEXT, write_chain_model

TIMEOUT = 60_000


def plain_settings(target: Path, **kw) -> ChatSettings:
    return ChatSettings(target=str(target), drafter="off", max_tokens=kw.pop("max_tokens", 24), **kw)


def spec_settings(target: Path, draft: Path, **kw) -> ChatSettings:
    return ChatSettings(target=str(target), draft=str(draft), drafter="model", k=4,
                        max_tokens=kw.pop("max_tokens", 60), **kw)


def send_by_keyboard(qtbot, gui, text: str) -> None:
    edit = gui.window.composer.edit
    qtbot.keyClicks(edit, text)
    qtbot.keyClick(edit, Qt.Key.Key_Return)


def wait_idle(qtbot, gui) -> None:
    qtbot.waitUntil(lambda: not gui.controller.generating, timeout=TIMEOUT)


def fragments(doc: QTextDocument):
    """(text, QTextCharFormat) for every fragment in the document."""
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.isValid():
                yield frag.text(), frag.charFormat(), frag.position()
            it += 1
        block = block.next()


def kind_of(fmt) -> TokenKind | None:
    tip = fmt.toolTip()
    for kind, style in KIND_STYLES.items():
        if tip.startswith(style.label + ":"):
            return kind
    return None


def test_send_streams_text_and_saves_reply(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=160))
    steps: list[Step] = []
    gui.controller.step_received.connect(lambda _m, step, _s: steps.append(step))
    send_by_keyboard(qtbot, gui, "Hello there")
    assert gui.window.composer.edit.toPlainText() == ""  # Enter sent it
    assert gui.window.composer.stop_button.isVisible()

    card = gui.window.chat_view.cards[-1]
    qtbot.waitUntil(lambda: card.document().toPlainText() != "" and gui.controller.generating,
                    timeout=TIMEOUT)
    partial = card.document().toPlainText()
    wait_idle(qtbot, gui)

    [user, reply] = gui.store.messages(gui.controller.conversation_id)
    assert user.content == "Hello there" and user.role == "user"
    assert reply.status == COMPLETE and len(reply.steps) == len(steps) == 160
    assert reply.content == "".join(s.text for s in steps)
    assert card.document().toPlainText() == reply.content
    assert len(partial) < len(reply.content)  # text arrived while generating
    stats = stats_from_dict(reply.stats)
    assert stats.generated_tokens == 160 and stats.finish_reason == "length"
    assert card.footer.text().startswith(f"{stats.decode_tps:.1f} tok/s · 160 tokens")
    assert gui.window.gauge.tokens_label.text() == "160"
    assert gui.window.gauge.sparkline.values and max(gui.window.gauge.sparkline.values) > 0
    assert gui.window.composer.send_button.isVisible()
    assert gui.window.windowTitle().startswith("Hello there")


def test_typing_goes_to_the_composer_from_the_start(qtbot, make_gui, tiny_pair) -> None:
    """A user opens the app (or a new chat) and types: the keys must land in the composer,
    not on a focused button (a space would press "New chat")."""
    gui = make_gui(plain_settings(tiny_pair[0]))
    assert gui.window.focusWidget() is gui.window.composer.edit
    gui.window.sidebar.setFocus()
    gui.controller.new_conversation()
    assert gui.window.focusWidget() is gui.window.composer.edit


def test_shift_enter_inserts_newline(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0]))
    edit = gui.window.composer.edit
    qtbot.keyClicks(edit, "line one")
    qtbot.keyClick(edit, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(edit, "line two")
    assert edit.toPlainText() == "line one\nline two"
    assert not gui.controller.generating


def test_every_token_kind_is_styled_with_tooltip(qtbot, make_gui, tiny_pair) -> None:
    """Each kind the drafter produced shows with its style.

    A random tiny model emits bytes that are rarely valid UTF-8, so many committed tokens
    carry no text of their own (the detokenizer holds them); only kinds with visible text can
    show. The demo-model test checks all five on real text.
    """
    target, draft = tiny_pair
    # chains: this pair's misses then show as REPLACED (a draft tree's runner-up may catch
    # them; tree ghosts have their own test in test_tree_gui.py)
    gui = make_gui(spec_settings(target, draft, tree="off"))
    produced: set[TokenKind] = set()
    visible: set[TokenKind] = set()

    def record(_m, step: Step, _s) -> None:
        produced.update(t.kind for t in step.tokens)
        # a ghost always shows: a stray-byte square where it holds part of a character
        visible.update(t.kind for t in step.tokens if t.text or t.kind is TokenKind.REJECTED)

    gui.controller.step_received.connect(record)
    gui.controller.send("The cat sat on the mat.")
    wait_idle(qtbot, gui)
    gui.controller.set_settings(plain_settings(target, max_tokens=8))
    gui.controller.send("And then?")
    wait_idle(qtbot, gui)
    assert produced == set(TokenKind)  # the draft made every speculative kind; plain, TARGET

    spec_card, plain_card = gui.window.chat_view.cards[1], gui.window.chat_view.cards[3]
    dark = is_dark(spec_card.palette())
    seen: dict[TokenKind, tuple[str, int]] = {}
    for card in (spec_card, plain_card):
        for text, fmt, pos in fragments(card.document()):
            kind = kind_of(fmt)
            if kind is None:
                continue
            fg, bg = KIND_STYLES[kind].colors(dark)
            if fg:
                assert fmt.foreground().color().name() == fg
            if bg:
                assert fmt.background().color().name() == bg
            assert fmt.fontStrikeOut() == (kind is TokenKind.REJECTED)
            assert "target probability" in fmt.toolTip()
            seen.setdefault(kind, (text, pos))
    assert set(seen) == visible
    assert {TokenKind.REJECTED, TokenKind.REPLACED, TokenKind.TARGET} <= visible
    legend = gui.window.chat_view.legend.label.text()
    for style in KIND_STYLES.values():
        assert style.label in legend

    # hovering a token shows its kind and probability
    browser = spec_card.browser
    _, pos = seen[TokenKind.REPLACED]
    cursor = QTextCursor(spec_card.document())
    cursor.setPosition(pos)
    rect = browser.cursorRect(cursor)
    point = QPoint(rect.right() + 2, rect.center().y())
    tip = browser.tooltip_at(point)
    assert tip.startswith("corrected:") and "target probability" in tip
    QApplication.sendEvent(browser.viewport(), QHelpEvent(
        QEvent.Type.ToolTip, point, browser.viewport().mapToGlobal(point)))
    assert QToolTip.text() == tip

    # a dark system palette switches the token colours live
    from PySide6.QtGui import QColor, QPalette

    dark_palette = QPalette()
    for role, color in ((QPalette.ColorRole.Window, "#1e1e1e"), (QPalette.ColorRole.Base, "#252526"),
                        (QPalette.ColorRole.AlternateBase, "#2d2d30"),
                        (QPalette.ColorRole.Button, "#333337"),
                        (QPalette.ColorRole.WindowText, "#eeeeee"), (QPalette.ColorRole.Text, "#eeeeee"),
                        (QPalette.ColorRole.ButtonText, "#eeeeee")):
        dark_palette.setColor(role, QColor(color))
    light_palette = QApplication.palette()
    QApplication.setPalette(dark_palette)  # what the system does when it switches to dark
    assert is_dark(spec_card.palette())
    replaced = [f for _, f, _ in fragments(spec_card.document()) if kind_of(f) is TokenKind.REPLACED]
    assert replaced[0].background().color().name() == KIND_STYLES[TokenKind.REPLACED].dark_bg
    QApplication.setPalette(light_palette)
    assert not is_dark(spec_card.palette())

    # hiding rejected guesses drops exactly the rejected tokens from the document
    n_rejected = sum(t.kind is TokenKind.REJECTED for s in spec_card.steps for t in s.tokens)
    assert n_rejected > 0
    gui.window.rejected_action.trigger()
    assert all(kind_of(f) is not TokenKind.REJECTED for _, f, _ in fragments(spec_card.document()))
    assert spec_card.document().toPlainText() == spec_card.message.content


def test_stop_mid_reply_leaves_consistent_conversation(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=5000))
    after_cancel: list[bool] = []
    cancel_events: list[threading.Event] = []
    # Runs on the engine thread as each step is emitted: did Stop come before it?
    gui.host.worker.step_generated.connect(
        lambda *_: after_cancel.append(bool(cancel_events) and cancel_events[0].is_set()),
        Qt.ConnectionType.DirectConnection)
    gui.controller.send("Count forever")
    cancel_events.append(gui.controller.current_request.cancel)
    card = gui.window.chat_view.cards[-1]
    # (stopped once it has written some text, not just the newlines it starts with, so
    # that Continue has something to write on from)
    qtbot.waitUntil(lambda: len(card.steps) >= 3 and bool(card.text().strip()),
                    timeout=TIMEOUT)
    qtbot.mouseClick(gui.window.composer.stop_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, gui)

    # the engine stopped within one step: Stop can land while a finished step is being
    # emitted (it checked cancel just before), then the one step in flight still arrives
    assert sum(after_cancel) <= 2
    [_, reply] = gui.store.messages(gui.controller.conversation_id)
    assert reply.status == STOPPED
    stats = stats_from_dict(reply.stats)
    assert stats.finish_reason == "cancelled" and stats.generated_tokens < 5000
    assert reply.content == "".join(s.text for s in reply.steps)
    assert card.document().toPlainText() == reply.content
    assert "stopped" in card.footer.text()

    # a stopped reply can be continued: the same message grows, its numbers add up
    assert card.continue_button.isVisibleTo(gui.window)
    gui.controller.set_settings(plain_settings(tiny_pair[0], max_tokens=4))
    assert gui.controller.continue_reply(reply.id)
    wait_idle(qtbot, gui)
    [_, grown] = gui.store.messages(gui.controller.conversation_id)
    assert grown.id == reply.id and grown.status == COMPLETE
    # (the random model writes invalid bytes too: shown as U+FFFD, which a cut character
    # leaves at the end, and which resuming drops)
    assert grown.content.startswith(without_cut_mark(reply.content))
    assert len(grown.steps) == len(reply.steps) + 4
    assert stats_from_dict(grown.stats).generated_tokens == stats.generated_tokens + 4
    assert card.document().toPlainText() == grown.content

    # the conversation goes on
    assert gui.controller.send("Go on")
    wait_idle(qtbot, gui)
    roles = [(m.role, m.status) for m in gui.store.messages(gui.controller.conversation_id)]
    assert roles == [("user", COMPLETE), ("assistant", COMPLETE), ("user", COMPLETE),
                     ("assistant", COMPLETE)]


def test_engine_error_shows_banner_not_crash(qtbot, make_gui, tiny_pair) -> None:
    settings = ChatSettings(target=str(tiny_pair[0]), drafter="model", draft=None, max_tokens=8)
    gui = make_gui(settings)
    with qtbot.waitSignal(gui.controller.error_raised, timeout=TIMEOUT):
        gui.controller.send("hi")
    wait_idle(qtbot, gui)
    assert gui.window.banner.isVisible()
    assert "needs a draft model" in gui.window.banner.text
    # the failed, empty reply is not left behind; the user message is
    assert [m.role for m in gui.store.messages(gui.controller.conversation_id)] == ["user"]
    assert len(gui.window.chat_view.cards) == 1

    gui.controller.set_settings(plain_settings(tiny_pair[0], max_tokens=4))
    gui.window.regenerate_last()  # nothing to regenerate: no reply
    assert gui.controller.edit_and_resend(gui.store.messages(gui.controller.conversation_id)[0].id,
                                          "hi again")
    wait_idle(qtbot, gui)
    assert [m.content for m in gui.store.messages(gui.controller.conversation_id)][0] == "hi again"


def test_a_chat_past_the_context_window_keeps_answering(qtbot, make_gui, tiny_pair, tmp_path,
                                                       screenshots_dir) -> None:
    """The target's window cut to 512 tokens: six messages of ~160 tokens each all get a
    reply (before, every message past the window failed with "the prompt is too long"),
    and the footer of a reply that left early messages out says so."""
    small = tmp_path / "small-window"
    shutil.copytree(tiny_pair[0], small)
    config = json.loads((small / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (small / "config.json").write_text(json.dumps(config))
    gui = make_gui(plain_settings(small, max_tokens=16))
    errors: list[str] = []
    gui.controller.error_raised.connect(errors.append)
    for i in range(6):
        gui.controller.send(f"message {i}: " + "a" * 150)
        wait_idle(qtbot, gui)
    replies = [m for m in gui.store.messages(gui.controller.conversation_id)
               if m.role == "assistant"]
    assert errors == [] and [m.status for m in replies] == [COMPLETE] * 6
    dropped = [stats_from_dict(m.stats).dropped_messages for m in replies]
    assert dropped[0] == 0 and dropped[-1] > 0
    footer = gui.window.chat_view.cards[-1].footer.text()
    assert footer.endswith(f"{dropped[-1]} earliest messages left out to fit the context window")
    # the gauge: how much of the window the last reply's prompt and text took
    last = stats_from_dict(replies[-1].stats)
    used = last.prompt_tokens + last.generated_tokens
    assert gui.window.gauge.context_label.text() == f"{used:,} / 512" and used <= 512
    assert "earliest messages left out" in gui.window.gauge.context_label.toolTip()

    # a divider stands before the first message the last reply read, after a reopen too
    def divider_before() -> str:
        view = gui.window.chat_view
        assert view.context_divider.isVisibleTo(gui.window)
        at = view.column_layout.indexOf(view.context_divider)
        return view.column_layout.itemAt(at + 1).widget().message.content

    messages = gui.store.messages(gui.controller.conversation_id)
    assert divider_before() == messages[dropped[-1]].content
    assert messages[dropped[-1]].role == "user"
    gui.controller.open_conversation(gui.controller.conversation_id)
    assert divider_before() == messages[dropped[-1]].content
    view = gui.window.chat_view
    qtbot.waitUntil(lambda: view.scroll.verticalScrollBar().maximum() > 0, timeout=TIMEOUT)
    qtbot.wait(50)  # the reopened cards' layout
    view._follow = False
    view.scroll.verticalScrollBar().setValue(view.context_divider.y() - 250)
    qtbot.wait(50)
    gui.window.grab().save(str(screenshots_dir / "context_window_divider.png"))
    gui.window.resize(900, 640)
    gui.window.grab().save(str(screenshots_dir / "context_window_note.png"))


def test_continue_writes_on_from_a_reply_cut_at_its_limit(qtbot, make_gui, tiny_pair,
                                                          screenshots_dir) -> None:
    """A reply that stopped at max tokens offers Continue; clicking it grows the same
    message (text, steps, numbers) by another max tokens. Only the last reply offers it."""
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=8))
    gui.controller.send("Write code")  # the tiny model's reply has text, not just newlines
    wait_idle(qtbot, gui)
    card = gui.window.chat_view.cards[-1]
    [_, first] = gui.store.messages(gui.controller.conversation_id)
    assert stats_from_dict(first.stats).finish_reason == "length"
    assert card.continue_button.isVisibleTo(gui.window)
    assert gui.window.continue_action.isEnabled()
    gui.window.resize(900, 640)
    gui.window.grab().save(str(screenshots_dir / "continue_button.png"))

    qtbot.mouseClick(card.continue_button, Qt.MouseButton.LeftButton)
    assert not card.continue_button.isVisibleTo(gui.window)  # while it writes
    wait_idle(qtbot, gui)
    [_, grown] = gui.store.messages(gui.controller.conversation_id)
    assert grown.id == first.id and grown.status == COMPLETE
    assert grown.content.startswith(first.content) and len(grown.content) > len(first.content)
    assert len(grown.steps) == 16 and stats_from_dict(grown.stats).generated_tokens == 16
    assert card.document().toPlainText() == grown.content
    assert card.footer.text().split(" · ")[1] == "16 tokens"
    assert card.continue_button.isVisibleTo(gui.window)  # cut at its limit again

    gui.controller.send("And then?")
    wait_idle(qtbot, gui)
    assert not card.continue_button.isVisibleTo(gui.window)  # no longer the last reply
    assert not gui.controller.continue_reply(first.id)
    assert gui.window.chat_view.cards[-1].continue_button.isVisibleTo(gui.window)
    # the menu item continues the last reply, and greys out when there is none to continue
    gui.window.continue_action.trigger()
    wait_idle(qtbot, gui)
    last = gui.store.messages(gui.controller.conversation_id)[-1]
    assert stats_from_dict(last.stats).generated_tokens == 16
    gui.controller.new_conversation()
    assert not gui.window.continue_action.isEnabled()


def test_continue_writes_a_character_its_limit_cut_in_two_whole(qtbot, make_gui,
                                                                 tmp_path) -> None:
    """The chain model's reply at 4 tokens a turn: the first cut leaves 🦊 half written
    (shown as U+FFFD); three Continues write the reply whole, the card as the store."""
    from tests.engine.test_decode import CHAIN_TEXT, write_chain_model

    chain = write_chain_model(tmp_path / "chain")
    gui = make_gui(plain_settings(chain, max_tokens=4))
    gui.controller.send("Hi")
    wait_idle(qtbot, gui)
    card = gui.window.chat_view.cards[-1]
    assert card.document().toPlainText() == "Hé\ufffd"
    for _ in range(3):
        assert gui.controller.continue_reply(card.message_id)
        wait_idle(qtbot, gui)
    [_, reply] = gui.store.messages(gui.controller.conversation_id)
    assert reply.content == CHAIN_TEXT == card.document().toPlainText()
    stats = stats_from_dict(reply.stats)
    assert stats.generated_tokens == 13 and stats.finish_reason == "eos"
    assert not card.continue_button.isVisibleTo(gui.window)  # it ended at eos


def test_missing_model_shows_banner(qtbot, make_gui, tmp_path) -> None:
    gui = make_gui(plain_settings(tmp_path / "no-such-model"))
    qtbot.waitUntil(lambda: gui.window.banner.isVisible(), timeout=TIMEOUT)
    assert "Could not load model" in gui.window.banner.text


def test_comparison_runs_both_ways_and_reports_identical(qtbot, make_gui, tiny_pair) -> None:
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft, temperature=0.8, seed=11, max_tokens=40))
    gui.window.compare_action.trigger()
    assert gui.window.stack.currentWidget() is gui.window.comparison_view
    with qtbot.waitSignal(gui.controller.comparison_finished, timeout=TIMEOUT) as blocker:
        send_by_keyboard(qtbot, gui, "Tell me about cats")
    wait_idle(qtbot, gui)
    result = blocker.args[0]
    view = gui.window.comparison_view
    assert result.identical and result.speculative_text == result.plain_text
    assert result.speculative.n_drafted > 0 and result.plain.n_drafted == 0
    assert result.plain.target_passes == result.plain.generated_tokens
    assert view.speculative.text() == view.plain.text() == result.plain_text
    assert "identical output" in view.result_label.text()
    assert f"<b>{result.speedup:.2f}×" in view.result_label.text()
    assert view.plain.gauge.tau_label.text() == "1.00"
    assert view.plain.gauge.accept_label.text() == "—"

    [_, reply] = gui.store.messages(gui.controller.conversation_id)
    assert reply.content == result.speculative_text
    assert reply.comparison["identical"] is True
    assert reply.comparison["speedup"] == pytest.approx(result.speedup)

    # replay the same prompt: same text again
    with qtbot.waitSignal(gui.controller.comparison_finished, timeout=TIMEOUT) as again:
        qtbot.mouseClick(view.replay_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, gui)
    assert again.args[0].identical and again.args[0].plain_text == result.plain_text
    assert len(gui.store.messages(gui.controller.conversation_id)) == 2


def test_repeat_penalty_from_the_panel_changes_the_reply_and_stays_lossless(
        qtbot, make_gui, tiny_pair) -> None:
    """The panel's repeat penalty reaches the sampler of both runs of a comparison: the
    text differs from the unpenalized one (the tiny target loops at T = 0), speculative and
    plain still agree, and the reply keeps the setting it was made with."""
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft, max_tokens=40))
    panel = gui.window.settings_panel
    assert panel.repetition_penalty.value() == 1.0
    assert panel.repetition_penalty.text() == "off"
    texts = []
    for penalty in (1.0, 2.0):
        panel.repetition_penalty.setValue(penalty)
        assert gui.controller.settings.repetition_penalty == penalty
        gui.controller.new_conversation()  # the same prompt from the same start
        with qtbot.waitSignal(gui.controller.comparison_finished, timeout=TIMEOUT) as blocker:
            assert gui.controller.send("Tell me about cats", compare=True)
        wait_idle(qtbot, gui)
        result = blocker.args[0]
        assert result.identical and result.speculative.n_drafted > 0
        texts.append(result.plain_text)
        reply = gui.store.messages(gui.controller.conversation_id)[-1]
        assert reply.settings["repetition_penalty"] == penalty
    assert texts[0] != texts[1]


def test_comparison_is_a_race_both_texts_arrive_at_once(qtbot, make_gui, tiny_pair,
                                                          monkeypatch) -> None:
    """The two runs take turns (one step each here), so plain steps arrive while the
    speculative reply is still coming; each gauge counts only its own turns."""
    import app.ui.worker

    monkeypatch.setattr(app.ui.worker, "RACE_TURN_S", 0.0)
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft, max_tokens=60))
    arrivals: list[str] = []
    gui.controller.step_received.connect(lambda *_: arrivals.append("spec"))
    gui.controller.plain_step_received.connect(lambda *_: arrivals.append("plain"))
    gui.window.compare_action.trigger()
    t0 = time.perf_counter()
    with qtbot.waitSignal(gui.controller.comparison_finished, timeout=TIMEOUT) as blocker:
        send_by_keyboard(qtbot, gui, "Tell me about dogs")
    wait_idle(qtbot, gui)
    wall = time.perf_counter() - t0
    result = blocker.args[0]
    assert result.identical
    # interleaved, not one run after the other
    assert arrivals.index("plain") < len(arrivals) - 1 - arrivals[::-1].index("spec")
    # own turns only: the two decode times add up to less than the race's wall time
    assert result.speculative.decode_s > 0 and result.plain.decode_s > 0
    assert result.speculative.decode_s + result.plain.decode_s < wall
    assert gui.window.comparison_view.plain.text() == result.plain_text


def test_stop_while_a_long_prompt_is_read(qtbot, make_gui, tiny_pair) -> None:
    """Stop lands between two chunks of a long paste: the reply ends there (a user waited
    53 s for Stop on a 5,300-token message), saved as stopped, with no speed to show."""
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=50))
    progress: list[tuple[int, int, bool]] = []
    cancel_events: list[threading.Event] = []

    def on_progress(_request: int, done: int, total: int) -> None:
        """On the engine thread, as each chunk is read: Stop after the first."""
        progress.append((done, total, bool(cancel_events) and cancel_events[0].is_set()))
        if len(progress) == 1:
            gui.controller.stop()

    gui.host.worker.prompt_progressed.connect(on_progress, Qt.ConnectionType.DirectConnection)
    gui.controller.send(" ".join(f"word{i}" for i in range(150)))  # ~1,150 tokens
    cancel_events.append(gui.controller.current_request.cancel)
    qtbot.waitUntil(lambda: bool(progress), timeout=TIMEOUT)
    wait_idle(qtbot, gui)
    done, total, _ = progress[-1]
    assert len(progress) == 1 + sum(stopped for *_, stopped in progress) <= 2
    assert done < total  # the rest of the prompt was never read
    [_, reply] = gui.store.messages(gui.controller.conversation_id)
    stats = stats_from_dict(reply.stats)
    assert reply.status == STOPPED and reply.content == ""
    assert stats.finish_reason == "cancelled" and stats.generated_tokens == 0
    assert gui.window.gauge.rate_label.text() == "— tok/s"
    assert "stopped" in gui.window.chat_view.cards[-1].footer.text()


def test_stopping_a_race_stops_both_runs(qtbot, make_gui, tiny_pair, monkeypatch) -> None:
    import app.ui.worker

    monkeypatch.setattr(app.ui.worker, "RACE_TURN_S", 0.0)
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft, max_tokens=5000))
    finished: list[object] = []
    gui.controller.comparison_finished.connect(finished.append)
    view = gui.window.comparison_view
    gui.window.compare_action.trigger()
    send_by_keyboard(qtbot, gui, "Count forever")
    qtbot.waitUntil(lambda: len(view.plain.steps) >= 3, timeout=TIMEOUT)
    qtbot.mouseClick(gui.window.composer.stop_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, gui)
    assert not gui.host.busy and not gui.controller.generating
    [_, reply] = gui.store.messages(gui.controller.conversation_id)
    assert reply.status == STOPPED and reply.comparison is None
    assert finished == [] and "Stopped" in view.result_label.text()
    assert len(view.plain.steps) < 5000 and view.replay_button.isEnabled()


def test_coming_back_to_a_conversation_reads_only_the_new_message(qtbot, make_gui, tiny_pair,
                                                                  screenshots_dir) -> None:
    """The engine parks the prompt cache of a conversation the user leaves: back in it,
    the next reply reads only the new message, and the gauge says how much came from the
    cache."""
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=8))
    gui.controller.send("first chat: " + "the cat sat on the mat. " * 25)
    wait_idle(qtbot, gui)
    first = gui.controller.conversation_id
    gui.controller.new_conversation()
    gui.controller.send("second chat: " + "a ship sailed the sea. " * 25)
    wait_idle(qtbot, gui)
    gui.controller.open_conversation(first)
    gui.controller.send("and then?")
    wait_idle(qtbot, gui)
    last = stats_from_dict([m for m in gui.store.messages(first) if m.role == "assistant"][-1].stats)
    assert last.prompt_tokens > 300
    assert last.prompt_tokens - last.prefilled_tokens > 280  # the parked cache came back
    gauge = gui.window.gauge
    assert gauge.prompt_label.text() == f"{last.prompt_s:.2f} s"
    cached = last.prompt_tokens - last.prefilled_tokens
    assert gauge.prompt_label.toolTip() == (
        f"read {last.prefilled_tokens:,} of the prompt's {last.prompt_tokens:,} tokens in "
        f"{last.prompt_s:.2f} s; the other {cached:,} were already in the cache")
    gui.window.grab().save(str(screenshots_dir / "gauge_prompt_read.png"))


def test_restart_restores_conversations_with_highlighting(qtbot, make_gui, tiny_pair, tmp_path) -> None:
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft, max_tokens=30))
    gui.controller.send("First chat")
    wait_idle(qtbot, gui)
    first = gui.controller.conversation_id
    before = [(t, kind_of(f)) for t, f, _ in fragments(gui.window.chat_view.cards[1].document())]
    gui.controller.new_conversation()
    gui.controller.set_settings(plain_settings(target, max_tokens=6))
    gui.controller.send("Second chat")
    wait_idle(qtbot, gui)
    gui.controller.open_conversation(first)
    gui.window.chat_view.set_show_rejected(False)
    gui.close()

    again = make_gui(plain_settings(target))
    titles = [again.window.sidebar.model.index(r).data() for r in range(again.window.sidebar.model.rowCount())]
    assert titles == ["Second chat", "First chat"]
    assert again.controller.conversation_id == first  # reopened where the user left
    assert not again.window.chat_view.show_rejected  # view toggles persisted
    again.window.chat_view.set_show_rejected(True)
    after = [(t, kind_of(f)) for t, f, _ in fragments(again.window.chat_view.cards[1].document())]
    assert after == before
    kinds = {k for _, k in after}
    assert {TokenKind.REJECTED, TokenKind.REPLACED} <= kinds


def test_regenerate_replaces_the_reply(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=6))
    gui.controller.send("Say something")
    wait_idle(qtbot, gui)
    [_, first] = gui.store.messages(gui.controller.conversation_id)
    card = gui.window.chat_view.card_for(first.id)
    gui.controller.set_settings(plain_settings(tiny_pair[0], max_tokens=6, temperature=1.0, seed=5))
    qtbot.mouseClick(card.regenerate_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, gui)
    msgs = gui.store.messages(gui.controller.conversation_id)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].id > first.id and msgs[1].settings["seed"] == 5
    assert [c.message_id for c in gui.window.chat_view.cards] == [msgs[0].id, msgs[1].id]


def test_regenerate_and_edit_draft_from_the_reply_they_replace(qtbot, make_gui, tmp_path,
                                                               screenshots_dir) -> None:
    """Regenerating drafts from the old reply (prompt lookup's reference): at the same
    settings the same text, in far fewer passes; editing the question hands its old reply
    on the same way. A comparison's race gets no reference (it compares on equal terms)."""
    chain = write_chain_model(tmp_path / "chain")  # greedy: CHAIN_TEXT to any prompt
    settings = ChatSettings(target=str(chain), drafter="ngram", k=8, max_tokens=40)
    gui = make_gui(settings)
    sent: list = []
    generate, race = gui.host.generate, gui.host.race
    gui.host.generate = lambda request: (sent.append(request), generate(request))[1]
    gui.host.race = lambda spec, plain: (sent.extend([spec, plain]), race(spec, plain))[1]
    gui.controller.send("Say something")
    wait_idle(qtbot, gui)
    [question, first] = gui.store.messages(gui.controller.conversation_id)
    card = gui.window.chat_view.card_for(first.id)
    qtbot.mouseClick(card.regenerate_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, gui)
    [_, again] = gui.store.messages(gui.controller.conversation_id)
    assert again.content == first.content == CHAIN_TEXT
    assert sent[-1].reference == first.content
    passes = [stats_from_dict(m.stats).target_passes for m in (first, again)]
    assert passes[1] * 3 <= passes[0], passes  # the control: the first had nothing to copy
    gui.window.grab().save(str(screenshots_dir / "regenerated_from_old_reply.png"))

    gui.controller.edit_and_resend(question.id, "Say something else")
    wait_idle(qtbot, gui)
    assert sent[-1].reference == again.content
    gui.controller.replay_comparison()
    wait_idle(qtbot, gui)
    assert [r.reference for r in sent[-2:]] == ["", ""]
    assert sent[0].reference == ""  # a first reply has nothing to draft from


def test_sidebar_search_rename_delete_and_export(qtbot, make_gui, tiny_pair, tmp_path, monkeypatch) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
    for text in ("Python decorators", "Sourdough bread"):
        gui.controller.new_conversation()
        gui.controller.send(text)
        wait_idle(qtbot, gui)
    sidebar = gui.window.sidebar
    assert sidebar.model.rowCount() == 2
    qtbot.keyClicks(sidebar.search_edit, "python")
    assert sidebar.model.rowCount() == 1
    index = sidebar.model.index(0)
    assert index.data() == "Python decorators"
    sidebar.model.setData(index, "Decorators, explained")
    sidebar.search_edit.clear()
    titles = {sidebar.model.index(r).data() for r in range(sidebar.model.rowCount())}
    assert titles == {"Decorators, explained", "Sourdough bread"}

    out = gui.window.export_conversation(path=tmp_path / "chat.md")
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# Sourdough bread\n")
    assert "## You\n\nSourdough bread" in text and "tokens/pass" in text

    from PySide6.QtWidgets import QMessageBox

    monkeypatch.setattr(QMessageBox, "exec", lambda *a, **k: QMessageBox.StandardButton.Yes)
    current = gui.controller.conversation_id
    sidebar.confirm_delete(current)
    assert gui.store.conversation(current) is None
    assert sidebar.model.rowCount() == 1
    assert gui.controller.conversation_id != current
    assert gui.window.chat_view.cards[0].message.content == "Python decorators"


def test_draft_list_disables_incompatible_models(qtbot, make_gui, tiny_pair, tmp_path) -> None:
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft))
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    panel = gui.window.settings_panel
    assert "target model itself" in panel.draft_reason(str(target))  # known from the folders
    # the draft's tokenizer is compared with the target's on another thread
    qtbot.waitUntil(lambda: panel.draft_reason(str(draft)) is None, timeout=TIMEOUT)


def test_window_state_and_settings_persist(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0]))
    gui.window.resize(760, 640)  # the offscreen screen is 800x800
    gui.window.compare_action.trigger()
    gui.window.settings_panel.temperature.setValue(0.7)
    gui.window.settings_panel.seed.setValue(42)
    assert gui.controller.settings.temperature == 0.7 and gui.controller.settings.seed == 42
    gui.close()
    from app.ui.main_window import load_chat_settings

    restored = load_chat_settings(gui.qsettings)
    assert restored.temperature == 0.7 and restored.seed == 42
    again = make_gui(restored)
    assert again.window.comparison_mode
    assert (again.window.width(), again.window.height()) == (760, 640)
    assert again.window.settings_panel.seed.value() == 42


def test_unusable_saved_settings_open_with_defaults(qtbot, make_gui, tiny_pair,
                                                    tmp_path) -> None:
    """Settings edited by hand or saved by another version: each unusable value falls back
    to its default, the usable ones stay, and the app opens and answers."""
    import json

    from PySide6.QtCore import QSettings

    from app.ui.main_window import load_chat_settings

    bad = {"draft": ["x"], "drafter": "bogus", "k": K_MAX + 1, "accept": None, "tree": 3,
           "temperature": "hot", "top_p": -2, "top_k": 1.5, "min_p": float("nan"),
           "max_tokens": -5, "seed": "s", "system_prompt": 12, "learn_from_chats": "yes",
           "improve_drafter": 2, "repetition_penalty": 0.5}  # below what the panel can show
    good = {"target": str(tiny_pair[0]), "max_tokens": 3}
    qs = QSettings(str(tmp_path / "saved.ini"), QSettings.Format.IniFormat)
    for case, want in ((bad, ChatSettings()), ({**bad, **good}, ChatSettings(**good))):
        qs.setValue("chat/settings", json.dumps(case))
        assert load_chat_settings(qs) == want
    qs.setValue("chat/settings", json.dumps({**bad, "target": 7}))
    settings = load_chat_settings(qs, str(tiny_pair[0]))  # as run_gui loads them
    assert settings == ChatSettings(target=str(tiny_pair[0]))
    gui = make_gui(replace(settings, drafter="off", max_tokens=3))
    gui.controller.send("still works")
    wait_idle(qtbot, gui)
    reply = gui.store.messages(gui.controller.conversation_id)[-1]
    assert reply.status == COMPLETE and reply.stats["generated_tokens"] == 3


def test_the_longest_draft_the_panel_offers_is_one_the_engine_runs(qtbot, make_gui,
                                                                     tiny_pair) -> None:
    """K went to 32 in the panel while the engine refuses more than K_MAX: every reply
    then failed with an error banner."""
    gui = make_gui(ChatSettings(target=str(tiny_pair[0]), draft=str(tiny_pair[1]),
                                drafter="model", max_tokens=6))
    panel = gui.window.settings_panel
    assert panel.k_spin.maximum() == K_MAX
    panel.k_auto.setChecked(False)
    # every end of every range the panel offers is one the engine takes (top-p went to 0)
    for box in (panel.temperature, panel.top_p, panel.top_k, panel.min_p,
                panel.repetition_penalty, panel.max_tokens, panel.seed, panel.k_spin):
        for end in (box.minimum(), box.maximum()):
            box.setValue(end)
            gui.controller.settings.to_options()  # raises EngineError for a refused value
        box.setValue(box.minimum())
    panel.max_tokens.setValue(6)
    panel.k_spin.setValue(panel.k_spin.maximum())
    assert gui.controller.settings.k == K_MAX
    gui.controller.send("draft as far as you may")
    wait_idle(qtbot, gui)
    reply = gui.store.messages(gui.controller.conversation_id)[-1]
    assert reply.status == COMPLETE and not gui.window.banner.isVisible()


def test_clipboard_copy_of_message(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(plain_settings(tiny_pair[0], max_tokens=4))
    gui.controller.send("copy me")
    wait_idle(qtbot, gui)
    user_card = gui.window.chat_view.cards[0]
    qtbot.mouseClick(user_card.copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == "copy me"


CRASHING_APP = """
import os, sys
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from PySide6.QtWidgets import QApplication
app = QApplication([])
from app.ui.controller import ChatController
from app.store import Store
from app.ui.worker import ChatSettings, EngineHost
store = Store(sys.argv[1])
host = EngineHost()
controller = ChatController(store, host, ChatSettings(target=sys.argv[2], drafter="off",
                                                       max_tokens=2000))
controller.load_model()
controller.send("Tell me everything you know")
app.exec()
"""


def test_killed_mid_reply_keeps_partial_reply(qtbot, make_gui, tiny_pair, tmp_path) -> None:
    """SIGKILL the app while it streams: the steps so far are in the DB, marked interrupted."""
    import sqlite3
    import subprocess
    import sys
    import time

    db = tmp_path / "history.sqlite3"
    script = tmp_path / "crashing_app.py"
    script.write_text(CRASHING_APP)
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, str(script), str(db), str(tiny_pair[0])], cwd=repo,
                            env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    try:
        deadline = time.monotonic() + 60
        n_steps = 0
        while n_steps < 8:  # poll the live database until the reply is well under way
            assert proc.poll() is None, "the app exited before it was killed"
            assert time.monotonic() < deadline, "no steps were saved"
            if db.exists():
                with sqlite3.connect(db) as peek:
                    try:
                        n_steps = peek.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
                    except sqlite3.OperationalError:  # schema not created yet
                        n_steps = 0
            time.sleep(0.05)
        proc.kill()
    finally:
        proc.kill()
        proc.wait()

    gui = make_gui(plain_settings(tiny_pair[0]), db=db)
    assert gui.store.interrupted_on_open == 1
    [user, reply] = gui.store.messages(gui.controller.conversation_id)
    assert user.content == "Tell me everything you know"
    assert reply.status == "interrupted" and len(reply.steps) >= 8
    assert reply.content == "".join(s.text for s in reply.steps)
    card = gui.window.chat_view.card_for(reply.id)
    assert "interrupted" in card.footer.text()
    assert card.document().toPlainText() == reply.content
    assert "cut off" in gui.window.banner.text


def test_damaged_history_opens_with_what_could_be_read(qtbot, make_gui, tiny_pair, tmp_path,
                                                       screenshots_dir) -> None:
    """A history file with a damaged page: the app opens on the conversations that still
    read, and the banner says what happened and where the damaged file is."""
    from tests.app.test_store import _history_of

    db = tmp_path / "history.sqlite3"
    _history_of(db, 6)
    data = bytearray(db.read_bytes())
    hit = data.find(b"question 2 ") // 4096 * 4096
    data[hit:hit + 4096] = b"\xa5" * 4096
    db.write_bytes(bytes(data))

    gui = make_gui(plain_settings(tiny_pair[0]), db=db)
    repair = gui.store.repair
    assert repair is not None and repair.conversations == 6
    assert gui.window.banner.isVisible()
    text = gui.window.banner.text
    assert "damaged" in text and str(repair.damaged) in text and "6 conversations" in text
    assert "cut off" not in text
    assert repair.damaged.exists() and db.exists()
    gui.window.grab().save(str(screenshots_dir / "damaged_history.png"))


STARTING_APP = """
import os, sys
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
app = QApplication([])
from app.ui.gui import run_gui
from app.ui.main_window import MainWindow

def poll():
    wins = [w for w in app.topLevelWidgets() if isinstance(w, MainWindow)]
    if wins and (wins[0].controller.model is not None or wins[0].banner.text):
        w = wins[0]
        print("MODEL", w.controller.model and w.controller.model.name, "BANNER", w.banner.text,
              flush=True)
        w.close()
        app.quit()
        return
    QTimer.singleShot(20, poll)

QTimer.singleShot(0, poll)
sys.exit(run_gui(sys.argv[1]))
"""


def test_run_gui_opens_window_on_model_and_exits_cleanly(tiny_pair, tmp_path) -> None:
    """`understudy` with no arguments: qasync loop, engine thread, window, clean exit."""
    import os
    import subprocess
    import sys

    script = tmp_path / "start_app.py"
    script.write_text(STARTING_APP)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "UNDERSTUDY_DATA_DIR": str(tmp_path / "data"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script), str(tiny_pair[0])], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "MODEL tiny-target BANNER \n" in done.stdout
    assert (tmp_path / "data" / "history.sqlite3").exists()
