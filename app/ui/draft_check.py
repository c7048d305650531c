"""Whether a draft model can pair with the target, decided off the GUI thread.

The draft picker disables the models that cannot draft for the target. Deciding that
compares the two tokenizer.json files (`app.hub.model_choices.check_pairing`), and a large
one (10+ MB for a 150k-token vocabulary) took long enough to read that the window froze
each time the picker was filled. Here what the folders alone say, and verdicts already
made, are answered at once; the rest is read by a worker on its own thread, the entry
reads `CHECKING` meanwhile, and `verdict_arrived` tells the picker to ask again.
"""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QObject, QThread, Signal, Slot

from app.hub.model_choices import (
    ModelChoice,
    Pairing,
    check_pairing,
    draft_pairing,
    incompatibility,
    known_verdict,
)
from engine.compat import Compatibility

log = logging.getLogger(__name__)

# the reason a pairing gives while its tokenizers are being compared
CHECKING = "checking that it shares the target's tokenizer…"


class _PairingWorker(QObject):
    """Compares tokenizers on the thread it was moved to; one verdict per request."""

    checked = Signal(object)  # the Pairing whose verdict is now known

    @Slot(object)
    def check(self, pairing: Pairing) -> None:
        try:
            check_pairing(pairing)
        except Exception:  # noqa: BLE001 - a verdict must come, or the entry stays pending
            log.exception("comparing the tokenizers of %s and %s failed", pairing.target,
                          pairing.draft)
        self.checked.emit(pairing)


class DraftChecker(QObject):
    """The draft picker's answer to "can this model draft for the target?", never blocking."""

    verdict_arrived = Signal()  # a comparison ended: ask `reason` again
    _check_requested = Signal(object)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._pending: set[Pairing] = set()
        self._failed: set[Pairing] = set()
        self._thread = QThread()
        self._thread.setObjectName("understudy-draft-check")
        self._worker = _PairingWorker()
        self._worker.moveToThread(self._thread)
        self._thread.finished.connect(self._worker.deleteLater)
        self._check_requested.connect(self._worker.check)
        self._worker.checked.connect(self._on_checked)
        app = QCoreApplication.instance()
        if app is not None:  # a quit that closes no window (crash dialog, smoke run)
            app.aboutToQuit.connect(self.shutdown)
        self._thread.start()

    def reason(self, target: Path | None, draft: ModelChoice) -> str | None:
        """Why `draft` cannot draft for `target`, None when it can, or `CHECKING` while its
        tokenizer is compared with the target's (`verdict_arrived` follows)."""
        pairing = draft_pairing(target, draft)
        if isinstance(pairing, str):
            return pairing
        verdict: Compatibility | None = known_verdict(pairing)
        if verdict is not None:
            return incompatibility(verdict)
        if pairing in self._failed:
            return "its tokenizer could not be compared with the target's (see the log)"
        if pairing not in self._pending:
            self._pending.add(pairing)
            self._check_requested.emit(pairing)
        return CHECKING

    def _on_checked(self, pairing: Pairing) -> None:
        self._pending.discard(pairing)
        if known_verdict(pairing) is None:
            self._failed.add(pairing)
        self.verdict_arrived.emit()

    def shutdown(self) -> None:
        """Stop the worker's thread; a comparison in flight is finished first (it cannot be
        interrupted, and Qt aborts when a running thread is destroyed)."""
        if self._thread.isRunning():
            self._thread.quit()
            self._thread.wait()
