"""`understudy` with no arguments: the desktop app on a qasync event loop.

qasync lets asyncio coroutines (hub search and downloads) run on Qt's event loop; all MLX
work stays on the engine worker thread, started here and joined on the way out. The log
goes to the platform log dir and an uncaught exception shows where (`app.ui.crash`);
`smoke=True` drives one message end to end and quits (`app.ui.smoke`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
from pathlib import Path

from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QApplication, QMessageBox

from app.bounded_exit import exit_now
from app.hub.model_choices import DEMO_SPEC
from app.logs import setup_logging
from app.store import Store, StoreError
from app.ui.app_icon import app_icon
from app.ui.controller import ChatController
from app.ui.crash import CrashHandler
from app.ui.main_window import MainWindow
from app.ui.settings_file import read_settings, settings_store
from app.ui.theme import apply_theme
from app.ui.worker import ChatSettings, EngineHost
from engine.errors import AppDataError
from engine.paths import models_dir

log = logging.getLogger("understudy")


def run_gui(model_spec: str | None = None, *, smoke: bool = False) -> int:
    """Open the main window and run until it closes; returns the exit code.

    The window opens on `model_spec` when given (`understudy --model X`), else on the model
    last used; one that no longer loads gives way to the demo model, with a banner saying so.
    With `smoke`, the window opens offscreen (unless QT_QPA_PLATFORM says otherwise) over a
    scratch history and settings file, answers one message on `model_spec` (default: the
    demo) and quits: 0 when it worked.
    """
    import qasync

    log_path = setup_logging()
    log.info("Understudy starting (%s)", "smoke test" if smoke else "GUI")
    if smoke:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before QApplication exists
    app = QApplication.instance() or QApplication(sys.argv)
    app.setApplicationName("Understudy")
    app.setOrganizationName("Understudy")
    app.setApplicationDisplayName("Understudy")
    app.setWindowIcon(app_icon())
    apply_theme(app)
    scratch = tempfile.TemporaryDirectory(prefix="understudy-smoke-") if smoke else None
    try:
        store = Store(Path(scratch.name) / "history.sqlite3") if scratch else Store()
        # a file where the models folder belongs is said here, in a dialog, not as an
        # error from inside the window being built (a launcher shows no terminal)
        models_dir()
    except (StoreError, AppDataError) as exc:
        log.error("%s", exc)
        print(f"understudy: {exc}", file=sys.stderr)
        if not smoke:  # a user who opened the app from a launcher sees no terminal
            QMessageBox.critical(None, "Understudy", str(exc))
        return 1
    if store.repair is not None:
        log.warning("chat history damaged (%s): set aside as %s; carried %d conversations, "
                    "%d messages", store.repair.reason, store.repair.damaged,
                    store.repair.conversations, store.repair.messages)
    host = EngineHost()
    crash: CrashHandler | None = None
    run = None
    try:  # from here on the engine thread runs: whatever fails, it is joined on the way out
        if scratch:
            from app.ui.smoke import SMOKE_MAX_TOKENS

            qs = QSettings(str(Path(scratch.name) / "settings.ini"), QSettings.Format.IniFormat)
            settings = ChatSettings(target=model_spec or DEMO_SPEC, max_tokens=SMOKE_MAX_TOKENS)
            damage = None
        else:
            qs = settings_store()
            settings, damage = read_settings(qs, model_spec)
        controller = ChatController(store, host, settings)
        if not smoke:
            controller.fallback_target = DEMO_SPEC
        window = MainWindow(controller, qs)
        crash = CrashHandler(controller, log_path, window, show_dialog=not smoke)
        crash.install()
        if smoke:
            from app.ui.smoke import SmokeRun

            run = SmokeRun(controller, window)
        window.open_initial_conversation()
        if damage is not None:  # below the history's notice, when it has one
            shown = window.banner.text
            window.banner.show_message(f"{shown}\n{damage.message()}" if shown
                                       else damage.message())
        window.show()
        controller.load_model()

        loop = qasync.QEventLoop(app)
        asyncio.set_event_loop(loop)
        closing = asyncio.Event()
        app.aboutToQuit.connect(closing.set)
        with loop:
            loop.run_until_complete(closing.wait())
    finally:
        if crash is not None:
            crash.uninstall()
        engine_stopped = host.shutdown()
        store.close()
        if scratch:
            scratch.cleanup()
        if not engine_stopped:
            # still inside an MLX call (a model load, a calibration) that cannot be
            # interrupted: Qt aborts when a running QThread is destroyed and native exit
            # handlers may wait on it, so leave now; the history is saved and closed
            log.warning("the engine thread was still busy when the app quit; leaving without it")
            exit_now(_exit_code(run, crash))
    return _exit_code(run, crash)


def _exit_code(run, crash: CrashHandler | None) -> int:
    """0, or in smoke mode the smoke run's verdict (1 if anything crashed or it never ended)."""
    if run is None:
        return 0
    return 1 if (crash is not None and crash.count) or run.exit_code is None else run.exit_code
