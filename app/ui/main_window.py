"""The main window: conversations | chat (or comparison) + composer | gauge + settings.

It assembles the views around one `ChatController`, owns the menu bar (native on macOS:
⌘N new chat, ⌘W close, ⌘, settings, ⌘. stop, ⌘⇧M models, ⌘F search chats, ⌘+ ⌘- ⌘0
text size), shows engine errors in a dismissable banner, and keeps window geometry, splitter
sizes, view toggles, the text size and chat settings in QSettings. The model manager (`ModelsController`, its panel and the Hugging
Face settings) is built on first use, so a window that never opens it never touches the
keychain or the network.
"""

from __future__ import annotations

import html
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QByteArray, QSettings, Qt
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSplitter,
    QStackedWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.hub.api import format_bytes
from app.store import DEFAULT_TITLE, Message
from app.ui import zoom
from app.ui.chat_view import ChatView, page_scroll
from app.ui.comparison import ComparisonView
from app.ui.composer import Composer
from app.ui.controller import ChatController
from app.ui.edit_menu import EditActions
from app.ui.elided_label import ElidedLabel
from app.ui.gauge import GaugeWidget
from app.ui.settings_file import load_chat_settings, settings_store
from app.ui.settings_panel import SettingsPanel, model_name
from app.ui.sidebar import Sidebar
from app.ui.step_warnings import StepWarnings
from app.ui.token_render import conversation_markdown
from app.ui.worker import ModelInfo
from engine.events import Stats, Step

# load_chat_settings and settings_store live in app.ui.settings_file; still importable here
__all__ = ["ErrorBanner", "MainWindow", "load_chat_settings", "settings_store"]

if TYPE_CHECKING:
    from PySide6.QtWidgets import QInputDialog

    from app.hub.library import LocalModel
    from app.ui.import_dialog import ImportProgressDialog
    from app.ui.models_controller import ModelsController
    from app.ui.models_panel import ModelsPanel
    from app.ui.preferences import PreferencesDialog
    from app.ui.server_panel import ServerPanel
    from app.ui.train_dialog import TrainDrafterDialog


SIDEBAR_MIN_WIDTH = 160  # readable titles, and the window still fits 760 px with the side panel


class ErrorBanner(QFrame):
    """A readable, dismissable message above the chat (engine errors never crash the app)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("errorBanner")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.close_button = close = QToolButton()
        close.setText("✕")
        close.setAutoRaise(True)
        close.setToolTip("Dismiss")
        close.setAccessibleName("Dismiss message")  # "✕" says nothing to a screen reader
        close.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(12, 6, 6, 6)
        layout.addWidget(self.label, 1)
        layout.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        self.hide()

    def show_message(self, text: str) -> None:
        self.label.setText(text)
        self.show()

    @property
    def text(self) -> str:
        return self.label.text() if self.isVisible() else ""


COMPARE_TIP = "Run each prompt with and without speculation, side by side"
COMPARE_BUSY_TIP = ("Available when the reply in progress finishes: a comparison races "
                    "both ways from the start")


class MainWindow(QMainWindow):
    def __init__(self, controller: ChatController, qsettings: QSettings | None = None) -> None:
        super().__init__()
        self.controller = controller
        self.qsettings = qsettings if qsettings is not None else settings_store()
        self.setWindowTitle("Understudy")
        self.resize(1280, 800)

        self.sidebar = Sidebar(controller)
        self.chat_view = ChatView(controller)
        self.comparison_view = ComparisonView(controller)
        self.composer = Composer(controller)
        self.gauge = GaugeWidget("Speed")
        self.settings_panel = SettingsPanel(controller)
        self.banner = ErrorBanner()
        self._models_controller: ModelsController | None = None
        self._models_panel: ModelsPanel | None = None
        self._preferences: PreferencesDialog | None = None
        self._server_panel: ServerPanel | None = None  # made on first use
        self.import_dialog: ImportProgressDialog | None = None  # made with the models controller
        self._library_error = ""  # the banner's message when a library action set it
        self.import_name_dialog: QInputDialog | None = None  # asking a taken import name anew
        self.train_dialog: TrainDrafterDialog | None = None  # made on first use
        self.zoom = zoom.DEFAULT  # the conversation's text size (View ▸ Zoom In/Out)

        self.title_label = ElidedLabel(DEFAULT_TITLE)  # a long title never widens the window
        self.title_label.setObjectName("chatTitle")
        self.compare_button = QPushButton("Speculative vs plain")
        self.compare_button.setCheckable(True)
        self.compare_button.setToolTip(COMPARE_TIP)
        header = QHBoxLayout()
        header.setContentsMargins(12, 8, 12, 0)
        header.addWidget(self.title_label, 1)
        header.addWidget(self.compare_button)

        self.stack = QStackedWidget()
        self.stack.addWidget(self.chat_view)
        self.stack.addWidget(self.comparison_view)
        center = QWidget()
        center.setObjectName("centerPane")
        center_layout = QVBoxLayout(center)
        center_layout.setContentsMargins(0, 0, 0, 0)
        center_layout.setSpacing(0)
        center_layout.addLayout(header)
        center_layout.addWidget(self.banner)
        center_layout.addWidget(self.stack, 1)
        center_layout.addWidget(self.composer)

        side = QWidget()
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(0, 0, 0, 0)
        side_layout.addWidget(self.gauge)
        line = QFrame()
        line.setFrameShape(QFrame.Shape.HLine)
        side_layout.addWidget(line)
        side_layout.addWidget(self.settings_panel, 1)
        self.side_panel = QScrollArea()
        self.side_panel.setWidgetResizable(True)
        self.side_panel.setFrameShape(QFrame.Shape.NoFrame)
        self.side_panel.setWidget(side)
        self.side_panel.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.side_panel.setMinimumWidth(side.minimumSizeHint().width() + 16)

        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(center)
        self.splitter.addWidget(self.side_panel)
        self.splitter.setStretchFactor(1, 1)
        # A narrower window takes its width from the chat column: the chat list keeps room
        # for a readable title (it shrank to "Write a P…"); View ▸ Show Chats hides it.
        self.sidebar.setMinimumWidth(SIDEBAR_MIN_WIDTH)
        self.splitter.setCollapsible(0, False)
        self.splitter.setSizes([220, 740, 320])
        self.setCentralWidget(self.splitter)

        self.model_label = QLabel("No model loaded")
        self.load_progress = QProgressBar()
        self.load_progress.setRange(0, 0)  # busy until the first weights are read
        self.load_progress.setFormat("%p%")
        self.load_progress.setMaximumWidth(160)
        self.load_progress.hide()
        self.statusBar().addWidget(self.model_label, 1)
        self.statusBar().addPermanentWidget(self.load_progress)
        self.step_warnings = StepWarnings(controller)  # steps that fell back: once, not a dialog
        self.statusBar().addPermanentWidget(self.step_warnings, 1)

        self._build_menus()
        self._build_server_menu()
        self.compare_button.toggled.connect(self.set_comparison_mode)
        self.compare_button.toggled.connect(lambda _on: self._update_compare_toggle())
        self.composer.message_submitted.connect(self._on_message_submitted)
        self.composer.edit_submitted.connect(self._on_edit_submitted)
        self.composer.edit.page_requested.connect(self._on_page_requested)
        self.chat_view.edit_requested.connect(self.composer.begin_edit)
        self.sidebar.export_requested.connect(self.export_conversation)
        self.sidebar.chat_chosen.connect(self.focus_composer)
        self.chat_view.copied.connect(lambda what: self.statusBar().showMessage(what, 3000))
        for signal in (self.chat_view.zoom_requested,
                       self.comparison_view.speculative.browser.zoom_requested,
                       self.comparison_view.plain.browser.zoom_requested):
            signal.connect(lambda direction: self.set_zoom(zoom.step(self.zoom, direction)))
        self.settings_panel.models_requested.connect(self.show_models)
        self.chat_view.speculation_box.toggled.connect(self.comparison_view.set_show_speculation)
        self.chat_view.rejected_box.toggled.connect(self.comparison_view.set_show_rejected)
        # A click leaves keyboard focus on the button, where the next question would go
        # nowhere (and Enter or Space would press it again): typing goes back to the composer.
        for button in (self.compare_button, self.chat_view.speculation_box,
                       self.chat_view.rejected_box, self.comparison_view.replay_button,
                       self.sidebar.new_button):
            button.clicked.connect(self.focus_composer)
        controller.error_raised.connect(self.banner.show_message)
        controller.status_message.connect(lambda text: self.statusBar().showMessage(text, 15000))
        controller.model_loading.connect(self._on_model_loading)
        controller.model_loaded.connect(self._on_model_loaded)
        controller.model_load_progressed.connect(self._on_model_load_progressed)
        controller.model_load_failed.connect(self._on_model_load_failed)
        controller.message_added.connect(self._on_message_added)
        controller.prompt_progressed.connect(self.gauge.show_prompt_progress)
        controller.step_received.connect(self._on_step_received)
        controller.reply_finished.connect(self._on_reply_finished)
        controller.reply_resumed.connect(lambda _message: self.gauge.reset())
        for signal in (controller.reply_finished, controller.message_added,
                       controller.conversation_opened):
            signal.connect(lambda *_: self._update_continue_action())
        controller.conversation_opened.connect(self._on_conversation_opened)
        controller.conversations_changed.connect(self._update_title)
        controller.generating_changed.connect(self._on_generating_changed)
        self._restore_state()
        self._set_tab_order()
        self.composer.edit.setFocus()  # a user opens the app to type

    def _set_tab_order(self) -> None:
        """Tab goes through the window as it reads, left to right: the chat list, the
        chat's header and toggles, Show Earlier Messages, the messages (`ChatView` puts
        each card's in place), the composer, the side panel. Qt's own order followed when widgets were parented, and
        went from the composer to the side panel, then to the messages and the chat list."""
        cv, comp = self.comparison_view, self.composer
        chain = [self.sidebar.new_button, self.sidebar.search_edit, self.sidebar.list_view,
                 self.compare_button, self.chat_view.rejected_box,
                 self.chat_view.speculation_box, self.chat_view.scroll,
                 self.chat_view.earlier_button, cv.replay_button,
                 cv.speculative.browser, cv.plain.browser, comp.cancel_edit_button, comp.edit,
                 comp.send_button, comp.stop_button, self.side_panel]
        for first, second in zip(chain, chain[1:], strict=False):
            QWidget.setTabOrder(first, second)

    # -- menus ---------------------------------------------------------------------------
    def _action(self, text: str, slot, shortcut=None, checkable: bool = False) -> QAction:
        action = QAction(text, self)
        if shortcut is not None:
            action.setShortcut(QKeySequence(shortcut))
        action.setCheckable(checkable)
        (action.toggled if checkable else action.triggered).connect(slot)
        return action

    def _build_menus(self) -> None:
        bar = self.menuBar()  # the native menu bar on macOS (Ctrl maps to ⌘)
        file_menu = bar.addMenu("&File")
        self.new_action = self._action("New Chat", lambda: self.controller.new_conversation(),
                                       QKeySequence.StandardKey.New)
        file_menu.addAction(self.new_action)
        file_menu.addAction(self._action("Export Chat as Markdown…",
                                         lambda: self.export_conversation(), "Ctrl+Shift+E"))
        file_menu.addSeparator()
        self.models_action = self._action("Models…", self.show_models, "Ctrl+Shift+M")
        file_menu.addAction(self.models_action)
        self.import_gguf_action = self._action("Import GGUF…", lambda: self.import_gguf())
        file_menu.addAction(self.import_gguf_action)
        file_menu.addSeparator()
        file_menu.addAction(self._action("Close Window", self.close, "Ctrl+W"))
        quit_action = self._action("Quit Understudy", self.close, QKeySequence.StandardKey.Quit)
        quit_action.setMenuRole(QAction.MenuRole.QuitRole)
        file_menu.addAction(quit_action)

        edit_menu = bar.addMenu("&Edit")
        self.edit_actions = EditActions(edit_menu, self)
        edit_menu.addSeparator()
        self.find_action = self._action("Search Chats", self.search_chats,
                                        QKeySequence.StandardKey.Find)
        edit_menu.addAction(self.find_action)  # where a Mac app keeps Find
        edit_menu.addSeparator()
        self.settings_action = self._action("Settings…", self.show_settings, "Ctrl+,")
        self.settings_action.setMenuRole(QAction.MenuRole.PreferencesRole)
        edit_menu.addAction(self.settings_action)
        self.hub_settings_action = self._action("Hugging Face Token…", self.show_hub_settings)
        edit_menu.addAction(self.hub_settings_action)

        view_menu = bar.addMenu("&View")
        self.speculation_action = self._action("Show Speculation", self.chat_view.set_show_speculation,
                                               "Ctrl+Shift+S", checkable=True)
        self.speculation_action.setChecked(True)
        self.chat_view.speculation_box.toggled.connect(self.speculation_action.setChecked)
        self.rejected_action = self._action("Show Rejected Guesses", self.chat_view.set_show_rejected,
                                            checkable=True)
        self.rejected_action.setChecked(True)
        self.chat_view.rejected_box.toggled.connect(self.rejected_action.setChecked)
        # off by default: colour alone is today's look; on adds an underline (corrected)
        # and an overline (bonus), for readers who cannot tell green from amber
        self.marks_action = self._action("Mark Token Kinds by Shape", self.chat_view.set_show_marks,
                                         checkable=True)
        self.marks_action.toggled.connect(self.comparison_view.set_show_marks)
        self.compare_action = self._action("Speculative vs Plain", self.compare_button.setChecked,
                                           "Ctrl+Shift+C", checkable=True)
        self.compare_button.toggled.connect(self.compare_action.setChecked)
        self.sidebar_action = self._action("Show Chats", self.sidebar.setVisible, "Ctrl+Shift+L",
                                           checkable=True)
        self.sidebar_action.setChecked(True)
        self.panel_action = self._action("Show Side Panel", self.side_panel.setVisible,
                                         "Ctrl+Shift+P", checkable=True)
        self.panel_action.setChecked(True)
        self.zoom_in_action = self._action("Zoom In",
                                           lambda: self.set_zoom(zoom.step(self.zoom, 1)))
        # Ctrl+= too: the + key needs Shift on most layouts, and browsers take both
        self.zoom_in_action.setShortcuts([QKeySequence.StandardKey.ZoomIn, QKeySequence("Ctrl+=")])
        self.zoom_out_action = self._action("Zoom Out",
                                            lambda: self.set_zoom(zoom.step(self.zoom, -1)),
                                            QKeySequence.StandardKey.ZoomOut)
        self.actual_size_action = self._action("Actual Size", lambda: self.set_zoom(zoom.DEFAULT),
                                               "Ctrl+0")
        for action in (self.speculation_action, self.rejected_action, self.marks_action,
                       self.compare_action, None, self.sidebar_action, self.panel_action, None,
                       self.zoom_in_action, self.zoom_out_action, self.actual_size_action):
            view_menu.addSeparator() if action is None else view_menu.addAction(action)

        chat_menu = bar.addMenu("&Chat")
        self.stop_action = self._action("Stop", self.controller.stop, "Ctrl+.")
        self.stop_action.setEnabled(False)
        self.regenerate_action = self._action("Regenerate Last Reply", self.regenerate_last, "Ctrl+R")
        self.continue_action = self._action("Continue Last Reply", self.continue_last,
                                            "Ctrl+Shift+R")
        chat_menu.addAction(self.stop_action)
        chat_menu.addAction(self.regenerate_action)
        chat_menu.addAction(self.continue_action)
        self.continue_action.setEnabled(False)  # until the last reply is one cut short
        chat_menu.addSeparator()
        chat_menu.addAction(self._action("Rename Chat…", self._rename_current))
        self.train_action = self._action("Train a Drafter for This Model…",
                                         self.show_train_drafter)
        chat_menu.addAction(self._action("Delete Chat…", self._delete_current))
        chat_menu.addSeparator()
        chat_menu.addAction(self.train_action)
        help_menu = bar.addMenu("&Help")
        help_menu.addAction(self._action("Diagnostics…", self.show_diagnostics))
        self.about_action = self._action("About Understudy", self.show_about)
        self.about_action.setMenuRole(QAction.MenuRole.AboutRole)  # the app menu on macOS
        help_menu.addAction(self.about_action)

    # -- intents -------------------------------------------------------------------------
    @property
    def comparison_mode(self) -> bool:
        return self.compare_button.isChecked()

    def set_comparison_mode(self, on: bool) -> None:
        if self.compare_button.isChecked() != on:
            self.compare_button.setChecked(on)
        self.stack.setCurrentWidget(self.comparison_view if on else self.chat_view)

    def _update_compare_toggle(self) -> None:
        """The comparison view opens only when it has a race to show: turned on under a
        chat reply it would hide that reply behind two empty panes. Leaving it is always
        allowed."""
        c = self.controller
        enabled = self.comparison_mode or not c.generating or c.comparing
        self.compare_button.setEnabled(enabled)
        self.compare_action.setEnabled(enabled)
        self.compare_button.setToolTip(COMPARE_TIP if enabled else COMPARE_BUSY_TIP)

    def set_zoom(self, factor: float) -> None:
        """The conversation's text size (View ▸ Zoom In/Out, Actual Size)."""
        self.zoom = factor
        font = zoom.scaled(self.font(), factor)
        self.chat_view.set_text_font(font)
        for widget in (self.comparison_view.speculative.browser,
                       self.comparison_view.plain.browser, self.composer.edit):
            widget.setFont(font)
        self.zoom_in_action.setEnabled(factor < zoom.LEVELS[-1])
        self.zoom_out_action.setEnabled(factor > zoom.LEVELS[0])
        self.actual_size_action.setEnabled(factor != zoom.DEFAULT)

    def focus_composer(self) -> None:
        self.composer.edit.setFocus(Qt.FocusReason.OtherFocusReason)

    def _on_page_requested(self, direction: int) -> None:
        """Page Up/Down in the composer: the conversation showing scrolls (the race's two
        panes together, in the comparison)."""
        if not self.comparison_mode:
            self.chat_view.scroll_page(direction)
            return
        for pane in (self.comparison_view.speculative, self.comparison_view.plain):
            page_scroll(pane.browser.verticalScrollBar(), direction)

    def search_chats(self) -> None:
        """Edit ▸ Search Chats (Ctrl/⌘+F): the chat list's search field, its text selected
        so typing replaces it (the list is shown if it was hidden)."""
        self.sidebar_action.setChecked(True)
        self.sidebar.search_edit.setFocus(Qt.FocusReason.ShortcutFocusReason)
        self.sidebar.search_edit.selectAll()

    diagnostics_dialog = None  # Help ▸ Diagnostics…, made on first use
    about_box: QMessageBox | None = None  # Help ▸ About Understudy, made on first use

    def show_about(self) -> QMessageBox:
        """Help ▸ About Understudy: the version, the model loaded and MLX's version."""
        from app.about import SUMMARY, about_details
        from app.ui.app_icon import app_icon

        if self.about_box is None:
            self.about_box = QMessageBox(self)
            self.about_box.setWindowTitle("About Understudy")
            self.about_box.setIconPixmap(app_icon().pixmap(64, 64))
            self.about_box.setTextFormat(Qt.TextFormat.RichText)
            self.about_box.setStandardButtons(QMessageBox.StandardButton.Ok)
        model = self.controller.model
        lines = about_details(model.name if model is not None else None)
        self.about_box.setText(f"<b>Understudy</b><br>{lines[0]}")
        self.about_box.setInformativeText(  # rich text, as the box's format is
            "<br>".join(html.escape(line) for line in (SUMMARY, "", *lines[1:])))
        self.about_box.open()  # not modal to the app: a reply may be streaming
        return self.about_box

    def show_diagnostics(self) -> None:
        """Help ▸ Diagnostics…: `understudy doctor`'s report (kernels, backend, BLAS)."""
        if self.diagnostics_dialog is None:
            from app.ui.diagnostics import DiagnosticsDialog

            self.diagnostics_dialog = DiagnosticsDialog(self.controller.host, self)
            self.diagnostics_dialog.run()
        self.diagnostics_dialog.show()
        self.diagnostics_dialog.raise_()

    def show_train_drafter(self) -> None:
        """Chat ▸ Train a Drafter…: the training window (one per main window)."""
        if self.train_dialog is None:
            from app.ui.train_dialog import TrainDrafterDialog

            self.train_dialog = TrainDrafterDialog(self.controller, self)
        self.train_dialog.refresh()
        self.train_dialog.show()
        self.train_dialog.raise_()

    # -- local server --------------------------------------------------------------------
    def _build_server_menu(self) -> None:
        menu = self.menuBar().addMenu("&Server")
        self.server_start_action = self._action("Start Server", self.start_server)
        self.server_stop_action = self._action("Stop Server", self.stop_server)
        self.server_stop_action.setEnabled(False)
        menu.addAction(self.server_start_action)
        menu.addAction(self.server_stop_action)
        menu.addSeparator()
        menu.addAction(self._action("Server Panel…", self.show_server_panel))

    @property
    def server_panel(self) -> ServerPanel:
        """The local server's panel, made on first use (it starts nothing by itself)."""
        if self._server_panel is None:
            from app.ui.server_panel import ServerPanel

            self._server_panel = ServerPanel(self.controller.host, self.controller, self,
                                             self.qsettings)
            self._server_panel.running_changed.connect(self._on_server_running_changed)
        return self._server_panel

    def show_server_panel(self) -> ServerPanel:
        panel = self.server_panel
        panel.show()
        panel.raise_()
        return panel

    def start_server(self) -> None:
        """Server ▸ Start: listen with the panel's settings and show where."""
        self.show_server_panel().start_server()

    def stop_server(self) -> None:
        if self._server_panel is not None:
            self._server_panel.stop_server()

    def _on_server_running_changed(self, running: bool) -> None:
        self.server_start_action.setEnabled(not running)
        self.server_stop_action.setEnabled(running)
        url = self._server_panel.url if self._server_panel is not None else None
        self.statusBar().showMessage(f"Server listening on {url}" if running and url
                                     else "Server stopped", 5000)

    def show_settings(self) -> None:
        self.panel_action.setChecked(True)
        self.side_panel.ensureWidgetVisible(self.settings_panel)
        self.settings_panel.temperature.setFocus()

    # -- model manager -------------------------------------------------------------------
    @property
    def models_controller(self) -> ModelsController:
        """The model manager's logic, made on first use (it reads the keychain lazily too)."""
        if self._models_controller is None:
            from app.ui.import_dialog import ImportProgressDialog, ask_import_name
            from app.ui.models_controller import ModelsController

            mc = ModelsController(self.qsettings, mlx_thread=self.controller.host.thread,
                                  parent=self)
            mc.library_changed.connect(self._on_library_changed)
            mc.model_deleted.connect(self._on_model_deleted)
            mc.model_imported.connect(self._on_model_imported)
            mc.library_failed.connect(self._on_library_failed)

            def name_taken(path: str, taken: str, free: str) -> None:
                panel = self._models_panel
                parent = panel if panel is not None and panel.isVisible() else self
                self.import_name_dialog = ask_import_name(mc, parent, path, taken, free)

            mc.import_name_taken.connect(name_taken)
            self._models_controller = mc
            self.import_dialog = ImportProgressDialog(mc, self)
        return self._models_controller

    def import_gguf(self, path: str | None = None) -> None:
        """File ▸ Import GGUF…: convert a GGUF file into the library (on the engine thread,
        with progress); the model then appears in the pickers."""
        if path is None:
            path, _ = QFileDialog.getOpenFileName(self, "Import GGUF", "", "GGUF models (*.gguf)")
            if not path:
                return
        self.models_controller.import_path(path)

    def _on_model_imported(self, model: LocalModel) -> None:
        if self.banner.text and self.banner.text == self._library_error:
            self.banner.hide()  # an import that worked: the last one's failure is stale
        self.statusBar().showMessage(f"Imported {model.name}: pick it in Target or Draft model",
                                     8000)

    def _on_library_failed(self, message: str) -> None:
        if self._models_panel is None or not self._models_panel.isVisible():
            self.banner.show_message(message)  # else the panel shows it
            self._library_error = message

    def show_models(self) -> ModelsPanel:
        """Open (or raise) the Models panel."""
        if self._models_panel is None:
            from app.ui.models_panel import ModelsPanel

            self._models_panel = ModelsPanel(self.models_controller, self,
                                             in_use=self._model_in_use)
            self._models_panel.hub_settings_requested.connect(self.show_hub_settings)
        self._models_panel.show()
        self._models_panel.raise_()
        self._models_panel.activateWindow()
        return self._models_panel

    def show_hub_settings(self) -> PreferencesDialog:
        """Open the Hugging Face settings (token, offline mode)."""
        if self._preferences is None:
            from app.ui.preferences import PreferencesDialog

            self._preferences = PreferencesDialog(self.models_controller, self)
        self._preferences.show()
        self._preferences.raise_()
        self._preferences.activateWindow()
        return self._preferences

    def _model_specs(self, model: LocalModel) -> set[str]:
        from engine.paths import models_dir

        specs = {model.name}
        if model.path is not None:
            specs.add(str(model.path))
        if model.kind == "imported":
            specs.add(str(models_dir() / model.name))
        return specs

    def _model_in_use(self, model: LocalModel) -> str | None:
        if self.controller.settings.target in self._model_specs(model):
            return (f"{model.name} is the current target model. Pick another target in the "
                    "side panel before deleting it.")
        return None

    def _on_library_changed(self, _library: object) -> None:
        self.settings_panel.refresh_models()

    def _on_model_deleted(self, name: str, _freed: int) -> None:
        from engine.paths import models_dir

        draft = self.controller.settings.draft
        if draft in (name, str(models_dir() / name)):
            self.controller.set_settings(replace(self.controller.settings, draft=None))

    def regenerate_last(self) -> None:
        replies = [m for m in self.controller.messages() if m.role == "assistant"]
        if replies:
            self.controller.regenerate(replies[-1].id)

    def continue_last(self) -> None:
        """Write on from the end of the last reply, if it was cut short (else nothing)."""
        last = self.controller.last_continuable()
        if last is not None:
            self.controller.continue_reply(last)

    def _update_continue_action(self) -> None:
        self.continue_action.setEnabled(self.controller.last_continuable() is not None)

    def export_conversation(self, conversation_id: int | None = None,
                            path: Path | str | None = None) -> Path | None:
        """Write a conversation as Markdown to `path` (asks for one when not given)."""
        conversation_id = conversation_id or self.controller.conversation_id
        conv = self.controller.store.conversation(conversation_id) if conversation_id else None
        if conv is None:
            return None
        if path is None:
            suggested = "".join(c if c.isalnum() or c in " -_" else "_" for c in conv.title)
            chosen, _ = QFileDialog.getSaveFileName(self, "Export chat", f"{suggested}.md",
                                                    "Markdown (*.md)")
            if not chosen:
                return None
            path = chosen
        out = Path(path)
        # the text and numbers only: a long chat's token fates took seconds to read
        messages = self.controller.store.messages(conv.id, with_steps=False)
        out.write_text(conversation_markdown(conv.title, messages), encoding="utf-8")
        self.statusBar().showMessage(f"Exported to {out}", 5000)
        return out

    def _rename_current(self) -> None:
        if self.controller.conversation_id is not None:
            self.sidebar.rename(self.controller.conversation_id)

    def _delete_current(self) -> None:
        if self.controller.conversation_id is not None:
            self.sidebar.confirm_delete(self.controller.conversation_id)

    def _on_message_submitted(self, text: str) -> None:
        self.banner.hide()
        self.controller.send(text, compare=self.comparison_mode)

    def _on_edit_submitted(self, message_id: int, text: str) -> None:
        self.banner.hide()
        self.controller.edit_and_resend(message_id, text)

    # -- controller events ---------------------------------------------------------------
    def _on_model_loading(self, spec: str) -> None:
        self.model_label.setText(f"Loading {spec}…")
        self.load_progress.setRange(0, 0)
        self.load_progress.show()

    def _on_model_load_progressed(self, done: int, total: int) -> None:
        """Weights read so far: in per mille, as a big model's bytes overflow an int."""
        self.load_progress.setRange(0, 1000)
        self.load_progress.setValue(done * 1000 // max(total, 1))
        self.load_progress.setToolTip(f"{format_bytes(done)} of {format_bytes(total)} "
                                      "of weights read")

    def _on_model_loaded(self, info: ModelInfo) -> None:
        self.load_progress.hide()
        model = self.controller.model
        if model is not None:
            self.model_label.setText(f"{model.name} · {model.model_type} · {model.backend}")
            for gauge in (self.gauge, self.comparison_view.speculative.gauge,
                          self.comparison_view.plain.gauge):
                gauge.set_context_window(model.context_window)
        if info.template_warning:
            self.banner.show_message(info.template_warning)

    def _on_model_load_failed(self, spec: str, _message: str) -> None:
        """The banner says why; the status bar says the load ended, and what is in use."""
        self.load_progress.hide()
        model = self.controller.model
        text = f"Could not load {model_name(spec)}"
        if model is not None:
            text += f" — still using {model.name} · {model.model_type} · {model.backend}"
        self.model_label.setText(text)

    def _on_message_added(self, message: Message) -> None:
        if message.role == "assistant":
            self.gauge.reset()

    def _on_step_received(self, _message_id: int, _step: Step, stats: Stats) -> None:
        self.gauge.show_stats(stats)

    def _on_reply_finished(self, message: Message) -> None:
        from app.store import stats_from_dict

        self.gauge.show_final(stats_from_dict(message.stats))

    def _on_generating_changed(self, generating: bool) -> None:
        self._update_stop_action()
        self.regenerate_action.setEnabled(not generating)
        self._update_continue_action()
        self._update_compare_toggle()
        if not generating:
            self.load_progress.hide()

    def _on_conversation_opened(self, _messages: object) -> None:
        self._update_title()  # (the composer ends an edit and keeps drafts itself)
        self._update_stop_action()
        if not self.sidebar.browsing:  # (arrowing through the list keeps the keyboard there)
            self.composer.edit.setFocus()

    def _update_stop_action(self) -> None:
        """Chat ▸ Stop stops the open chat's reply only (as the composer's Stop)."""
        self.stop_action.setEnabled(self.controller.generating_here)

    def _update_title(self) -> None:
        cid = self.controller.conversation_id
        conv = self.controller.store.conversation(cid) if cid is not None else None
        title = conv.title if conv else DEFAULT_TITLE
        self.title_label.setText(title)
        self.setWindowTitle(f"{title} — Understudy")

    # -- persistence ---------------------------------------------------------------------
    def _restore_state(self) -> None:
        qs = self.qsettings
        geometry = qs.value("window/geometry")
        if isinstance(geometry, QByteArray | bytes):
            self.restoreGeometry(QByteArray(geometry))
        splitter = qs.value("window/splitter")
        if isinstance(splitter, QByteArray | bytes):
            self.splitter.restoreState(QByteArray(splitter))
        self.chat_view.set_show_speculation(_as_bool(qs.value("view/speculation", True)))
        self.chat_view.set_show_rejected(_as_bool(qs.value("view/rejected", True)))
        self.marks_action.setChecked(_as_bool(qs.value("view/marks", False)))
        self.set_comparison_mode(_as_bool(qs.value("view/comparison", False)))
        self.set_zoom(zoom.nearest(qs.value("view/zoom", zoom.DEFAULT)))

    def save_state(self) -> None:
        qs = self.qsettings
        qs.setValue("window/geometry", self.saveGeometry())
        qs.setValue("window/splitter", self.splitter.saveState())
        qs.setValue("view/speculation", self.chat_view.show_speculation)
        qs.setValue("view/rejected", self.chat_view.show_rejected)
        qs.setValue("view/marks", self.chat_view.show_marks)
        qs.setValue("view/comparison", self.comparison_mode)
        qs.setValue("view/zoom", self.zoom)
        qs.setValue("chat/settings", json.dumps(self.controller.settings.as_dict()))
        if self.controller.conversation_id is not None:
            qs.setValue("chat/last_conversation", self.controller.conversation_id)
        qs.sync()

    def open_initial_conversation(self) -> None:
        """Reopen the conversation the user last had open (or the most recent one)."""
        store = self.controller.store
        last = self.qsettings.value("chat/last_conversation")
        try:
            wanted = int(last) if last is not None else None
        except (TypeError, ValueError):
            wanted = None
        if wanted is None or store.conversation(wanted) is None:
            recent = store.conversations()
            wanted = recent[0].id if recent else None
        self.controller.open_conversation(wanted)
        n = store.interrupted_on_open
        if store.repair is not None:
            self.banner.show_message(store.repair.message())
        elif n:
            what = "A reply was" if n == 1 else f"{n} replies were"
            self.banner.show_message(f"{what} cut off when Understudy last closed; what was "
                                     "generated is kept and marked as interrupted.")

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt override
        self.save_state()
        self.stop_server()
        if self._models_controller is not None:
            self._models_controller.shutdown()
        self.settings_panel.shutdown()
        self.controller.close()
        super().closeEvent(event)


def _as_bool(value: object) -> bool:
    if isinstance(value, str):
        return value.lower() in ("1", "true", "yes")
    return bool(value)
