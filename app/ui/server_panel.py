"""Server ▸ Start/Stop: the local OpenAI-compatible server inside the app.

The server (app/server) runs uvicorn on its own thread, but its requests run on the app's
one `EngineWorker`, in turn with the chat (`AppEngineBackend`), so the app never holds two
copies of a model or two MLX threads. The panel shows the address, a client snippet to
copy, and a live request log fed by the server's `JobQueue` (requests the engine ran) and
its error handlers (requests refused before it, with their status and message).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QObject, QSettings, Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.server.jobs import Job, ModelCard, RequestRecord
from app.server.run import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ApiKeyRequiredError,
    BackgroundServer,
    check_bind,
    check_origins,
    client_snippet,
)
from app.ui.controller import ChatController
from app.ui.tool_window import close_with_keys
from app.ui.worker import EngineHost, ModelInfo
from engine.errors import EngineError

SERVER_DRAFTERS = ("auto", "none", "ngram", "layerskip", "model")


class AppEngineBackend:
    """The app's engine worker as the server's `EngineBackend`.

    `models()` and `submit()` are called on the server's thread: they read only what the
    GUI thread last stored (a ModelCard, the chat settings) and emit a queued signal.
    """

    def __init__(self, host: EngineHost, controller: ChatController) -> None:
        self._host = host
        self._controller = controller
        self._card: ModelCard | None = None
        controller.model_loaded.connect(self._on_model_loaded)
        if controller.model is not None:
            self._on_model_loaded(controller.model)

    def models(self) -> list[ModelCard]:
        card = self._card
        return [card] if card is not None else []

    def submit(self, job: Job) -> None:
        drafter = job.options.drafter
        settings = replace(self._controller.settings,
                           drafter="off" if drafter == "none" else drafter)
        self._host.serve(job, settings)

    def _on_model_loaded(self, info: ModelInfo) -> None:
        if info is not self._controller.model:  # a draft model, not the target
            return
        from engine.tokenizer import Tokenizer

        folder = Path(info.path)
        window = info.context_window or 2048  # the model's own (a Gemma 3 VLM: text_config)
        try:
            tokenizer = Tokenizer.from_folder(folder)
        except EngineError:
            self._card = None
            return
        drafters = ("ngram", "layerskip", "model") if self._controller.settings.draft else (
            "ngram", "layerskip")
        self._card = ModelCard(id=info.name, context_window=window, tokenizer=tokenizer,
                               drafters=drafters)


class RequestLogModel(QAbstractTableModel):
    """The server's finished requests, newest last."""

    HEADERS = ("Time", "Endpoint", "Status", "Model", "Prompt", "Completion", "tok/s", "tau",
               "Drafter", "Finish")
    FINISH = len(HEADERS) - 1

    def __init__(self, parent: QObject | None = None, keep: int = 500) -> None:
        super().__init__(parent)
        self._rows: list[RequestRecord] = []
        self._keep = keep

    def rowCount(self, parent: QModelIndex = QModelIndex()) -> int:  # noqa: N802, B008
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: QModelIndex = QModelIndex()) -> int:  # noqa: N802, B008
        return 0 if parent.isValid() else len(self.HEADERS)

    def headerData(self, section: int, orientation: Qt.Orientation,  # noqa: N802
                   role: int = Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return self.HEADERS[section]
        return None

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        r = self._rows[index.row()]
        if role == Qt.ItemDataRole.ToolTipRole and index.column() == self.FINISH:
            return r.finish  # an error message may be longer than the column
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        when = time.strftime("%H:%M:%S", time.localtime(r.at))
        if not r.model:  # rejected before it reached the engine: no numbers to show
            return (when, r.endpoint, str(r.status), "", "", "", "", "", "",
                    r.finish)[index.column()]
        prompt = (f"{r.prompt_tokens}" if r.prefilled_tokens in (0, r.prompt_tokens)
                  else f"{r.prompt_tokens} ({r.prefilled_tokens} new)")
        return (when, r.endpoint, str(r.status), r.model, prompt, str(r.completion_tokens),
                f"{r.decode_tps:.1f}", f"{r.tau:.2f}", r.drafter, r.finish)[index.column()]

    def add(self, record: RequestRecord) -> None:
        if len(self._rows) >= self._keep:
            self.beginRemoveRows(QModelIndex(), 0, 0)
            self._rows.pop(0)
            self.endRemoveRows()
        n = len(self._rows)
        self.beginInsertRows(QModelIndex(), n, n)
        self._rows.append(record)
        self.endInsertRows()

    def record(self, row: int) -> RequestRecord:
        return self._rows[row]


# where the panel keeps what the last server that started was given
SERVER_KEYS = {name: f"server/{name}" for name in ("host", "port", "drafter", "web_pages")}


class ServerPanel(QDialog):
    """Start/stop the server, see where it listens, copy a snippet, watch requests."""

    running_changed = Signal(bool)
    _record_arrived = Signal(object)  # emitted on the engine thread, handled on the GUI's

    def __init__(self, host: EngineHost, controller: ChatController,
                 parent: QWidget | None = None, qsettings: QSettings | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Local Server")
        close_with_keys(self)
        self.resize(760, 520)
        self._backend = AppEngineBackend(host, controller)
        self._server: BackgroundServer | None = None
        self.log_model = RequestLogModel(self)
        self._record_arrived.connect(self.log_model.add)

        self.host_edit = QLineEdit(DEFAULT_HOST)
        self.port_spin = QSpinBox()
        self.port_spin.setRange(0, 65535)
        self.port_spin.setValue(DEFAULT_PORT)
        self.key_edit = QLineEdit()
        self.key_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.key_edit.setPlaceholderText("required for any host but 127.0.0.1")
        self.drafter_combo = QComboBox()
        self.drafter_combo.addItems(SERVER_DRAFTERS)
        self.origins_edit = QLineEdit()
        self.origins_edit.setPlaceholderText("none: only programs, not web pages, may call it")
        self.origins_edit.setToolTip(
            "Web pages whose scripts may call the server from a browser (CORS), such as "
            "http://localhost:3000, separated by spaces or commas; * allows every page "
            "you open, so name the ones you trust")
        form = QFormLayout()
        form.addRow("Host", self.host_edit)
        form.addRow("Port", self.port_spin)
        form.addRow("API key", self.key_edit)
        form.addRow("Drafter", self.drafter_combo)
        form.addRow("Web pages", self.origins_edit)
        self._qsettings = qsettings
        self._restore_settings()

        self.start_button = QPushButton("Start")
        self.start_button.clicked.connect(self._on_start_clicked)
        self.address_label = QLabel("Stopped")
        self.address_label.setObjectName("serverAddress")
        self.address_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.address_label.setWordWrap(True)  # a long "Not started: …" must not widen the panel
        top = QHBoxLayout()
        top.addWidget(self.start_button)
        top.addWidget(self.address_label, 1)

        self.snippet = QPlainTextEdit()
        self.snippet.setReadOnly(True)
        self.snippet.setMaximumHeight(110)
        self.copy_button = QPushButton("Copy")
        self.copy_button.clicked.connect(self.copy_snippet)
        snippet_row = QHBoxLayout()
        snippet_row.addWidget(self.snippet, 1)
        snippet_row.addWidget(self.copy_button, 0, Qt.AlignmentFlag.AlignTop)

        self.log_view = QTableView()
        self.log_view.setModel(self.log_model)
        self.log_view.verticalHeader().hide()
        self.log_view.setWordWrap(False)  # "33 (9 new)" on one line, as wide as it needs
        self.log_view.setTextElideMode(Qt.TextElideMode.ElideRight)
        header = self.log_view.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        header.setStretchLastSection(True)  # Finish (an error message) takes what is left
        self.log_model.rowsInserted.connect(self._on_rows_inserted)
        self._fit_columns()

        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(top)
        layout.addWidget(QLabel("Client snippet"))
        layout.addLayout(snippet_row)
        layout.addWidget(QLabel("Requests"))
        layout.addWidget(self.log_view, 1)
        self._show_state()

    def _on_rows_inserted(self, *_: object) -> None:
        self._fit_columns()
        self.log_view.scrollToBottom()

    def _fit_columns(self) -> None:
        """Every column but Finish as wide as its widest cell (so the time and tau are never
        cut to "01…"); a long model id gives way at a third of the table, cut at its end."""
        view, header = self.log_view, self.log_view.horizontalHeader()
        model_cap = max(120, view.viewport().width() // 3)
        for column in range(RequestLogModel.FINISH):
            width = max(header.sectionSizeFromContents(column).width(),
                        view.sizeHintForColumn(column))
            if RequestLogModel.HEADERS[column] == "Model":
                width = min(width, model_cap)
            header.resizeSection(column, width)

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str | None:
        return self._server.url if self._server is not None else None

    def start_server(self) -> bool:
        """Start listening with the panel's settings; False (reason shown) if it cannot."""
        if self._server is not None:
            return True
        from app.server.api import ServerConfig, create_app

        host, key = self.host_edit.text().strip() or DEFAULT_HOST, self.key_edit.text() or None
        try:
            check_bind(host, key)
            origins = check_origins(self.origins_edit.text().replace(",", " ").split(),
                                    name="Web pages")
            config = ServerConfig(api_key=key, default_drafter=self.drafter_combo.currentText(),
                                  allow_origins=origins)
            app = create_app(self._backend, config, on_record=self._record_arrived.emit,
                             on_rejected=self._record_arrived.emit)
            server = BackgroundServer(app, host, self.port_spin.value())
            server.start()
        except ApiKeyRequiredError as e:  # its message names the CLI's flag, not the field
            self.address_label.setText(
                f"Not started: host {e.host} makes the server reachable from other machines, "
                "so it needs a key: fill in “API key” above (clients then send "
                "'Authorization: Bearer KEY').")
            return False
        except EngineError as e:
            self.address_label.setText(f"Not started: {e}")
            return False
        self._server = server
        self._save_settings()
        self._show_state()
        self.running_changed.emit(True)
        return True

    def _restore_settings(self) -> None:
        """The host, port, drafter and web pages of the last server that started (never the
        key: a secret stays out of the settings file). A value that does not read as its
        field's (a hand edit) leaves that field at its default."""
        qs = self._qsettings
        if qs is None:
            return
        host, pages = qs.value(SERVER_KEYS["host"]), qs.value(SERVER_KEYS["web_pages"])
        if isinstance(host, str) and host.strip():
            self.host_edit.setText(host.strip())
        try:
            port = int(qs.value(SERVER_KEYS["port"], DEFAULT_PORT))
        except (TypeError, ValueError):
            port = DEFAULT_PORT
        if 0 <= port <= 65535:
            self.port_spin.setValue(port)
        drafter = qs.value(SERVER_KEYS["drafter"])
        if drafter in SERVER_DRAFTERS:
            self.drafter_combo.setCurrentText(drafter)
        if isinstance(pages, str):
            self.origins_edit.setText(pages)

    def _save_settings(self) -> None:
        qs = self._qsettings
        if qs is None:
            return
        qs.setValue(SERVER_KEYS["host"], self.host_edit.text().strip())
        qs.setValue(SERVER_KEYS["port"], self.port_spin.value())
        qs.setValue(SERVER_KEYS["drafter"], self.drafter_combo.currentText())
        qs.setValue(SERVER_KEYS["web_pages"], self.origins_edit.text().strip())

    def stop_server(self) -> None:
        if self._server is None:
            return
        self._server.stop()
        self._server = None
        self._show_state()
        self.running_changed.emit(False)

    def copy_snippet(self) -> None:
        QGuiApplication.clipboard().setText(self.snippet.toPlainText())

    def _on_start_clicked(self) -> None:
        if self.running:
            self.stop_server()
        else:
            self.start_server()

    def _show_state(self) -> None:
        running = self._server is not None
        self.start_button.setText("Stop" if running else "Start")
        for w in (self.host_edit, self.port_spin, self.key_edit, self.drafter_combo,
                  self.origins_edit):
            w.setEnabled(not running)
        if running:
            assert self._server is not None
            cards = self._backend.models()
            model = cards[0].id if cards else "MODEL"
            self.address_label.setText(f"Listening on {self._server.url}")
            self.snippet.setPlainText(client_snippet(self._server.url, model,
                                                     bool(self.key_edit.text())))
        else:
            self.address_label.setText("Stopped")
            self.snippet.setPlainText("")
        self.copy_button.setEnabled(running)
