"""`understudy` with no arguments: the desktop app on a qasync event loop.

qasync lets asyncio coroutines (hub search and downloads) run on Qt's event loop; all MLX
work stays on the engine worker thread, started here and joined on the way out.
"""

from __future__ import annotations

import asyncio
import sys

from PySide6.QtWidgets import QApplication

from app.store import Store, StoreError
from app.ui.controller import ChatController
from app.ui.main_window import MainWindow, load_chat_settings, settings_store
from app.ui.theme import apply_theme
from app.ui.worker import EngineHost


def run_gui(model_spec: str = "demo") -> int:
    """Open the main window on `model_spec` and run until it closes; returns the exit code."""
    import qasync

    app = QApplication.instance() or QApplication(sys.argv)
    app.setApplicationName("Understudy")
    app.setOrganizationName("Understudy")
    app.setApplicationDisplayName("Understudy")
    apply_theme(app)
    try:
        store = Store()
    except StoreError as exc:
        print(f"understudy: {exc}", file=sys.stderr)
        return 1
    host = EngineHost()
    qs = settings_store()
    controller = ChatController(store, host, load_chat_settings(qs, model_spec))
    window = MainWindow(controller, qs)
    window.open_initial_conversation()
    window.show()
    controller.load_model()

    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    closing = asyncio.Event()
    app.aboutToQuit.connect(closing.set)
    try:
        with loop:
            loop.run_until_complete(closing.wait())
    finally:
        host.shutdown()
        store.close()
    return 0
