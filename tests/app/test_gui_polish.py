"""Rough edges of the main window: focus after a click, long titles, the comparison's views."""

from __future__ import annotations

from PySide6.QtCore import Qt

from app.ui.gauge import sparkline_top
from app.ui.sidebar import ConversationIdRole
from tests.app.test_gui import (
    TIMEOUT,
    fragments,
    kind_of,
    plain_settings,
    send_by_keyboard,
    spec_settings,
    wait_idle,
)


def test_a_clicked_toolbar_button_hands_the_keyboard_back_to_the_composer(qtbot, make_gui,
                                                                          tiny_pair) -> None:
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft, max_tokens=24))
    window = gui.window
    for button in (window.chat_view.rejected_box, window.chat_view.speculation_box):
        before = button.isChecked()
        qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
        assert button.isChecked() != before
        assert window.focusWidget() is window.composer.edit
        qtbot.mouseClick(button, Qt.MouseButton.LeftButton)  # back as it was

    qtbot.mouseClick(window.compare_button, Qt.MouseButton.LeftButton)
    assert window.comparison_mode
    assert window.focusWidget() is window.composer.edit
    # the question typed next lands in the composer, and Enter sends it (not a toggle)
    with qtbot.waitSignal(gui.controller.comparison_finished, timeout=TIMEOUT):
        send_by_keyboard(qtbot, gui, "Why is the sky blue?")
    wait_idle(qtbot, gui)
    assert window.comparison_mode
    assert gui.store.messages(gui.controller.conversation_id)[0].content == "Why is the sky blue?"

    qtbot.mouseClick(window.comparison_view.replay_button, Qt.MouseButton.LeftButton)
    assert window.focusWidget() is window.composer.edit
    wait_idle(qtbot, gui)


def test_comparison_panes_follow_show_speculation(qtbot, make_gui, tiny_pair,
                                                  screenshots_dir) -> None:
    target, draft = tiny_pair
    gui = make_gui(spec_settings(target, draft, max_tokens=60))
    window = gui.window
    window.resize(1280, 800)
    window.compare_action.trigger()
    with qtbot.waitSignal(gui.controller.comparison_finished, timeout=TIMEOUT) as blocker:
        send_by_keyboard(qtbot, gui, "The cat sat on the mat.")
    wait_idle(qtbot, gui)
    view = window.comparison_view
    panes = (view.speculative, view.plain)

    def styled(pane) -> int:
        return sum(kind_of(fmt) is not None for _, fmt, _ in fragments(pane.browser.document()))

    assert all(styled(p) > 0 for p in panes)
    spark = view.speculative.gauge.sparkline.values
    assert len(spark) > 3 and sparkline_top(spark) <= max(spark)
    window.grab().save(str(screenshots_dir / "comparison_speculation.png"))

    window.speculation_action.trigger()  # View ▸ Show Speculation off: clean Markdown
    assert not window.chat_view.show_speculation
    assert all(styled(p) == 0 for p in panes)
    assert view.plain.browser.document().toPlainText().strip() == \
        blocker.args[0].plain_text.strip()
    window.grab().save(str(screenshots_dir / "comparison_markdown.png"))

    window.speculation_action.trigger()
    assert all(styled(p) > 0 for p in panes)


def test_long_chat_titles_are_elided_with_the_full_title_on_hover(qtbot, make_gui, tiny_pair,
                                                                  screenshots_dir) -> None:
    gui = make_gui(plain_settings(tiny_pair[0]))
    title = "A question about " + "very " * 30 + "long titles in the sidebar"
    for text in ("A question", "Another question"):
        gui.controller.new_conversation()
        gui.controller.send(text)
        wait_idle(qtbot, gui)
    cid = gui.store.conversations()[-1].id
    gui.controller.rename_conversation(cid, title)
    sidebar = gui.window.sidebar
    view = sidebar.list_view
    qtbot.waitUntil(lambda: view.model().rowCount() == 2)
    index = next(view.model().index(r, 0) for r in range(2)
                 if view.model().index(r, 0).data(ConversationIdRole) == cid)
    assert view.horizontalScrollBar().maximum() == 0
    assert not view.horizontalScrollBar().isVisible()
    assert view.visualRect(index).width() <= view.viewport().width()
    assert title in index.data(Qt.ItemDataRole.ToolTipRole)
    sidebar.grab().save(str(screenshots_dir / "sidebar_long_title.png"))


def test_loading_a_model_shows_determinate_progress(qtbot, make_gui, tiny_pair,
                                                    screenshots_dir) -> None:
    gui = make_gui(plain_settings(tiny_pair[0]))  # starts loading the target
    bar = gui.window.load_progress
    seen: list[tuple[int, int, int, int, bool]] = []  # done, total, bar max, value, visible

    def record(done: int, total: int) -> None:  # runs after the window's own handler
        seen.append((done, total, bar.maximum(), bar.value(), bar.isVisible()))
        if len(seen) == 2:
            gui.window.statusBar().grab().save(str(screenshots_dir / "load_progress.png"))

    gui.controller.model_load_progressed.connect(record)
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    assert len(seen) > 2
    assert all(visible and maximum == 1000 for *_, maximum, _, visible in seen)
    values = [value for *_, value, _ in seen]
    assert values == sorted(values) and values[0] < 1000 and values[-1] == 1000
    assert seen[-1][0] == seen[-1][1] > 0
    assert not bar.isVisible()
    assert "of weights read" in bar.toolTip()


def test_pickers_offer_choose_a_folder(qtbot, make_gui, tiny_pair, tmp_path, monkeypatch,
                                      screenshots_dir) -> None:
    from PySide6.QtWidgets import QFileDialog

    from tests.fixtures.tiny_models import write_tiny_model

    target, draft = tiny_pair
    gui = make_gui(plain_settings(target))
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    panel = gui.window.settings_panel
    chosen: list[str] = []
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: chosen[-1])

    def choose(combo, folder) -> None:
        chosen.append(str(folder))
        last = combo.count() - 1
        assert combo.itemText(last) == "Choose a folder…"
        combo.setCurrentIndex(last)  # what picking the entry does

    # a draft model from anywhere on disk
    choose(panel.draft_combo, draft)
    assert panel.draft_combo.currentText() != "Choose a folder…"  # never left selected
    qtbot.waitUntil(lambda: gui.controller.settings.draft == str(draft), timeout=TIMEOUT)
    assert panel.draft_combo.currentData() == str(draft)
    assert panel.draft_reason(str(draft)) is None

    # a folder that holds no model is refused, with the reason, and nothing changes
    (tmp_path / "photos").mkdir()
    choose(panel.target_combo, tmp_path / "photos")
    qtbot.waitUntil(lambda: "not a model folder" in panel.model_status.text(), timeout=TIMEOUT)
    assert gui.controller.settings.target == str(target)

    # a target model folder: chosen, listed, loaded
    other = write_tiny_model(tmp_path / "Elsewhere", seed=3)
    choose(panel.target_combo, other)
    qtbot.waitUntil(lambda: gui.controller.model is not None
                    and gui.controller.model.spec == str(other), timeout=TIMEOUT)
    assert panel.target_combo.currentData() == str(other)
    assert panel.target_combo.currentText() == "Elsewhere"
    panel.target_combo.showPopup()
    panel.target_combo.view().window().grab().save(str(screenshots_dir / "target_picker.png"))
    panel.target_combo.hidePopup()
