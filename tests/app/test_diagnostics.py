"""Help ▸ Diagnostics…: the window shows `understudy doctor`'s report from the engine thread."""

from __future__ import annotations

import mlx.core as mx
from PySide6.QtWidgets import QApplication

from app.ui.worker import ChatSettings


def test_diagnostics_window_shows_the_doctor_report(qtbot, make_gui, tiny_pair,
                                                    screenshots_dir) -> None:
    gui = make_gui(ChatSettings(target=str(tiny_pair[0])))
    help_menu = next(a.menu() for a in gui.window.menuBar().actions() if a.text() == "&Help")
    action = next(a for a in help_menu.actions() if a.text() == "Diagnostics…")
    action.trigger()
    dialog = gui.window.diagnostics_dialog
    assert dialog is not None and dialog.isVisible()
    qtbot.waitUntil(lambda: dialog.report.toPlainText() != "", timeout=60_000)
    text = dialog.report.toPlainText()
    assert text.startswith("backend: ")
    if not mx.metal.is_available():
        assert "BLAS: " in text and text.endswith("kernels: no Metal: references in use")
    assert dialog.recheck_button.isEnabled()
    QApplication.processEvents()
    dialog.grab().save(str(screenshots_dir / "diagnostics.png"))
    # Run again: the button is off while the engine thread works, then the report returns.
    dialog.report.clear()
    dialog.recheck_button.click()
    assert not dialog.recheck_button.isEnabled()
    qtbot.waitUntil(lambda: dialog.report.toPlainText().startswith("backend: "),
                    timeout=60_000)
    assert dialog.recheck_button.isEnabled()
