"""The progress of a model import (File ▸ Import GGUF…, or the Models panel's buttons).

A GGUF conversion reads and converts the file tensor by tensor on the engine thread, which
takes from seconds to minutes; this window follows `ModelsController`'s import signals and
closes itself when the import ends. It blocks nothing: the chat stays usable meanwhile.
When the source's name is already in the library, `ask_import_name` asks for another.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QInputDialog, QLabel, QProgressBar, QVBoxLayout, QWidget

from app.ui.models_controller import ModelsController
from app.ui.tool_window import ToolWindow


class ImportProgressDialog(ToolWindow):
    """A small tool window: the file being imported and a tensors-done bar."""

    def __init__(self, controller: ModelsController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Importing model")
        self.source = Path()
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.progress = QProgressBar()
        self.progress.setMinimumWidth(360)
        layout = QVBoxLayout(self)
        layout.addWidget(self.label)
        layout.addWidget(self.progress)
        controller.import_started.connect(self._on_import_started)
        controller.import_progressed.connect(self._on_import_progressed)
        controller.import_ended.connect(self._on_import_ended)

    def _on_import_started(self, path: str) -> None:
        self.source = Path(path)
        self.label.setText(f"Importing {self.source.name}…")
        self.progress.setRange(0, 0)  # busy until the first tensor is converted
        self.progress.setFormat("%p%")
        self.show()
        self.raise_()

    def _on_import_progressed(self, done: int, total: int) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(done)
        self.progress.setFormat("%v / %m tensors")
        if done >= total:
            self.label.setText(f"Writing {self.source.name} into the library…")

    def _on_import_ended(self, _ok: bool) -> None:
        self.hide()


def ask_import_name(controller: ModelsController, parent: QWidget, path: str, taken: str,
                    free: str) -> QInputDialog:
    """Ask for another name for an import whose name is taken (the CLI's message says to
    use --name, which the window has no place for), prefilled with a free one; OK imports
    under it. Window-modal and returned at once, so a caller (or test) can drive it."""
    dialog = QInputDialog(parent)
    dialog.setWindowTitle("Import Model")
    dialog.setLabelText(f"The library already has a model named “{taken}”.\n"
                        f"Import {Path(path).name} as:")
    dialog.setTextValue(free)
    dialog.setOkButtonText("Import")
    dialog.setWindowModality(Qt.WindowModality.WindowModal)
    dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)

    def accepted(name: str) -> None:
        if name.strip():
            controller.import_path(path, name.strip())

    dialog.textValueSelected.connect(accepted)
    dialog.open()
    return dialog
