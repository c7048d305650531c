"""Hugging Face settings: the access token (kept in the OS keychain) and offline mode.

The token field is a password field that is emptied once the token is saved: the token
then lives in the keychain (or, without one, in memory for this session, which the status
line says) and the field only shows a masked hint. The account check runs on the hub
through the models controller, never blocking the window.
"""

from __future__ import annotations

from html import escape

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.hub.token_store import TokenStatus
from app.ui.models_controller import ModelsController
from app.ui.models_tables import good_bad
from app.ui.tool_window import close_with_keys

TOKENS_URL = "https://huggingface.co/settings/tokens"


class HubAccountSection(QGroupBox):
    """Token field with Save / Clear / Check, a status line and the offline switch."""

    def __init__(self, controller: ModelsController, parent: QWidget | None = None) -> None:
        super().__init__("Hugging Face token", parent)
        self.controller = controller
        intro = QLabel(
            "Only gated or private models need a token.<br>Create a <b>read</b> token at "
            f'<a href="{TOKENS_URL}">huggingface.co/settings/tokens</a>.<br>'
            "It is kept in the system keychain, never in files or logs.")
        intro.setWordWrap(True)
        intro.setOpenExternalLinks(True)
        intro.setTextFormat(Qt.TextFormat.RichText)
        self.token_edit = QLineEdit()
        self.token_edit.setEchoMode(QLineEdit.EchoMode.Password)
        self.token_edit.setClearButtonEnabled(True)
        self.save_button = QPushButton("Save")
        self.clear_button = QPushButton("Clear")
        self.check_button = QPushButton("Check")
        self.check_button.setToolTip("Ask the hub which account the token belongs to")
        self.status_label = QLabel()
        self.status_label.setObjectName("tokenStatus")
        self.status_label.setWordWrap(True)
        self.status_label.setTextFormat(Qt.TextFormat.RichText)
        self.status_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.offline_box = QCheckBox("Offline mode: use downloaded models only, never contact "
                                     "the hub")
        self.endpoint_label = QLabel(f"Hub: {controller.endpoint}")
        self.endpoint_label.setObjectName("modelStatus")

        row = QHBoxLayout()
        row.addWidget(self.token_edit, 1)
        for button in (self.save_button, self.clear_button, self.check_button):
            row.addWidget(button)
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addLayout(row)
        layout.addWidget(self.status_label)
        layout.addSpacing(6)
        layout.addWidget(self.offline_box)
        layout.addWidget(self.endpoint_label)

        self.save_button.clicked.connect(self._on_save_clicked)
        self.clear_button.clicked.connect(self._on_clear_clicked)
        self.check_button.clicked.connect(self._on_check_clicked)
        self.token_edit.returnPressed.connect(self._on_save_clicked)
        self.token_edit.textChanged.connect(self._sync_buttons)
        self.offline_box.toggled.connect(self._on_offline_toggled)
        controller.token_changed.connect(self._on_token_changed)
        controller.token_checked.connect(self._on_token_checked)
        controller.token_check_failed.connect(self._on_token_check_failed)
        controller.offline_changed.connect(self._on_offline_changed)
        self._on_offline_changed(controller.offline)
        self._show_status(controller.token_status())

    # -- intents ---------------------------------------------------------------------------
    def _on_save_clicked(self) -> None:
        text = self.token_edit.text().strip()
        if text:
            self.controller.save_token(text)
            self.token_edit.clear()  # the keychain has it now; do not keep it in a widget

    def _on_clear_clicked(self) -> None:
        self.token_edit.clear()
        self.controller.clear_token()

    def _on_check_clicked(self) -> None:
        self._on_save_clicked()  # a freshly typed token is what the user wants checked
        if self.controller.offline:
            self.status_label.setText("Offline mode is on: the token cannot be checked.")
            return
        self.status_label.setText("Checking with the hub…")
        self.check_button.setEnabled(False)
        self.controller.check_token()

    def _on_offline_toggled(self, on: bool) -> None:
        self.controller.set_offline(on)

    # -- controller events -------------------------------------------------------------------
    def _show_status(self, status: TokenStatus) -> None:
        self.token_edit.setPlaceholderText(
            f"Saved ({self.controller.token_hint()}); paste another to replace it"
            if status.has_token
            else "hf_…  (paste a read token)")
        if status.message:
            text = status.message
        elif status.has_token:
            text = "Saved in the system keychain."
        else:
            text = "No token saved."
        self.status_label.setText(escape(text))
        self._sync_buttons()

    def _sync_buttons(self) -> None:
        has = self.controller.has_token() or bool(self.token_edit.text().strip())
        self.save_button.setEnabled(bool(self.token_edit.text().strip()))
        self.clear_button.setEnabled(has)
        self.check_button.setEnabled(has)

    def _on_token_changed(self, status: TokenStatus) -> None:
        self._show_status(status)

    def _on_token_checked(self, account: str) -> None:
        self._sync_buttons()
        self.status_label.setText(f"<span style='color:{good_bad()[0]}'>✓</span> The token belongs to "
                                  f"<b>{escape(account)}</b>.")

    def _on_token_check_failed(self, message: str) -> None:
        self._sync_buttons()
        self.status_label.setText(f"<span style='color:{good_bad()[1]}'>✗</span> {escape(message)}")

    def _on_offline_changed(self, on: bool) -> None:
        forced = self.controller.offline_forced
        self.offline_box.blockSignals(True)
        self.offline_box.setChecked(on)
        self.offline_box.blockSignals(False)
        self.offline_box.setEnabled(not forced)
        self.offline_box.setToolTip("HF_HUB_OFFLINE is set in the environment" if forced else
                                    "No network calls: search and downloads are off")


class PreferencesDialog(QDialog):
    """Settings that are not about one chat: for now, the Hugging Face account."""

    def __init__(self, controller: ModelsController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings — Hugging Face")
        close_with_keys(self)
        self.hub_section = HubAccountSection(controller)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.close)
        layout = QVBoxLayout(self)
        layout.addWidget(self.hub_section)
        layout.addWidget(buttons)
        self.resize(600, self.sizeHint().height())
