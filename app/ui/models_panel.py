"""The Models panel: search the hub, download with progress, manage the local library.

Three tabs over one `ModelsController` (hub search, library, recommended pairs) and a
download strip below them that stays visible whichever tab is showing: what is being
fetched, a progress bar, speed and ETA, Cancel. Table data lives in the widget-free
models of `app.ui.models_tables`; the panel is a thin view that turns clicks into
controller calls and controller signals into text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QAbstractTableModel, Qt, Signal
from PySide6.QtGui import QShowEvent
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QDialog,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QTableView,
    QTabWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.hub.api import RepoDetails, RepoSummary, format_bytes, format_params
from app.hub.catalog import RecommendedPair
from app.hub.download import DownloadProgress, DownloadResult
from app.hub.library import LocalModel
from app.ui.models_controller import ModelsController
from app.ui.models_tables import (
    PROGRESS_STEPS,
    RIGHT,
    HubResultsModel,
    ItemRole,
    LibraryTableModel,
    PairsTableModel,
    good_bad,
    speed_text,
)
from app.ui.tool_window import close_with_keys


def _table(model: QAbstractTableModel, stretch: int = 0) -> QTableView:
    view = QTableView()
    view.setModel(model)
    view.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    view.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    view.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    view.setAlternatingRowColors(True)
    view.setShowGrid(False)
    view.setWordWrap(False)
    view.verticalHeader().hide()
    header = view.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    header.setSectionResizeMode(stretch, QHeaderView.ResizeMode.Stretch)
    return view


def _selected(view: QTableView) -> Any:
    rows = view.selectionModel().selectedRows()
    return rows[0].data(ItemRole) if rows else None


class ModelsPanel(QDialog):
    """Search, download, import, delete; opened with Models… (Ctrl/⌘+Shift+M)."""

    hub_settings_requested = Signal()

    def __init__(self, controller: ModelsController, parent: QWidget | None = None, *,
                 in_use: Callable[[LocalModel], str | None] | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.in_use = in_use
        self.setWindowTitle("Models")
        close_with_keys(self)
        self.resize(980, 660)
        self.tabs = QTabWidget()
        self.tabs.addTab(self._build_hub_tab(), "Hugging Face hub")
        self.tabs.addTab(self._build_library_tab(), "Library")
        self.tabs.addTab(self._build_pairs_tab(), "Recommended pairs")
        layout = QVBoxLayout(self)
        layout.addWidget(self.tabs, 1)
        layout.addWidget(self._build_banner())
        layout.addWidget(self._build_download_strip())
        layout.addLayout(self._build_footer())

        c = controller
        c.search_started.connect(self._on_search_started)
        c.search_finished.connect(self._on_search_finished)
        c.search_failed.connect(self._on_search_failed)
        c.details_loaded.connect(self._on_details_loaded)
        c.details_failed.connect(self._on_details_failed)
        c.download_queued.connect(self._on_download_queued)
        c.download_started.connect(self._on_download_started)
        c.download_progressed.connect(self._on_download_progressed)
        c.download_finished.connect(self._on_download_finished)
        c.download_cancelled.connect(self._on_download_cancelled)
        c.download_failed.connect(self._on_download_failed)
        c.token_needed.connect(self._on_token_needed)
        c.library_changed.connect(self._on_library_changed)
        c.library_failed.connect(self.show_error)
        c.model_deleted.connect(self._on_model_deleted)
        c.model_imported.connect(self._on_model_imported)
        c.import_ended.connect(self._on_import_ended)
        c.offline_changed.connect(self._on_offline_changed)
        self._on_offline_changed(c.offline)
        c.refresh_library()

    def showEvent(self, event: QShowEvent) -> None:  # noqa: N802 - Qt override
        """Opened, the keyboard is where the tab's work starts: the hub's search field, or
        the tab's table (it landed on the tab bar)."""
        super().showEvent(event)
        tab = self.tabs.currentIndex()
        target = (self.search_edit, self.library_view, self.pairs_view)[tab]
        target.setFocus(Qt.FocusReason.ActiveWindowFocusReason)

    # -- construction ------------------------------------------------------------------------
    def _build_hub_tab(self) -> QWidget:
        self.search_edit = QLineEdit()
        self.search_edit.setPlaceholderText("Search models, e.g. “Qwen3 4bit” (Enter)")
        self.search_edit.setClearButtonEnabled(True)
        self.author_edit = QLineEdit()
        self.author_edit.setPlaceholderText("any author")
        self.author_edit.setClearButtonEnabled(True)
        self.author_edit.setMaximumWidth(160)
        self.author_edit.setToolTip("Only this org or user, e.g. mlx-community (MLX-quantized "
                                    "repos); empty searches every author, runnable repos first")
        self.search_button = QPushButton("Search")
        self.results_model = HubResultsModel(self)
        self.results_view = _table(self.results_model)
        self.results_hint = QLabel("Search the hub to list models.")
        self.results_hint.setObjectName("modelStatus")
        self.details_label = QLabel()
        self.details_label.setWordWrap(True)
        self.details_label.setTextFormat(Qt.TextFormat.RichText)
        self.details_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details_label.setMinimumHeight(48)
        self.download_button = QPushButton("Download")
        self.download_button.setEnabled(False)
        top = QHBoxLayout()
        top.addWidget(self.search_edit, 1)
        top.addWidget(self.author_edit)
        top.addWidget(self.search_button)
        bottom = QHBoxLayout()
        bottom.addWidget(self.details_label, 1)
        bottom.addWidget(self.download_button, 0, Qt.AlignmentFlag.AlignTop)
        tab = QWidget()
        layout = QVBoxLayout(tab)
        layout.addLayout(top)
        layout.addWidget(self.results_view, 1)
        layout.addWidget(self.results_hint)
        layout.addLayout(bottom)
        self.search_edit.returnPressed.connect(self.run_search)
        self.author_edit.returnPressed.connect(self.run_search)
        self.search_button.clicked.connect(self.run_search)
        self.results_view.selectionModel().selectionChanged.connect(self._on_result_selected)
        self.results_view.doubleClicked.connect(lambda _i: self._on_download_clicked())
        self.download_button.clicked.connect(self._on_download_clicked)
        return tab

    def _build_library_tab(self) -> QWidget:
        self.library_model = LibraryTableModel(self)
        self.library_view = _table(self.library_model)
        self.import_folder_button = QPushButton("Import Folder…")
        self.import_folder_button.setToolTip("Copy an MLX / Hugging Face model folder "
                                             "(config.json, tokenizer.json, *.safetensors)")
        self.import_gguf_button = QPushButton("Import GGUF…")
        self.import_gguf_button.setToolTip("Convert a Llama / Mistral / Qwen GGUF file (K-quants "
                                           "like Q4_K_M, Q8_0, Q4_0, F16...)")
        self.resume_button = QPushButton("Resume Download")
        self.delete_button = QPushButton("Delete…")
        self.library_footer = QLabel()
        self.library_footer.setObjectName("modelStatus")
        buttons = QHBoxLayout()
        for b in (self.import_folder_button, self.import_gguf_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(self.resume_button)
        buttons.addWidget(self.delete_button)
        tab = QWidget()
        layout = QVBoxLayout(tab)
        layout.addWidget(self.library_view, 1)
        layout.addWidget(self.library_footer)
        layout.addLayout(buttons)
        self.import_folder_button.clicked.connect(self._on_import_folder_clicked)
        self.import_gguf_button.clicked.connect(self._on_import_gguf_clicked)
        self.resume_button.clicked.connect(self._on_resume_clicked)
        self.delete_button.clicked.connect(self._on_delete_clicked)
        self.library_view.selectionModel().selectionChanged.connect(self._sync_library_buttons)
        return tab

    def _build_pairs_tab(self) -> QWidget:
        self.pairs_model = PairsTableModel(self.controller.pairs(), self)
        self.pairs_view = _table(self.pairs_model)
        self.pair_why = QLabel("A draft proposes tokens the target checks; they must share a "
                               "tokenizer, which Understudy checks again after download.")
        self.pair_why.setWordWrap(True)
        self.download_pair_button = QPushButton("Download Both")
        self.download_pair_button.setEnabled(False)
        row = QHBoxLayout()
        row.addWidget(self.pair_why, 1)
        row.addWidget(self.download_pair_button, 0, Qt.AlignmentFlag.AlignTop)
        tab = QWidget()
        layout = QVBoxLayout(tab)
        layout.addWidget(self.pairs_view, 1)
        layout.addLayout(row)
        self.pairs_view.selectionModel().selectionChanged.connect(self._on_pair_selected)
        self.download_pair_button.clicked.connect(self._on_download_pair_clicked)
        return tab

    def _build_banner(self) -> QFrame:
        self.banner = QFrame()
        self.banner.setObjectName("errorBanner")
        self.banner_label = QLabel()
        self.banner_label.setWordWrap(True)
        self.banner_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.token_button = QPushButton("Add Token…")
        self.token_button.clicked.connect(self.hub_settings_requested)
        close = QToolButton()
        close.setText("✕")
        close.setAutoRaise(True)
        close.setToolTip("Dismiss")
        close.clicked.connect(self.banner.hide)
        layout = QHBoxLayout(self.banner)
        layout.setContentsMargins(12, 6, 6, 6)
        layout.addWidget(self.banner_label, 1)
        layout.addWidget(self.token_button, 0, Qt.AlignmentFlag.AlignTop)
        layout.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        self.banner.hide()
        return self.banner

    def _build_download_strip(self) -> QFrame:
        self.download_strip = QFrame()
        self.download_title = QLabel()
        self.download_title.setObjectName("panelTitle")
        self.download_file = QLabel()
        self.download_file.setObjectName("modelStatus")
        self.progress_bar = QProgressBar()
        self.progress_bar.setRange(0, PROGRESS_STEPS)
        self.progress_bar.setTextVisible(True)
        self.speed_label = QLabel()
        self.speed_label.setMinimumWidth(170)
        self.speed_label.setAlignment(RIGHT)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setObjectName("stopButton")
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.progress_bar, 1)
        row.addWidget(self.speed_label)
        row.addWidget(self.cancel_button)
        layout = QVBoxLayout(self.download_strip)
        layout.setContentsMargins(0, 4, 0, 4)
        layout.addWidget(self.download_title)
        layout.addWidget(self.download_file)
        layout.addLayout(row)
        self.cancel_button.clicked.connect(self.controller.cancel_download)
        self.download_strip.hide()
        return self.download_strip

    def _build_footer(self) -> QHBoxLayout:
        self.info_label = QLabel()
        self.info_label.setObjectName("modelStatus")
        self.info_label.setWordWrap(True)
        self.offline_box = QCheckBox("Offline mode")
        self.offline_box.toggled.connect(self.controller.set_offline)
        self.account_button = QPushButton("Hugging Face Token…")
        self.account_button.clicked.connect(self.hub_settings_requested)
        row = QHBoxLayout()
        row.addWidget(self.info_label, 1)
        row.addWidget(self.offline_box)
        row.addWidget(self.account_button)
        return row

    # -- what tests and the window read ----------------------------------------------------
    @property
    def error_text(self) -> str:
        return self.banner_label.text() if self.banner.isVisible() else ""

    def show_error(self, text: str, *, needs_token: bool = False) -> None:
        self.banner_label.setText(text)
        self.token_button.setVisible(needs_token)
        self.banner.show()

    def show_info(self, text: str) -> None:
        self.info_label.setText(text)

    def select_result(self, repo_id: str) -> bool:
        for row in range(self.results_model.rowCount()):
            if self.results_model.row_item(row).repo_id == repo_id:
                self.results_view.selectRow(row)
                return True
        return False

    def select_library(self, name: str) -> bool:
        row = self.library_model.row_of(name)
        if row >= 0:
            self.library_view.selectRow(row)
        return row >= 0

    # -- hub tab ---------------------------------------------------------------------------
    def run_search(self) -> None:
        self.banner.hide()
        self.controller.search(self.search_edit.text(), self.author_edit.text().strip())

    def _on_search_started(self, query: str) -> None:
        self.results_hint.setText(f"Searching for “{query}”…" if query else "Searching…")

    def _on_search_finished(self, hits: list[RepoSummary]) -> None:
        self.banner.hide()  # an action that worked: an earlier failure's message is stale
        self.results_model.set_rows(hits)
        author = self.author_edit.text().strip()
        who = author or "all authors"
        self.results_hint.setText(f"{len(hits)} models from {who}: runnable ones first, then "
                                  "by downloads." if hits else f"No models from {who} match.")
        self.details_label.clear()
        self._sync_download_button()

    def _on_search_failed(self, message: str) -> None:
        self.results_hint.setText("Search failed.")
        self.show_error(message)

    def _selected_hit(self) -> RepoSummary | None:
        return _selected(self.results_view)

    def _on_result_selected(self, *_: object) -> None:
        hit = self._selected_hit()
        self._sync_download_button()
        if hit is None:
            return
        self.details_label.setText(f"<b>{hit.repo_id}</b><br>"
                                   + ("Loading details…" if not self.controller.offline else
                                      "Offline mode: details need the hub."))
        if not self.controller.offline:
            self.controller.load_details(hit.repo_id)

    def _on_details_loaded(self, d: RepoDetails) -> None:
        hit = self._selected_hit()
        if hit is None or hit.repo_id != d.repo_id:
            return
        quant = f"{d.bits}-bit (group {d.group_size})" if d.bits else "not quantized"
        facts = [f"{len(d.files)} files", format_bytes(d.total_bytes), d.model_type or "?",
                 quant, f"{format_params(d.n_params)} params"]
        good, bad = good_bad()
        verdict = (f"<span style='color:{good}'>✓ Understudy can run it</span>" if d.supported
                   else f"<span style='color:{bad}'>✗ {_escape(str(d.unsupported_reason))}</span>")
        gated = " · gated: needs a Hugging Face token with access" if d.gated else ""
        self.details_label.setText(f"<b>{d.repo_id}</b> @ {d.sha[:8]}<br>"
                                   f"{' · '.join(facts)}<br>{verdict}{gated}")
        self._sync_download_button(d)

    def _on_details_failed(self, repo_id: str, message: str) -> None:
        hit = self._selected_hit()
        if hit is not None and hit.repo_id == repo_id:
            self.details_label.setText(f"<b>{repo_id}</b><br><span style='color:{good_bad()[1]}'>"
                                       f"{_escape(message)}</span>")

    def _sync_download_button(self, details: RepoDetails | None = None) -> None:
        hit = self._selected_hit()
        b = self.download_button
        if hit is None:
            b.setText("Download")
            b.setEnabled(False)
            return
        local = {m.name: m for m in self.controller.library}.get(hit.repo_id)
        busy = hit.repo_id == self.controller.active_download or \
            hit.repo_id in self.controller.queued_downloads
        unsupported = hit.supported is False or (details is not None and not details.supported)
        if busy:
            b.setText("Downloading…")
        elif local is not None and local.ready:
            b.setText("Downloaded ✓")
        else:
            b.setText("Resume Download" if local is not None else "Download")
        b.setEnabled(not busy and not (local is not None and local.ready) and not unsupported
                     and not self.controller.offline)
        b.setToolTip("Understudy cannot run this architecture" if unsupported else "")

    def _on_download_clicked(self) -> None:
        hit = self._selected_hit()
        if hit is not None and self.download_button.isEnabled():
            self.banner.hide()
            self.controller.download(hit.repo_id)

    # -- downloads -------------------------------------------------------------------------
    def _on_download_queued(self, repo_id: str) -> None:
        self._sync_download_button()
        queued = self.controller.queued_downloads
        if self.controller.active_download and queued:
            self.show_info(f"Queued: {', '.join(queued)}")

    def _on_download_started(self, repo_id: str) -> None:
        self.download_strip.show()
        self.download_title.setText(f"Downloading {repo_id}")
        self.download_file.setText("Looking up files…")
        self.progress_bar.setValue(0)
        self.progress_bar.setFormat("%p%")
        self.speed_label.setText("")
        self.cancel_button.setEnabled(True)
        self._sync_download_button()

    def _on_download_progressed(self, p: DownloadProgress) -> None:
        if p.total_bytes > 0:
            self.progress_bar.setValue(int(PROGRESS_STEPS * p.done_bytes / p.total_bytes))
        self.progress_bar.setFormat(f"%p%  ·  {format_bytes(p.done_bytes)} of "
                                    f"{format_bytes(p.total_bytes)}")
        file_total = f" of {format_bytes(p.file_total)}" if p.file_total else ""
        self.download_file.setText(f"{p.file}: {format_bytes(p.file_done)}{file_total}")
        self.speed_label.setText(speed_text(p))

    def _download_ended(self, text: str) -> None:
        self.cancel_button.setEnabled(False)
        self.speed_label.setText("")
        self.show_info(text)
        if self.controller.active_download is None and not self.controller.queued_downloads:
            self.download_strip.hide()
        self._sync_download_button()

    def _on_download_finished(self, result: DownloadResult) -> None:
        self.progress_bar.setValue(PROGRESS_STEPS)
        note = f" ({format_bytes(result.fetched_bytes)} fetched)" if result.fetched_bytes else ""
        self._download_ended(f"✓ {result.repo_id} is ready{note}; pick it as Target or "
                             "Draft model in the side panel.")

    def _on_download_cancelled(self, repo_id: str) -> None:
        self._download_ended(f"Download of {repo_id} cancelled. Finished files are kept: "
                             "Download (or Library → Resume) continues where it stopped.")

    def _on_download_failed(self, repo_id: str, message: str) -> None:
        self._download_ended(f"Download of {repo_id} failed.")
        self.show_error(message)

    def _on_token_needed(self, message: str) -> None:
        self.show_error(message, needs_token=True)

    # -- library ---------------------------------------------------------------------------
    def _on_library_changed(self, library: list[LocalModel]) -> None:
        selected = _selected(self.library_view)
        self.library_model.set_rows(library)
        self.pairs_model.set_library(library)
        if selected is not None:
            self.select_library(selected.name)
        total = sum(m.size_bytes for m in library if m.kind != "demo")
        self.library_footer.setText(f"{len(library)} models · downloads and imports use "
                                    f"{format_bytes(total)} on disk")
        self._sync_library_buttons()
        self._sync_download_button()
        self._on_pair_selected()

    def _sync_library_buttons(self, *_: object) -> None:
        m: LocalModel | None = _selected(self.library_view)
        self.delete_button.setEnabled(m is not None and m.kind != "demo")
        self.delete_button.setToolTip("The built-in demo model cannot be deleted"
                                      if m is not None and m.kind == "demo" else "")
        self.resume_button.setEnabled(m is not None and m.kind == "hub" and not m.ready
                                      and not self.controller.offline
                                      and m.name != self.controller.active_download)

    def _on_resume_clicked(self) -> None:
        m: LocalModel | None = _selected(self.library_view)
        if m is not None:
            self.banner.hide()
            self.controller.download(m.name)

    def _on_delete_clicked(self) -> None:
        m: LocalModel | None = _selected(self.library_view)
        if m is None or m.kind == "demo":
            return
        reason = self.in_use(m) if self.in_use else None
        if reason:
            QMessageBox.information(self, "Model in use", reason)
            return
        answer = QMessageBox.question(
            self, "Delete model",
            f"Delete “{m.name}” and free {format_bytes(m.size_bytes)} on disk?\n\n{m.path or ''}",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No)
        if answer == QMessageBox.StandardButton.Yes:
            self.banner.hide()
            self.controller.delete(m.name)

    def _on_model_deleted(self, name: str, freed: int) -> None:
        self.banner.hide()
        self.show_info(f"Deleted {name}; {format_bytes(freed)} freed.")

    def _on_model_imported(self, model: LocalModel) -> None:
        self.banner.hide()
        self.show_info(f"Imported {model.name} ({format_bytes(model.size_bytes)}).")
        self.select_library(model.name)

    def _on_import_ended(self, ok: bool) -> None:
        """A failed import leaves no "Importing …" line beside the banner saying why (a
        folder whose name is taken is imported again under the name the user gives)."""
        if not ok:
            self.show_info("")

    def _on_import_folder_clicked(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Import a model folder")
        if folder:
            self.banner.hide()
            self.show_info(f"Importing {folder}…")
            self.controller.import_path(folder)

    def _on_import_gguf_clicked(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import a GGUF file", "", "GGUF (*.gguf)")
        if path:
            self.banner.hide()
            self.show_info(f"Converting {path}…")
            self.controller.import_path(path)

    # -- pairs -------------------------------------------------------------------------------
    def _on_pair_selected(self, *_: object) -> None:
        pair: RecommendedPair | None = _selected(self.pairs_view)
        self.download_pair_button.setEnabled(
            pair is not None and not self.controller.offline
            and self.pairs_model.status(pair) != "✓ Both ready")
        if pair is not None:
            self.pair_why.setText(f"<b>{pair.title}</b>: {_escape(pair.why)}")

    def _on_download_pair_clicked(self) -> None:
        pair: RecommendedPair | None = _selected(self.pairs_view)
        if pair is not None:
            self.banner.hide()
            self.controller.download_pair(pair)

    # -- offline -----------------------------------------------------------------------------
    def _on_offline_changed(self, on: bool) -> None:
        self.offline_box.blockSignals(True)
        self.offline_box.setChecked(on)
        self.offline_box.blockSignals(False)
        self.offline_box.setEnabled(not self.controller.offline_forced)
        self.search_button.setEnabled(not on)
        self.search_edit.setPlaceholderText(
            "Offline mode is on: the hub is not contacted" if on else
            "Search MLX models, e.g. “Qwen3 4bit” (Enter)")
        self._sync_download_button()
        self._sync_library_buttons()
        self._on_pair_selected()


def _escape(text: str) -> str:
    from html import escape

    return escape(text)
