"""What the packaged app needs from the app itself: resources and the demo model found inside
a bundle, the frozen re-exec, the log file, the crash dialog, `--smoke`, the window icon.

The bundle itself is built and run in tests/packaging/test_bundle.py (slow).
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMessageBox

from app.cli.launcher import reexec_command
from app.logs import LOG_FILE, setup_logging
from app.store import COMPLETE, STOPPED
from app.ui.app_icon import app_icon
from app.ui.crash import CrashHandler
from app.ui.smoke import SMOKE_MESSAGE, SmokeRun
from app.ui.worker import ChatSettings
from engine import demo
from engine.paths import log_dir
from resources import bundle_dir, resource_path

TIMEOUT = 60_000


@pytest.fixture
def fake_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The process looks like PyInstaller's: `sys.frozen` and `sys._MEIPASS` set."""
    root = tmp_path / "_internal"
    (root / "resources" / "bench").mkdir(parents=True)
    (root / "resources" / "bench" / "prompts.jsonl").write_text("{}\n")
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(root), raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "Understudy"))
    return root


def test_resources_from_the_checkout() -> None:
    assert bundle_dir() is None
    path = resource_path("catalog.json")
    assert path.is_file() and path.parent == Path(__file__).resolve().parents[2] / "resources"


def test_resources_and_demo_model_from_a_bundle(fake_bundle: Path) -> None:
    assert bundle_dir() == fake_bundle
    assert resource_path("bench", "prompts.jsonl") == fake_bundle / "resources/bench/prompts.jsonl"
    assert resource_path("bench", "prompts.jsonl").read_text() == "{}\n"
    assert demo.demo_gguf_path() != fake_bundle / demo.DEMO_PACKAGE / demo.DEMO_FILE
    gguf = fake_bundle / demo.DEMO_PACKAGE / demo.DEMO_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    assert demo.demo_gguf_path() == gguf


def test_reexec_runs_the_bundle_executable_itself(fake_bundle: Path) -> None:
    assert reexec_command(["generate", "--model", "demo"]) == [
        sys.executable, "generate", "--model", "demo"]


def test_reexec_from_a_checkout_runs_the_module() -> None:
    assert reexec_command(["chat"]) == [sys.executable, "-m", "app.cli", "chat"]


def test_log_file_goes_to_the_log_dir(data_dir: Path) -> None:
    assert log_dir() == data_dir / "logs"
    path = setup_logging()
    try:
        assert path == data_dir / "logs" / LOG_FILE
        logging.getLogger("understudy.test").warning("written to the log %d", 42)
        for h in logging.getLogger().handlers:
            h.flush()
        assert "WARNING understudy.test: written to the log 42" in path.read_text()
    finally:
        root = logging.getLogger()
        for h in [h for h in root.handlers if getattr(h, "baseFilename", "") == str(path)]:
            root.removeHandler(h)
            h.close()


def test_window_icon_has_every_size(qapp) -> None:
    icon = app_icon()
    assert {s.width() for s in icon.availableSizes()} == {16, 32, 48, 64, 128, 256}


def _dialogs() -> list[QMessageBox]:
    return [w for w in QApplication.topLevelWidgets()
            if isinstance(w, QMessageBox) and w.isVisible()]


def test_uncaught_exception_saves_the_reply_then_shows_the_log(qtbot, make_gui, tiny_pair,
                                                                tmp_path: Path,
                                                                caplog) -> None:
    gui = make_gui(ChatSettings(target=str(tiny_pair[0]), drafter="off", max_tokens=5000))
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    log_path = tmp_path / "understudy.log"
    handler = CrashHandler(gui.controller, log_path, gui.window)
    hooks_before = (sys.excepthook, threading.excepthook)
    handler.install()
    try:
        assert gui.controller.send("count to a thousand")
        reply_id = gui.window.chat_view.cards[-1].message_id
        qtbot.waitUntil(lambda: len(gui.store.steps(reply_id)) >= 2, timeout=TIMEOUT)

        def broken_slot() -> None:
            raise RuntimeError("boom in a slot")

        QTimer.singleShot(0, broken_slot)  # PySide6 hands a slot's exception to sys.excepthook
        qtbot.waitUntil(lambda: handler.count == 1, timeout=TIMEOUT)
        [record] = [r for r in caplog.records if r.name == "understudy.crash"]
        assert record.levelname == "CRITICAL" and str(record.exc_info[1]) == "boom in a slot"
        reply = gui.store.message(reply_id)
        assert reply.status == STOPPED and reply.steps  # saved, and not left "generating"
        [dialog] = _dialogs()
        assert "RuntimeError: boom in a slot" in dialog.text()
        assert str(log_path) in dialog.text() and "Your chat was saved" in dialog.text()
        dialog.accept()
        qtbot.waitUntil(lambda: handler.dialog is None)

        # from another thread: logged there, reported on the GUI thread
        worker = threading.Thread(target=lambda: 1 / 0)
        worker.start()
        worker.join()
        qtbot.waitUntil(lambda: len(_dialogs()) == 1, timeout=TIMEOUT)
        assert "ZeroDivisionError" in _dialogs()[0].text() and handler.count == 2
        _dialogs()[0].accept()
    finally:
        handler.uninstall()
    assert sys.excepthook is hooks_before[0]
    assert threading.excepthook is hooks_before[1]


def test_smoke_run_answers_one_message_then_quits(qtbot, make_gui, tiny_pair) -> None:
    gui = make_gui(ChatSettings(target=str(tiny_pair[0]), drafter="off", max_tokens=8))
    quits: list[int] = []
    # the worker's model_loaded reaches the GUI thread through the event loop, which has not
    # run yet: the run is listening before it arrives
    run = SmokeRun(gui.controller, gui.window, quit_app=lambda: quits.append(1))
    qtbot.waitUntil(lambda: run.exit_code is not None, timeout=TIMEOUT)
    assert run.exit_code == 0 and quits == [1]
    user, reply = gui.store.messages(gui.controller.conversation_id)
    assert user.content == SMOKE_MESSAGE
    assert reply.status == COMPLETE and reply.content == run.reply != ""


def test_smoke_run_fails_on_a_model_that_does_not_load(qtbot, make_gui, tmp_path) -> None:
    gui = make_gui(ChatSettings(target=str(tmp_path / "no-such-model"), drafter="off"))
    run = SmokeRun(gui.controller, gui.window, quit_app=lambda: None)
    qtbot.waitUntil(lambda: run.exit_code is not None, timeout=TIMEOUT)
    assert run.exit_code == 1


def test_smoke_flag_parses() -> None:
    from app.cli.main import build_parser

    assert build_parser().parse_args(["--smoke"]).smoke is True
    assert build_parser().parse_args([]).smoke is False
