"""Chat ▸ Train a Drafter for This Model…: start, follow and stop a head's training.

Training runs on the engine thread in short slices (`EngineWorker.train_drafter`), so a
message sent meanwhile is answered between two slices: training pauses while the reply is
written and continues after it. This window shows the job's phase, the data made, the
steps, the loss and the held-out agreement of the newest checkpoint; Stop writes a
checkpoint, and starting again resumes from it.
"""

from __future__ import annotations

from PySide6.QtGui import QResizeEvent, QShowEvent
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.ui.controller import ChatController
from app.ui.tool_window import ToolWindow

PHASES = {"data": "Writing practice replies", "train": "Training",
          "checkpoint": "Training (checkpoint saved)", "done": "Done"}


class TrainDrafterDialog(ToolWindow):
    """A small tool window over the engine host's training signals."""

    def __init__(self, controller: ChatController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.setWindowTitle("Train a drafter")
        self.intro = QLabel()
        self.intro.setWordWrap(True)
        self.minutes = QDoubleSpinBox()
        self.minutes.setRange(1, 24 * 60)
        self.minutes.setDecimals(0)
        self.minutes.setValue(60)
        self.minutes.setSuffix(" min")
        self.progress = QProgressBar()
        self.progress.setMinimumWidth(380)
        self.progress.setRange(0, 1000)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.start_button = QPushButton("Start")
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        form = QFormLayout()
        form.addRow("Time budget", self.minutes)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.stop_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.intro)
        layout.addLayout(form)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addLayout(buttons)
        self.start_button.clicked.connect(self.start)
        self.stop_button.clicked.connect(self.stop)
        worker = controller.host.worker
        worker.training_progressed.connect(self._on_training_progressed)
        worker.training_ended.connect(self._on_training_ended)
        self._say("Not started")
        self.refresh()

    def _say(self, text: str) -> None:
        self.status.setText(text)
        self._fit_height()

    def _fit_height(self) -> None:
        """Keep the window at least as tall as its wrapped text needs at its width.

        A top-level window does not follow its layout's height-for-width: it keeps the
        height it has (or its size hint's, taken before the intro is filled in), and the
        intro or a long status line was clipped. The minimum height grows the window and
        stops the user shrinking it past the text. Only a shown window has its real width.
        """
        layout = self.layout()
        if not self.isVisible() or layout is None or not layout.hasHeightForWidth():
            return
        self.setMinimumHeight(layout.totalHeightForWidth(self.width()))

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802 - Qt override
        super().showEvent(event)
        self._fit_height()

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self._fit_height()  # narrower: the text wraps onto more lines

    @property
    def running(self) -> bool:
        return self.stop_button.isEnabled()

    def refresh(self) -> None:
        model = self.controller.model
        name = model.name if model is not None else self.controller.settings.target
        self.intro.setText(
            f"Teach a small drafter head to guess {name}'s next "
            "tokens from its own replies. It runs in the background and pauses while a reply "
            "is written; stop any time and start again to continue.")
        self._fit_height()

    def start(self) -> None:
        self.controller.host.train_drafter(self.controller.settings.target,
                                           self.minutes.value())
        self.start_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self.minutes.setEnabled(False)
        self.progress.setValue(0)
        self._say("Starting…")

    def stop(self) -> None:
        self.controller.host.cancel_training()
        self.stop_button.setEnabled(False)
        self._say("Stopping after a checkpoint…")

    def _on_training_progressed(self, p) -> None:
        self.progress.setValue(int(p.fraction * 1000))
        parts = [PHASES.get(p.phase, p.phase),
                 f"{p.data_tokens:,} reply tokens from {p.data_sequences} replies"]
        if p.step and p.loss is not None:
            parts.append(f"step {p.step}, loss {p.loss:.3f}")
        elif p.step:
            parts.append(f"step {p.step}")
        if p.heldout_top1 is not None:
            parts.append(f"held-out top-1 {p.heldout_top1:.1%}")
        self._say(" · ".join(parts))

    def _on_training_ended(self, last, error: str) -> None:
        self.start_button.setEnabled(True)
        self.stop_button.setEnabled(False)
        self.minutes.setEnabled(True)
        if error:
            self._say(f"Stopped: {error}")
        elif last is not None and not last.checkpoint:
            self._say(f"No drafter yet: the time went to making data "
                      f"({last.data_sequences} replies, kept). Start again to train from it.")
        elif last is not None and not last.new_checkpoint:
            self._say(f"No training steps this time ({last.data_sequences} replies of data "
                      f"kept). The drafter from step {last.step} stays in use; start again "
                      "to train on.")
        elif last is not None:
            self.progress.setValue(1000)
            top1 = (f", held-out top-1 {last.heldout_top1:.1%}"
                    if last.heldout_top1 is not None else "")
            self._say(f"Saved after {last.step} steps{top1}. Pick 'head' or 'auto' as the "
                      "drafter to use it.")
