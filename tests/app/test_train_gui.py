"""Chat ▸ Train a Drafter…: progress in the window, a message sent mid-training is answered
between two slices (training pauses, then continues), Stop saves a head the chat then uses."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.ui.worker import ChatSettings
from engine.drafters.head_io import find_head
from engine.loading import load_model
from tests.fixtures.tiny_models import write_tiny_model

TIMEOUT = 180_000


@pytest.fixture
def target(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny4", num_hidden_layers=4, seed=1)


def test_training_progress_pause_on_send_and_stop(qtbot, make_gui, target: Path, data_dir,
                                                  screenshots_dir: Path) -> None:
    gui = make_gui(ChatSettings(target=str(target), drafter="auto", max_tokens=16))
    worker = gui.host.worker
    log: list[tuple[str, int]] = []
    worker.training_progressed.connect(lambda p: log.append((p.phase, p.step)))
    worker.generation_finished.connect(lambda rid, _f: log.append(("reply", rid)))
    ended: list[tuple] = []
    worker.training_ended.connect(lambda last, error: ended.append((last, error)))
    combo = gui.window.settings_panel.drafter_combo
    head_item = combo.model().item(combo.findData("head"))
    # no head yet: the drafter list greys `head` out and says how to get one
    qtbot.waitUntil(lambda: gui.controller.model is not None and not head_item.isEnabled(),
                    timeout=TIMEOUT)
    assert "Train a Drafter" in head_item.toolTip() and not gui.controller.has_head
    gui.window.show_train_drafter()
    dialog = gui.window.train_dialog
    assert dialog is not None and dialog.isVisible()
    # a budget that outlasts the test on a loaded machine: Stop, not the clock, ends the job
    # (the tiny model makes every practice reply in seconds, so data never waits for 40%)
    dialog.minutes.setValue(3)
    qtbot.mouseClick(dialog.start_button, Qt.MouseButton.LeftButton)
    assert dialog.running
    qtbot.waitUntil(lambda: bool(log), timeout=TIMEOUT)
    assert log[0][0] == "data"  # practice replies come first

    # a message sent now is answered while the job is still running, and the job goes on
    edit = gui.window.composer.edit
    qtbot.keyClicks(edit, "Hello there")
    qtbot.keyClick(edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: any(ph == "reply" for ph, _ in log), timeout=TIMEOUT)
    at_reply = next(i for i, (ph, _) in enumerate(log) if ph == "reply")
    assert at_reply > 0  # the job had made progress before the reply...
    qtbot.waitUntil(lambda: any(s >= 2 for ph, s in log[at_reply:] if ph != "reply"),
                    timeout=TIMEOUT)  # ...and went on to train after it
    steps = [s for ph, s in log if ph != "reply"]
    assert steps == sorted(steps)  # one job, paused and resumed, never restarted
    assert "step" in dialog.status.text() and dialog.progress.value() > 0
    dialog.grab().save(str(screenshots_dir / "train_drafter.png"))

    # Stop: a checkpoint, then the window says so
    qtbot.mouseClick(dialog.stop_button, Qt.MouseButton.LeftButton)
    # `ended` is filled on the worker's thread as the job ends; the dialog hears of it
    # through the GUI thread's event queue, and enables Start again when it has
    qtbot.waitUntil(lambda: bool(ended) and dialog.start_button.isEnabled(), timeout=TIMEOUT)
    assert not dialog.running
    last, error = ended[0]
    assert error == "" and last.phase == "done" and last.checkpoint
    assert dialog.status.text().startswith(f"Saved after {last.step} steps")
    assert find_head(load_model(str(target))) is not None
    qtbot.waitUntil(head_item.isEnabled, timeout=TIMEOUT)  # offered once a head is saved
    assert gui.controller.has_head and "own replies" in head_item.toolTip()

    # the next reply's session carries the head: 'head' drafts with it
    gui.controller.set_settings(ChatSettings(target=str(target), drafter="head", k=2,
                                             max_tokens=16))
    drafters: list[str] = []
    gui.controller.step_received.connect(lambda _m, step, _s: drafters.append(step.drafter))
    qtbot.keyClicks(edit, "Again")
    qtbot.keyClick(edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: not gui.controller.generating and bool(drafters), timeout=TIMEOUT)
    assert "head" in drafters
    assert not gui.window.banner.isVisible()


def test_a_job_that_only_made_data_says_no_drafter_yet(qtbot, make_gui, target: Path,
                                                       screenshots_dir: Path) -> None:
    """The job's last report when its minutes went to making data has no checkpoint: the
    window must not claim a head was saved."""
    from engine.training.job import TrainProgress

    gui = make_gui(ChatSettings(target=str(target), drafter="auto", max_tokens=16))
    gui.window.show_train_drafter()
    dialog = gui.window.train_dialog
    worker = gui.host.worker
    only_data = TrainProgress("done", 16, 1200, 0, 0, None, None, 60.0, 1.0)
    worker.training_ended.emit(only_data, "")
    qtbot.waitUntil(lambda: dialog.status.text().startswith("No drafter yet"), timeout=10_000)
    assert "16 replies, kept" in dialog.status.text() and "Saved" not in dialog.status.text()
    dialog.grab().save(str(screenshots_dir / "train_drafter_data_only.png"))
    # a run whose time went to data while a head exists: no loss, the old head stays
    kept = TrainProgress("done", 32, 2400, 5, 900, None, 0.25, 60.0, 1.0, "/x/ckpt-0000005")
    worker.training_progressed.emit(kept)
    worker.training_ended.emit(kept, "")
    qtbot.waitUntil(lambda: dialog.status.text().startswith("No training steps"),
                    timeout=10_000)
    assert "step 5 stays in use" in dialog.status.text()
    assert "Saved" not in dialog.status.text()
    dialog.grab().save(str(screenshots_dir / "train_drafter_no_steps.png"))
    saved = TrainProgress("done", 16, 1200, 5, 900, 2.5, 0.25, 60.0, 1.0, "/x/ckpt-0000005",
                          new_checkpoint=True)
    worker.training_ended.emit(saved, "")
    qtbot.waitUntil(lambda: dialog.status.text().startswith("Saved after 5 steps"),
                    timeout=10_000)


def test_the_window_opens_tall_enough_for_its_text(qtbot, make_gui, target: Path,
                                                   screenshots_dir: Path) -> None:
    """The intro (filled in just before the window shows) must not be clipped, on first
    open, after a longer status line, or when the window is made narrower."""
    gui = make_gui(ChatSettings(target=str(target), drafter="auto", max_tokens=16))
    gui.window.show_train_drafter()
    dialog = gui.window.train_dialog
    qtbot.waitExposed(dialog)

    def fits() -> bool:
        layout = dialog.layout()
        return (dialog.intro.height() >= dialog.intro.heightForWidth(dialog.intro.width())
                and dialog.status.height() >= dialog.status.heightForWidth(dialog.status.width())
                and dialog.height() >= layout.totalHeightForWidth(dialog.width()))

    assert dialog.intro.text().startswith("Teach a small drafter head")
    assert fits()
    dialog.grab().save(str(screenshots_dir / "train_drafter_opened.png"))
    gui.host.worker.training_ended.emit(None, "the practice replies could not be written "
                                        "because the disk is full; free some space and "
                                        "start again to continue where it left off")
    qtbot.waitUntil(lambda: dialog.status.text().startswith("Stopped:"), timeout=10_000)
    qtbot.waitUntil(fits, timeout=5_000)
    dialog.resize(dialog.minimumWidth(), dialog.height())
    qtbot.waitUntil(fits, timeout=5_000)
    dialog.grab().save(str(screenshots_dir / "train_drafter_narrow.png"))
