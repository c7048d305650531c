"""GUI tests run offscreen; every test gets its own app-data dir and settings file."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before any Qt import

from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from PySide6.QtCore import QSettings  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app.store import Store  # noqa: E402
from app.ui.controller import ChatController  # noqa: E402
from app.ui.main_window import MainWindow  # noqa: E402
from app.ui.theme import apply_theme  # noqa: E402
from app.ui.worker import ChatSettings, EngineHost  # noqa: E402

SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated UNDERSTUDY_DATA_DIR (history database, imported models)."""
    d = tmp_path / "data"
    d.mkdir()
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(d))
    return d


@pytest.fixture
def screenshots_dir() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny random target and a smaller draft sharing its tokenizer.

    With K fixed at 4 and greedy sampling this draft is right often enough to give accepted
    and bonus tokens and wrong often enough to give rejected and replaced ones.
    """
    from tests.fixtures.tiny_models import write_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    target = write_tiny_model(root / "tiny-target", seed=0)
    draft = write_tiny_model(root / "tiny-draft", seed=0, hidden_size=32)
    return target, draft


@dataclass
class Gui:
    """One app instance: real store file, real engine thread, real main window."""

    store: Store
    host: EngineHost
    controller: ChatController
    window: MainWindow
    qsettings: QSettings

    def close(self) -> None:
        self.window.close()
        self.host.shutdown()
        self.store.close()


@pytest.fixture
def make_gui(qtbot, tmp_path: Path):
    """Build (and on teardown close) app instances over one history file and settings file."""
    made: list[Gui] = []

    def make(settings: ChatSettings, db: Path | None = None) -> Gui:
        store = Store(db or tmp_path / "history.sqlite3")
        host = EngineHost()
        controller = ChatController(store, host, settings)
        qs = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
        apply_theme(QApplication.instance())  # the app's style sheet, as run_gui sets it
        window = MainWindow(controller, qs)
        qtbot.addWidget(window)
        window.open_initial_conversation()
        window.show()
        controller.load_model()
        gui = Gui(store, host, controller, window, qs)
        made.append(gui)
        return gui

    yield make
    for gui in made:
        if gui.host.thread.isRunning():
            gui.close()
