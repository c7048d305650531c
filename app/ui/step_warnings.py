"""Steps that fell back to plain decoding, said once: a status-bar line and the log.

A drafter's malformed draft (a bad tree) is refused before the pass and its step runs as a
plain step, with the reason on `Step.error`; the chat view marks that step's tokens. A
drafter that keeps failing fails on most steps of a reply, so this says it once rather
than per step and never in a dialog: a status-bar line with the latest reason and how
many steps of the reply fell back (its tooltip lists each distinct reason with its count),
and one warning in the log file per distinct reason per reply. A new reply starts afresh.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget

from app.store import Message
from app.ui.controller import ChatController
from app.ui.theme import widget_is_dark
from app.ui.token_render import WARNING_COLORS, WARNING_MARK
from engine.events import Stats, Step

log = logging.getLogger("understudy.steps")


class StepWarnings(QLabel):
    """The status bar's line about the current reply's fallback steps (hidden when none)."""

    def __init__(self, controller: ChatController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("stepWarnings")
        self.counts: dict[str, int] = {}  # distinct reason -> steps of this reply
        # a long reason is elided in the bar, not allowed to widen the window
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.setMinimumWidth(160)
        self.hide()
        controller.message_added.connect(self._on_message_added)
        controller.step_received.connect(self._on_step_received)

    def _on_message_added(self, message: Message) -> None:
        if message.role == "assistant":  # a new reply: its own count
            self.counts.clear()
            self.clear()
            self.setToolTip("")
            self.hide()

    def _on_step_received(self, _message_id: int, step: Step, _stats: Stats) -> None:
        if step.error:
            self.note(step.error)

    def note(self, error: str) -> None:
        """Count one fallback step; log its reason the first time this reply sees it."""
        if error not in self.counts:
            log.warning("a step fell back to a plain step: %s", error)
        self.counts[error] = self.counts.get(error, 0) + 1
        total = sum(self.counts.values())
        steps = "1 step" if total == 1 else f"{total} steps"
        self.setText(f"{WARNING_MARK} {steps} ran without drafts: {error}")
        self.setToolTip("Steps of this reply that fell back to a plain step:\n" + "\n".join(
            f"{n}× {e}" for e, n in self.counts.items()))
        self.show()

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt override
        painter = QPainter(self)
        painter.setPen(QColor(WARNING_COLORS[widget_is_dark(self)]))
        rect = self.contentsRect()
        text = self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight,
                                             rect.width())
        painter.drawText(rect, int(Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignLeft),
                         text)
