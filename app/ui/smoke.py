"""`understudy --smoke`: the whole app, end to end, with no one at the keyboard.

It opens the real main window (offscreen unless a platform is set), waits for the model to
load, sends one message through the composer, waits for the reply to finish and quits:
status 0 when a non-empty reply completed, 1 on an error, a crash or the time limit. CI runs
it against the packaged app; anyone can run it to check an install.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer
from PySide6.QtWidgets import QApplication

from app.store import COMPLETE
from app.ui.controller import ChatController
from app.ui.main_window import MainWindow

SMOKE_MESSAGE = "Say hello in one short sentence."
SMOKE_MAX_TOKENS = 24
SMOKE_TIMEOUT_S = 600

log = logging.getLogger("understudy.smoke")


class SmokeRun(QObject):
    """Sends `SMOKE_MESSAGE` once the model is loaded and quits when the reply ends."""

    def __init__(self, controller: ChatController, window: MainWindow,
                 timeout_s: float = SMOKE_TIMEOUT_S,
                 quit_app: Callable[[], None] = QApplication.quit) -> None:
        super().__init__(window)
        self.controller = controller
        self.window = window
        self.timeout_s = timeout_s
        self._quit = quit_app
        self.exit_code: int | None = None
        self.reply = ""
        controller.model_loaded.connect(self._on_model_loaded)
        controller.reply_finished.connect(self._on_reply_finished)
        controller.error_raised.connect(self._on_error)
        QTimer.singleShot(int(timeout_s * 1000), self, self._on_timeout)

    def _on_model_loaded(self, info) -> None:
        if self.controller.generating or self.exit_code is not None:
            return
        self._report(f"model loaded: {info.name}")
        self.window.composer.set_text(SMOKE_MESSAGE)
        self.window.composer.send_button.click()

    def _on_reply_finished(self, message) -> None:
        self.reply = message.content
        ok = message.status == COMPLETE and bool(message.content.strip())
        first = message.content.strip().splitlines()[0] if message.content.strip() else ""
        self._report(f"reply ({message.status}): {first}")
        self._finish(0 if ok else 1)

    def _on_error(self, text: str) -> None:
        self._report(f"error: {text}")
        self._finish(1)

    def _on_timeout(self) -> None:
        self._report(f"no reply within {self.timeout_s:g} s")
        self._finish(1)

    def _finish(self, code: int) -> None:
        if self.exit_code is None:
            self.exit_code = code
            self._quit()

    @staticmethod
    def _report(line: str) -> None:
        log.info("smoke: %s", line)
        print(f"smoke: {line}", flush=True)
