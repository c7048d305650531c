"""The Models panel offscreen against a loopback hub: search, download, cancel, resume,
gated repos and the token, offline mode, the library and the pickers.

The hub's answers go through a throttling relay so a download lasts long enough to watch
(and cancel) it; otherwise everything is real: HTTP, the HF cache on disk, the engine
thread that loads the tiny target, the keyring API (with an in-memory backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from pathlib import Path

import keyring
import keyring.errors
import pytest
import qasync
from keyring.backend import KeyringBackend
from PySide6.QtCore import QSettings, Qt, QThread
from PySide6.QtWidgets import QApplication, QFileDialog, QMessageBox

import engine.gguf
from app.hub.catalog import compatible_drafts, load_catalog
from app.hub.download import repo_folder
from app.ui.models_controller import ModelsController
from app.ui.models_panel import ModelsPanel
from app.ui.worker import ChatSettings
from tests.engine.test_gguf import write_tiny_gguf
from tests.fixtures.hub_server import FakeRepo, HubServer, closed_port_endpoint, isolate_hub_env
from tests.fixtures.tiny_models import write_tiny_model

TIMEOUT = 30_000
TARGET = "mlx-community/tiny-llama"
DRAFT = "mlx-community/tiny-draft"
GATED = "mlx-community/tiny-gated"
MAMBA = "mlx-community/tiny-mamba"
SECRET = "hf_PanelSecretToken0123456789"


# ---- fixtures ---------------------------------------------------------------------------
class MemoryKeyring(KeyringBackend):
    """A real keyring backend that keeps passwords in a dict (never the user's keychain)."""

    priority = 1  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.store: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, username: str) -> str | None:
        return self.store.get((service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        self.store[(service, username)] = password

    def delete_password(self, service: str, username: str) -> None:
        if self.store.pop((service, username), None) is None:
            raise keyring.errors.PasswordDeleteError("not found")


class ThrottledRelay:
    """A loopback TCP relay in front of the hub that sends its answers at `bytes_per_s`.

    The hub redirects weights to its own port (its "CDN"); the relay rewrites that port in
    what passes through so those bytes come through the relay too. 0 means full speed.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream_port = int(upstream.rsplit(":", 1)[1])
        self.bytes_per_s = 0
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        old = f"localhost:{self.upstream_port}".encode()
        new = f"localhost:{self.port}".encode()
        try:
            while chunk := src.recv(8192):
                if answers:
                    chunk = chunk.replace(old, new)
                    if self.bytes_per_s:
                        time.sleep(len(chunk) / self.bytes_per_s)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._sockets:
            s.close()


@pytest.fixture
def async_loop(qapp):
    """The qasync loop `run_gui` installs, here made current for the test's duration."""
    loop = qasync.QEventLoop(qapp)
    asyncio.set_event_loop(loop)
    asyncio.events._set_running_loop(loop)  # Qt's loop is the running one: pytest-qt spins it
    yield loop
    asyncio.events._set_running_loop(None)
    loop.close()
    asyncio.set_event_loop(None)


@pytest.fixture
def memory_keyring():
    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


@pytest.fixture(scope="module")
def repo_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-models")
    return {
        "target": write_tiny_model(root / "target", "llama", seed=1),
        "draft": write_tiny_model(root / "draft", "llama", seed=2, hidden_size=32),
    }


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return isolate_hub_env(monkeypatch, tmp_path)


@pytest.fixture
def hub(repo_folders, cache):
    with HubServer() as server:
        state = server.state
        target = state.add(FakeRepo.from_folder(TARGET, repo_folders["target"], downloads=500))
        state.add(FakeRepo.from_folder(DRAFT, repo_folders["draft"], downloads=300))
        state.add(FakeRepo(GATED, dict(target.files), gated=True, config=target.config,
                           downloads=200))
        state.add(FakeRepo(MAMBA, {"config.json": b'{"model_type": "mamba"}',
                                   "model.safetensors": b"\0" * 64},
                           config={"model_type": "mamba"}, downloads=100))
        yield server


@pytest.fixture
def relay(hub, monkeypatch):
    """HF_ENDPOINT points at the relay, which forwards to the hub."""
    r = ThrottledRelay(hub.endpoint)
    monkeypatch.setenv("HF_ENDPOINT", r.endpoint)
    yield r
    r.close()


@pytest.fixture
def gui(make_gui, tiny_pair, relay, memory_keyring, async_loop, qtbot):
    g = make_gui(ChatSettings(target=str(tiny_pair[0]), drafter="off", max_tokens=8))
    qtbot.waitUntil(lambda: g.controller.model is not None, timeout=TIMEOUT)
    return g


def _targets(gui) -> list[str]:
    combo = gui.window.settings_panel.target_combo
    return [combo.itemData(i) for i in range(combo.count())]


def _search(qtbot, panel, text: str, n: int) -> None:
    panel.search_edit.clear()
    qtbot.keyClicks(panel.search_edit, text)
    qtbot.keyClick(panel.search_edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: panel.results_model.rowCount() == n, timeout=TIMEOUT)


def _cell(model, row: int, column: str, role=Qt.ItemDataRole.DisplayRole):
    return model.index(row, model.COLUMNS.index(column)).data(role)


# ---- tests ------------------------------------------------------------------------------
def test_search_download_cancel_resume_then_delete(qtbot, gui, hub, relay, cache, monkeypatch,
                                                   screenshots_dir):
    window = gui.window
    window.models_action.trigger()
    panel = window.show_models()
    assert panel.isVisible()
    assert [m.name for m in panel.controller.library] == ["demo"]  # always listed

    _search(qtbot, panel, "tiny", 4)
    results = panel.results_model
    repos = [results.row_item(r).repo_id for r in range(4)]
    assert repos == [TARGET, DRAFT, GATED, MAMBA]  # most downloaded first
    assert _cell(results, 0, "Supported") == "✓"
    assert _cell(results, 3, "Supported") == "✗"
    assert "'mamba' is not supported" in _cell(results, 3, "Supported", Qt.ItemDataRole.ToolTipRole)
    assert _cell(results, 2, "Repo").endswith("(gated)")
    weights = len(hub.state.repos[TARGET].files["model.safetensors"])
    assert _cell(results, 0, "Params") != "?" and _cell(results, 0, "Size").endswith("KB")
    assert weights > 200_000

    panel.select_result(MAMBA)
    assert not panel.download_button.isEnabled()
    panel.select_result(TARGET)
    qtbot.waitUntil(lambda: "can run it" in panel.details_label.text(), timeout=TIMEOUT)
    assert "llama" in panel.details_label.text()

    # Download slowly enough to watch, then cancel half-way through the weights.
    relay.bytes_per_s = 120_000
    values: list[int] = []
    panel.progress_bar.valueChanged.connect(values.append)
    qtbot.mouseClick(panel.download_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "model.safetensors" in panel.download_file.text()
                    and panel.progress_bar.value() > 300, timeout=TIMEOUT)
    qtbot.waitUntil(lambda: re.fullmatch(r"\d+(\.\d)? [KM]?B/s · ETA \d+:\d\d",
                                         panel.speed_label.text()) is not None, timeout=TIMEOUT)
    assert panel.download_strip.isVisible() and panel.cancel_button.isEnabled()
    assert panel.download_button.text() == "Downloading…"
    panel.grab().save(str(screenshots_dir / "models_panel.png"))
    with qtbot.waitSignal(panel.controller.download_cancelled, timeout=TIMEOUT):
        qtbot.mouseClick(panel.cancel_button, Qt.MouseButton.LeftButton)
    assert 0 < values[-1] < 1000 and values == sorted(values)
    assert "cancelled" in panel.info_label.text()
    [partial] = [m for m in panel.controller.library if m.name == TARGET]
    assert not partial.ready and partial.problem
    assert TARGET not in _targets(gui)  # a partial download is never offered
    assert not list((repo_folder(cache, TARGET) / "blobs").glob("*.incomplete"))

    # Resume from the library at full speed: finished files are not fetched again.
    relay.bytes_per_s = 0
    panel.tabs.setCurrentIndex(1)
    assert panel.select_library(TARGET)
    assert panel.resume_button.isEnabled()
    values.clear()
    with qtbot.waitSignal(panel.controller.download_finished, timeout=TIMEOUT) as done:
        qtbot.mouseClick(panel.resume_button, Qt.MouseButton.LeftButton)
    assert done.args[0].repo_id == TARGET
    assert "model.safetensors" not in done.args[0].reused_files
    assert "config.json" in done.args[0].reused_files
    assert hub.gets("tokenizer.json") == 1 and hub.gets("model.safetensors") == 2
    qtbot.waitUntil(lambda: panel.progress_bar.value() == 1000 or not panel.download_strip.isVisible())
    assert values == sorted(values) and values[-1] == 1000
    [ready] = [m for m in panel.controller.library if m.name == TARGET]
    assert ready.ready and ready.size_bytes > weights
    assert TARGET in _targets(gui)
    assert "is ready" in panel.info_label.text()

    # A draft downloaded next is offered for the loaded target (same tokenizer).
    panel.tabs.setCurrentIndex(0)
    panel.select_result(DRAFT)
    with qtbot.waitSignal(panel.controller.download_finished, timeout=TIMEOUT):
        qtbot.mouseClick(panel.download_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.settings_panel.draft_reason(DRAFT) is None,
                    timeout=TIMEOUT)  # its tokenizer is compared on another thread
    panel.tabs.setCurrentIndex(1)
    panel.grab().save(str(screenshots_dir / "models_library.png"))
    panel.tabs.setCurrentIndex(0)
    panel.select_result(TARGET)
    assert panel.download_button.text() == "Downloaded ✓"
    qtbot.waitUntil(lambda: "can run it" in panel.details_label.text(), timeout=TIMEOUT)

    # Delete asks first; "No" keeps the model, "Yes" frees the space and updates the pickers.
    panel.tabs.setCurrentIndex(1)
    panel.select_library(TARGET)
    answers = iter([QMessageBox.StandardButton.No, QMessageBox.StandardButton.Yes])
    asked: list[str] = []

    def question(_parent, _title, text, *_a, **_k):
        asked.append(text)
        return next(answers)

    monkeypatch.setattr(QMessageBox, "question", question)
    qtbot.mouseClick(panel.delete_button, Qt.MouseButton.LeftButton)
    assert TARGET in panel.library_model.names() and "free" in asked[0]
    with qtbot.waitSignal(panel.controller.model_deleted, timeout=TIMEOUT) as deleted:
        qtbot.mouseClick(panel.delete_button, Qt.MouseButton.LeftButton)
    assert deleted.args[0] == TARGET and deleted.args[1] > weights
    assert TARGET not in panel.library_model.names()
    assert TARGET not in _targets(gui)
    assert not repo_folder(cache, TARGET).exists()
    assert "demo" in panel.library_model.names()


def test_gated_repo_asks_for_a_token_kept_in_the_keychain(qtbot, gui, hub, memory_keyring,
                                                          caplog, screenshots_dir):
    caplog.set_level("DEBUG")
    hub.state.tokens[SECRET] = "alice"
    panel = gui.window.show_models()
    _search(qtbot, panel, "gated", 1)
    panel.select_result(GATED)
    qtbot.waitUntil(lambda: "gated" in panel.error_text, timeout=TIMEOUT)
    assert "token" in panel.error_text and panel.token_button.isVisible()
    qtbot.mouseClick(panel.download_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "failed" in panel.info_label.text(), timeout=TIMEOUT)
    assert "Settings → Hugging Face token" in panel.error_text

    with qtbot.waitSignal(panel.hub_settings_requested):
        qtbot.mouseClick(panel.token_button, Qt.MouseButton.LeftButton)
    prefs = gui.window.show_hub_settings()
    section = prefs.hub_section
    assert prefs.isVisible()
    assert section.token_edit.echoMode() == section.token_edit.EchoMode.Password
    assert "No token" in section.status_label.text()

    qtbot.keyClicks(section.token_edit, "hf_wrong")
    with qtbot.waitSignal(panel.controller.token_check_failed, timeout=TIMEOUT):
        qtbot.mouseClick(section.check_button, Qt.MouseButton.LeftButton)
    assert "rejected" in section.status_label.text()

    qtbot.keyClicks(section.token_edit, SECRET)
    qtbot.mouseClick(section.save_button, Qt.MouseButton.LeftButton)
    assert memory_keyring.store[("understudy", "huggingface-token")] == SECRET
    assert section.token_edit.text() == ""  # not kept in the widget
    assert SECRET not in section.token_edit.placeholderText()
    assert "keychain" in section.status_label.text()
    with qtbot.waitSignal(panel.controller.token_checked, timeout=TIMEOUT):
        qtbot.mouseClick(section.check_button, Qt.MouseButton.LeftButton)
    assert "alice" in section.status_label.text()
    prefs.grab().save(str(screenshots_dir / "hub_token_settings.png"))

    # With a token but no access yet: the message says to request access.
    with qtbot.waitSignal(panel.controller.download_failed, timeout=TIMEOUT):
        panel.controller.download(GATED)
    assert "granted" in panel.error_text
    hub.state.granted.add(GATED)
    with qtbot.waitSignal(panel.controller.download_finished, timeout=TIMEOUT):
        panel.controller.download(GATED)
    assert GATED in _targets(gui)

    gui.window.save_state()
    settings_text = Path(gui.qsettings.fileName()).read_text(encoding="utf-8")
    assert SECRET not in settings_text and SECRET not in caplog.text
    assert SECRET not in repr(panel.controller.hub_config())

    qtbot.mouseClick(section.clear_button, Qt.MouseButton.LeftButton)
    assert memory_keyring.store == {} and "No token" in section.status_label.text()


def test_offline_mode_makes_no_request_and_a_dead_hub_answers_quickly(qtbot, gui, hub,
                                                                      monkeypatch):
    panel = gui.window.show_models()
    panel.offline_box.setChecked(True)
    prefs = gui.window.show_hub_settings()
    assert prefs.hub_section.offline_box.isChecked()  # one switch, two places
    before = hub.n_requests
    qtbot.keyClicks(panel.search_edit, "tiny")
    with qtbot.waitSignal(panel.controller.search_failed, timeout=TIMEOUT):
        qtbot.keyClick(panel.search_edit, Qt.Key.Key_Return)
    assert "Offline mode is on" in panel.error_text
    with qtbot.waitSignal(panel.controller.download_failed, timeout=TIMEOUT):
        panel.controller.download(TARGET)
    assert "Offline mode is on" in panel.error_text
    assert hub.n_requests == before
    assert not panel.search_button.isEnabled()
    assert QSettings(gui.qsettings.fileName(), QSettings.Format.IniFormat).value("hub/offline") \
        == "true"

    panel.offline_box.setChecked(False)
    monkeypatch.setenv("HF_ENDPOINT", closed_port_endpoint())
    started = time.monotonic()
    with qtbot.waitSignal(panel.controller.search_failed, timeout=TIMEOUT):
        panel.run_search()
    assert "Cannot reach the Hugging Face hub" in panel.error_text
    assert time.monotonic() - started < 15

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    panel.controller.set_offline(True)
    panel.controller.set_offline(False)
    assert panel.controller.offline and not panel.offline_box.isEnabled()


def test_recommended_pair_downloads_both_and_they_pair(qtbot, relay, cache, memory_keyring,
                                                       async_loop, tmp_path, screenshots_dir):
    catalog = load_catalog('{"pairs": [{"id": "tiny", "title": "Tiny pair", "why": "same '
                           f'tokenizer", "target": {{"repo": "{TARGET}", "params": "1M", '
                           f'"approx_bytes": 400000}}, "draft": {{"repo": "{DRAFT}", '
                           '"params": "0.1M", "approx_bytes": 100000}}]}')
    qs = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
    controller = ModelsController(qs, catalog=catalog)
    panel = ModelsPanel(controller)
    qtbot.addWidget(panel)
    panel.show()
    panel.tabs.setCurrentIndex(2)
    assert _cell(panel.pairs_model, 0, "On disk") == "–"
    panel.pairs_view.selectRow(0)
    finished: list[str] = []
    controller.download_finished.connect(lambda r: finished.append(r.repo_id))
    qtbot.mouseClick(panel.download_pair_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: len(finished) == 2, timeout=TIMEOUT)
    assert finished == [DRAFT, TARGET]
    assert _cell(panel.pairs_model, 0, "On disk") == "✓ Both ready"
    assert not panel.download_pair_button.isEnabled()
    panel.grab().save(str(screenshots_dir / "models_pairs.png"))
    library = {m.name: m for m in controller.library}
    pairs = compatible_drafts(library[TARGET], library.values())
    assert [m.name for m, _ in pairs] == [DRAFT]


def test_import_folder_adds_a_ready_model(qtbot, hub, relay, cache, memory_keyring, async_loop,
                                          tmp_path, monkeypatch):
    folder = write_tiny_model(tmp_path / "My Model", "llama")
    controller = ModelsController(QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    panel = ModelsPanel(controller)
    qtbot.addWidget(panel)
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(folder))
    with qtbot.waitSignal(controller.model_imported, timeout=TIMEOUT) as imported:
        qtbot.mouseClick(panel.import_folder_button, Qt.MouseButton.LeftButton)
    assert imported.args[0].name == "my-model" and imported.args[0].ready
    row = panel.library_model.row_of("my-model")
    assert _cell(panel.library_model, row, "Kind") == "Imported"
    assert _cell(panel.library_model, row, "Status") == "✓ Ready"
    assert hub.n_requests == 0


def test_a_refused_import_leaves_only_the_reason(qtbot, hub, relay, cache, memory_keyring,
                                                async_loop, tmp_path, monkeypatch,
                                                screenshots_dir):
    """The footer kept saying "Importing …" under the banner that said it was refused."""
    folder = write_tiny_model(tmp_path / "falcon-like", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    controller = ModelsController(QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    panel = ModelsPanel(controller)
    qtbot.addWidget(panel)
    panel.resize(900, 500)
    panel.show()
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(folder))
    with qtbot.waitSignal(controller.import_ended, timeout=TIMEOUT) as ended:
        qtbot.mouseClick(panel.import_folder_button, Qt.MouseButton.LeftButton)
    assert ended.args == [False]
    from engine.models import SUPPORTED_MODEL_TYPES

    assert panel.error_text == (f"{folder}: config.json: model_type 'falcon' is not supported "
                                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    assert "llama" in SUPPORTED_MODEL_TYPES
    assert panel.info_label.text() == ""
    panel.grab().save(str(screenshots_dir / "models_import_refused.png"))


def test_search_covers_every_author_runnable_first_and_the_author_field_narrows(
        qtbot, hub, relay, cache, memory_keyring, async_loop, tmp_path, repo_folders,
        screenshots_dir):
    hub.state.add(FakeRepo.from_folder("someone/tiny-chat", repo_folders["target"],
                                       downloads=10_000))
    hub.state.add(FakeRepo("someone/tiny-chat-GGUF", {"config.json": b'{"model_type": "llama"}',
                                                      "tiny-chat.Q4_0.gguf": b"GGUF"},
                           config={"model_type": "llama"}, downloads=20_000))
    controller = ModelsController(QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat))
    panel = ModelsPanel(controller)
    qtbot.addWidget(panel)
    _search(qtbot, panel, "tiny", 6)
    results = panel.results_model
    repos = [results.row_item(r).repo_id for r in range(6)]
    assert repos == ["someone/tiny-chat", TARGET, DRAFT, GATED, "someone/tiny-chat-GGUF", MAMBA]
    assert "all authors" in panel.results_hint.text()
    assert _cell(results, 4, "Supported") == "✗"
    assert "Import GGUF" in _cell(results, 4, "Supported", Qt.ItemDataRole.ToolTipRole)
    panel.resize(900, 500)
    panel.grab().save(str(screenshots_dir / "models_search_all_authors.png"))

    qtbot.keyClicks(panel.author_edit, "someone")
    qtbot.keyClick(panel.author_edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: results.rowCount() == 2, timeout=TIMEOUT)
    assert [results.row_item(r).repo_id for r in range(2)] == ["someone/tiny-chat",
                                                              "someone/tiny-chat-GGUF"]
    assert "from someone" in panel.results_hint.text()
    assert "author=someone" in hub.state.requests[-1][1]


def test_panel_opens_from_the_side_panel_button(qtbot, gui):
    assert not any(isinstance(w, ModelsPanel) for w in QApplication.topLevelWidgets())
    with qtbot.waitSignal(gui.window.settings_panel.models_requested):
        qtbot.mouseClick(gui.window.settings_panel.models_button, Qt.MouseButton.LeftButton)
    assert any(isinstance(w, ModelsPanel) and w.isVisible() for w in QApplication.topLevelWidgets())


def test_gguf_import_runs_on_the_engine_thread_and_reaches_the_picker(qtbot, gui, tmp_path,
                                                                      monkeypatch):
    """`mx.load` reads the GGUF, so the import runs where every other MLX call runs."""
    src = tmp_path / "Tiny Chat.Q8_0.gguf"
    write_tiny_gguf(src)
    threads: list[QThread] = []
    real_import = engine.gguf.import_gguf

    def recording_import(*args, **kwargs):
        threads.append(QThread.currentThread())
        return real_import(*args, **kwargs)

    monkeypatch.setattr(engine.gguf, "import_gguf", recording_import)
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **k: (str(src), "GGUF (*.gguf)"))
    panel = gui.window.show_models()
    with qtbot.waitSignal(panel.controller.model_imported, timeout=TIMEOUT) as imported:
        qtbot.mouseClick(panel.import_gguf_button, Qt.MouseButton.LeftButton)
    model = imported.args[0]
    assert threads == [gui.host.thread]
    assert model.name == "tiny-chat.q8_0" and model.ready, model.problem
    assert str(model.path) in _targets(gui)


def test_file_import_gguf_shows_progress_and_the_model_reaches_the_pickers(
        qtbot, gui, tmp_path, monkeypatch, screenshots_dir):
    from engine.paths import models_dir

    src = tmp_path / "Tiny Menu.Q8_0.gguf"
    write_tiny_gguf(src)
    monkeypatch.setattr(QFileDialog, "getOpenFileName",
                        lambda *a, **k: (str(src), "GGUF models (*.gguf)"))
    window = gui.window
    seen: list[tuple[int, int, bool, int]] = []  # done, total, dialog shown, its bar's value

    def record(done: int, total: int) -> None:  # after the dialog's own handler
        dialog = window.import_dialog
        seen.append((done, total, dialog.isVisible(), dialog.progress.value()))
        if done == total // 2:
            dialog.grab().save(str(screenshots_dir / "import_gguf_progress.png"))

    window.models_controller.import_progressed.connect(record)
    with qtbot.waitSignal(window.models_controller.import_ended, timeout=TIMEOUT) as ended:
        window.import_gguf_action.trigger()
    assert ended.args == [True]
    n = seen[-1][1]
    assert n > 10 and [s[0] for s in seen] == list(range(n + 1))  # one report per tensor
    assert all(total == n and shown and value == done for done, total, shown, value in seen)
    assert not window.import_dialog.isVisible()
    assert str(models_dir() / "tiny-menu.q8_0") in _targets(gui)
    assert "Imported tiny-menu.q8_0" in window.statusBar().currentMessage()

    # a second import of the same name asks for another, prefilled with a free one
    with qtbot.waitSignal(window.models_controller.import_name_taken, timeout=TIMEOUT):
        window.import_gguf_action.trigger()
    dialog = window.import_name_dialog
    assert dialog.parent() is window and dialog.textValue() == "tiny-menu.q8_0-2"
    dialog.reject()
    assert window.banner.text == "" or "--name" not in window.banner.text


def test_without_a_keychain_the_token_is_kept_for_the_session_only(qtbot, cache, tmp_path):
    from keyring.backends import fail

    from app.ui.preferences import PreferencesDialog

    previous = keyring.get_keyring()
    keyring.set_keyring(fail.Keyring())
    try:
        qs = QSettings(str(tmp_path / "s.ini"), QSettings.Format.IniFormat)
        controller = ModelsController(qs)
        prefs = PreferencesDialog(controller)
        qtbot.addWidget(prefs)
        section = prefs.hub_section
        assert "session only" in section.status_label.text()
        qtbot.keyClicks(section.token_edit, SECRET)
        qtbot.keyClick(section.token_edit, Qt.Key.Key_Return)
        assert controller.has_token() and controller.token_hint() == "hf_…6789"
        assert "session only" in section.status_label.text()
        section.offline_box.setChecked(True)  # something is written to the settings file
        qs.sync()
        assert SECRET not in Path(qs.fileName()).read_text(encoding="utf-8")
    finally:
        keyring.set_keyring(previous)


def test_a_taken_import_name_is_asked_anew_and_success_clears_the_error(
        qtbot, gui, tmp_path, monkeypatch, screenshots_dir):
    """Importing a folder whose name is in the library asks for another (prefilled with a
    free one) instead of telling the user to pass --name; an import or delete that works
    clears the red banner an earlier failure left."""
    folder = write_tiny_model(tmp_path / "srcfolder", "llama")
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(folder))
    window = gui.window
    panel = window.show_models()
    controller = panel.controller

    panel.offline_box.setChecked(True)
    with qtbot.waitSignal(controller.search_failed, timeout=TIMEOUT):
        panel.run_search()
    assert "Offline mode is on" in panel.error_text
    with qtbot.waitSignal(controller.model_imported, timeout=TIMEOUT):
        qtbot.mouseClick(panel.import_folder_button, Qt.MouseButton.LeftButton)
    assert panel.error_text == ""  # the import worked: the search's error is gone

    with qtbot.waitSignal(controller.import_name_taken, timeout=TIMEOUT):
        qtbot.mouseClick(panel.import_folder_button, Qt.MouseButton.LeftButton)
    dialog = window.import_name_dialog
    qtbot.waitUntil(dialog.isVisible)
    dialog.grab().save(str(screenshots_dir / "import_name_taken.png"))
    assert dialog.textValue() == "srcfolder-2"
    assert "“srcfolder”" in dialog.labelText() and "--" not in dialog.labelText()
    assert panel.error_text == "" and "--name" not in window.banner.text
    with qtbot.waitSignal(controller.model_imported, timeout=TIMEOUT) as imported:
        dialog.accept()
    assert imported.args[0].name == "srcfolder-2" and imported.args[0].ready
    assert {"srcfolder", "srcfolder-2"} <= {m.name for m in controller.library}

    with qtbot.waitSignal(controller.search_failed, timeout=TIMEOUT):
        panel.run_search()
    assert panel.error_text
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
    assert panel.select_library("srcfolder-2")
    with qtbot.waitSignal(controller.model_deleted, timeout=TIMEOUT):
        qtbot.mouseClick(panel.delete_button, Qt.MouseButton.LeftButton)
    assert panel.error_text == ""
