"""Help ▸ Diagnostics…: `understudy doctor`'s report in a window.

The report comes from the engine thread (`EngineWorker.run_doctor`): on a Mac the kernels'
self-test runs MLX on the GPU, which must not happen on the GUI thread. Opening the window
shows the recorded verdicts (or runs the checks the first time); "Run checks again"
re-tests every kernel on this device.
"""

from __future__ import annotations

from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

from app.ui.tool_window import ToolWindow
from app.ui.worker import EngineHost


class DiagnosticsDialog(ToolWindow):
    """A tool window over the engine host's `doctor_reported` signal."""

    def __init__(self, host: EngineHost, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.host = host
        self.setWindowTitle("Diagnostics")
        self.status = QLabel()
        self.report = QPlainTextEdit()
        self.report.setReadOnly(True)
        self.report.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.report.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.recheck_button = QPushButton("Run checks again")
        self.recheck_button.clicked.connect(lambda: self.run(recheck=True))
        buttons = QHBoxLayout()
        buttons.addWidget(self.status, 1)
        buttons.addWidget(self.recheck_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.report, 1)
        layout.addLayout(buttons)
        self.resize(720, 360)
        host.worker.doctor_reported.connect(self._on_doctor_reported)

    def run(self, recheck: bool = False) -> None:
        """Ask the engine thread for the report (after any reply in progress)."""
        self.recheck_button.setEnabled(False)
        self.status.setText("Checking this machine…")
        self.host.doctor(recheck)

    def _on_doctor_reported(self, lines: list[str]) -> None:
        self.report.setPlainText("\n".join(lines))
        self.recheck_button.setEnabled(True)
        self.status.setText("")
