"""What the app does with an exception nobody caught: save, log, tell the user where.

PySide6 hands an exception raised in a slot to `sys.excepthook` and carries on. The packaged
app has no terminal to print it to, so the hook records the reply in flight as stopped (the
store already holds every finished step), writes the traceback to the log file and shows a
dialog naming that file. The app keeps running; the user decides whether to quit.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from PySide6.QtCore import Qt, QThread, QTimer
from PySide6.QtWidgets import QApplication, QMessageBox, QWidget

from app.ui.controller import ChatController

log = logging.getLogger("understudy.crash")

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], None]


def crash_message(exc: BaseException, log_path: Path) -> str:
    """The dialog's text: what happened in one line, that the chat is safe, and the log."""
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return (f"Understudy hit an unexpected error ({what}).\n\n"
            "Your chat was saved. The details are in the log file:\n"
            f"{log_path}")


class CrashHandler:
    """Installed as `sys.excepthook` (and `threading.excepthook`) by `install`."""

    def __init__(self, controller: ChatController, log_path: Path,
                 parent: QWidget | None = None, *, show_dialog: bool = True) -> None:
        self.controller = controller
        self.log_path = log_path
        self.parent = parent
        self.show_dialog = show_dialog
        self.dialog: QMessageBox | None = None
        self.count = 0
        self._previous: ExceptHook | None = None
        self._previous_thread_hook = threading.excepthook

    def install(self) -> None:
        self._previous = sys.excepthook
        self._previous_thread_hook = threading.excepthook
        sys.excepthook = self.handle
        threading.excepthook = self._handle_thread

    def uninstall(self) -> None:
        if sys.excepthook == self.handle and self._previous is not None:
            sys.excepthook = self._previous
        if threading.excepthook == self._handle_thread:
            threading.excepthook = self._previous_thread_hook

    def handle(self, exc_type: type[BaseException], exc: BaseException,
               tb: TracebackType | None) -> None:
        """Log now (from any thread); save and show the dialog on the GUI thread."""
        if issubclass(exc_type, KeyboardInterrupt):
            QApplication.quit()
            return
        self.count += 1
        log.critical("uncaught exception", exc_info=(exc_type, exc, tb))
        app = QApplication.instance()
        if app is not None and QThread.currentThread() is not app.thread():
            # a slot on the engine thread raised: widgets belong to the GUI thread
            QTimer.singleShot(0, app, lambda: self._report(exc))
        else:
            self._report(exc)

    def _report(self, exc: BaseException) -> None:
        try:
            self.controller.close()  # stop the reply in flight and record it as stopped
        except Exception:  # the store itself may be what failed; the log has the first error
            log.exception("could not save the chat after an uncaught exception")
        if self.show_dialog and self.dialog is None:  # one dialog at a time
            self.dialog = QMessageBox(QMessageBox.Icon.Critical, "Understudy",
                                      crash_message(exc, self.log_path),
                                      QMessageBox.StandardButton.Ok, self.parent)
            self.dialog.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            self.dialog.finished.connect(self._on_dialog_closed)
            self.dialog.open()  # not exec(): never a nested event loop inside a hook

    def _handle_thread(self, args: threading.ExceptHookArgs) -> None:
        self.handle(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback)

    def _on_dialog_closed(self) -> None:
        self.dialog = None
