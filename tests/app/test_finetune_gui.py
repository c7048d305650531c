"""Settings ▸ "Improve the drafter from my chats": after a reply that brings enough new
recorded positions, the app fine-tunes the target's head in the background and the status
bar says so; with the setting off nothing is recorded and nothing runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import Qt, QTimer

from app.ui.worker import ChatSettings
from engine.drafters.head_io import current_checkpoint, head_root, read_record
from engine.loading import load_model
from engine.training.job import TrainOptions, train_drafter
from tests.fixtures.tiny_models import write_tiny_model

TIMEOUT = 120_000


@pytest.fixture
def target(tmp_path: Path, data_dir: Path) -> Path:
    """A tiny target with a briefly trained head in the test's app-data dir."""
    path = write_tiny_model(tmp_path / "tiny4", num_hidden_layers=4, seed=1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Tell me about number {i}."})
                                 for i in range(6)))
    loaded = load_model(str(path))
    list(train_drafter(loaded, TrainOptions(minutes=5, data=str(prompts), rounds=1,
                                            max_new=24, max_steps=2)))
    return path


def send(qtbot, gui, text: str) -> None:
    done: list[int] = []
    gui.host.worker.generation_finished.connect(lambda rid, _f: done.append(rid))
    edit = gui.window.composer.edit
    qtbot.keyClicks(edit, text)
    qtbot.keyClick(edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: bool(done) and not gui.controller.generating, timeout=TIMEOUT)


def watched(make_gui, target: Path, improve: bool):
    """The app on `target` with a low fine-tune threshold, the fine-tunes it starts and
    ends (lists filled as the worker reports them), and the head's folder."""
    gui = make_gui(ChatSettings(target=str(target), drafter="auto", max_tokens=16,
                                improve_drafter=improve))
    worker = gui.host.worker
    worker.finetune_after = 10
    started: list[bool] = []
    ended: list[tuple] = []
    worker.finetune_started.connect(lambda: started.append(True))
    worker.finetune_ended.connect(lambda last, error: ended.append((last, error)))
    return gui, started, ended, head_root(Path(load_model(str(target)).path))


def test_background_finetune_after_a_reply_only_when_enabled(qtbot, make_gui, target: Path,
                                                             data_dir: Path,
                                                             screenshots_dir: Path) -> None:
    gui, started, ended, root = watched(make_gui, target, improve=False)
    worker = gui.host.worker
    first = current_checkpoint(root)

    # off (the default): two replies, nothing recorded, nothing started (a fine-tune would
    # have started before the engine took the second request)
    send(qtbot, gui, "Hello there")
    send(qtbot, gui, "And again")
    assert not started and not (root / "online").exists()
    assert current_checkpoint(root) == first

    # on: the next reply is recorded, passes the threshold, and the head is fine-tuned
    gui.window.settings_panel.improve_check.setChecked(True)
    assert gui.controller.settings.improve_drafter
    gui.window.settings_panel.grab().save(str(screenshots_dir / "settings_improve.png"))
    send(qtbot, gui, "Tell me a story")
    qtbot.waitUntil(lambda: bool(ended), timeout=TIMEOUT)
    assert started == [True]
    last, error = ended[0]
    assert error == "" and last.checkpoint
    newest = current_checkpoint(root)
    assert newest is not None and newest != first and str(newest) == last.checkpoint
    record = read_record(newest)
    assert record["data"] == "history" and record["sources"]["online_positions"] > 0
    assert record["online_seq"] >= 1
    status = gui.window.statusBar()
    qtbot.waitUntil(lambda: status.currentMessage().startswith(
        "Drafter improved from your chats"), timeout=TIMEOUT)

    # the same chats do not trigger it again until the buffer grows
    gui.controller.set_settings(replace(gui.controller.settings, max_tokens=4))
    worker.finetune_after = 1000
    send(qtbot, gui, "Short one")
    assert len(started) == 1


def test_a_message_sent_during_the_background_finetune_is_answered_between_its_slices(
        qtbot, make_gui, target: Path, data_dir: Path) -> None:
    """The fine-tune pauses for a reply and then finishes its steps: it is neither a wall
    in front of the chat nor cut short by it. The message is sent the moment the window
    hears the fine-tune began, so the reply must come between its slices."""
    settings = ChatSettings(target=str(target), drafter="auto", max_tokens=16,
                            improve_drafter=True)
    gui = make_gui(settings)
    worker = gui.host.worker
    worker.finetune_after = 10
    worker.finetune_steps = 40
    order: list[str] = []
    ended: list[tuple] = []
    edit = gui.window.composer.edit

    def type_and_send() -> None:
        edit.setPlainText("And another one")
        qtbot.keyClick(edit, Qt.Key.Key_Return)

    def send_at_once() -> None:
        # a plain function connected to the worker's signal runs on the worker's thread;
        # widgets may only be touched on the GUI thread (it segfaulted once in CI)
        order.append("finetune started")
        QTimer.singleShot(0, edit, type_and_send)

    worker.finetune_started.connect(send_at_once)
    worker.finetune_ended.connect(lambda last, error: (order.append("finetune ended"),
                                                       ended.append((last, error))))
    root = head_root(Path(load_model(str(target)).path))
    steps_before = read_record(current_checkpoint(root))["steps"]

    worker.generation_finished.connect(lambda rid, _f: order.append("reply"))
    send(qtbot, gui, "Tell me a story")  # recorded; passes the threshold
    qtbot.waitUntil(lambda: bool(ended), timeout=TIMEOUT)
    assert order == ["reply", "finetune started", "reply", "finetune ended"]
    last, error = ended[0]
    assert error == "" and last.step == steps_before + 40
    assert read_record(current_checkpoint(root))["steps"] == steps_before + 40


def test_no_background_finetune_while_another_job_trains_the_head(qtbot, make_gui,
                                                                  target: Path,
                                                                  data_dir: Path) -> None:
    """A `train-drafter` job holding the head's folder (here: its lock, held by the test)
    is already training it: the app starts no fine-tune and says nothing after each reply;
    once that job is gone the next due reply fine-tunes as usual."""
    from engine.training.job import JOB_LOCK
    from engine.training.locks import exclusive

    gui, started, ended, root = watched(make_gui, target, improve=True)
    first = current_checkpoint(root)
    with exclusive(root / JOB_LOCK, wait=False, busy="the test's job"):
        send(qtbot, gui, "Tell me a story")  # recorded; passes the threshold
        send(qtbot, gui, "And another one")  # a fine-tune would have begun before this
        assert not started and not ended
        assert current_checkpoint(root) == first
        assert not gui.window.statusBar().currentMessage().startswith("Could not")
    send(qtbot, gui, "One more")
    qtbot.waitUntil(lambda: bool(ended), timeout=TIMEOUT)
    assert started == [True] and ended[0][1] == "" and ended[0][0].checkpoint
