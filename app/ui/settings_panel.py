"""The settings side panel: models, drafter, K, acceptance rule, sampling, system prompt.

Every edit becomes a new `ChatSettings` handed to the controller; the next reply uses it and
stores it with the message. Draft models the target cannot use stay listed but disabled,
with the reason on hover. Both pickers end with "Choose a folder…", for a model folder
anywhere on disk; a draft folder chosen there that cannot draft for the target (the
tokenizer check a reply makes, from its tokenizer files) is refused there and then. That
check reads both tokenizer.json files, so it runs on `DraftChecker`'s thread: an entry
being checked is greyed out and says so, and is updated when the verdict arrives.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QStandardItem, QStandardItemModel
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.hub.model_choices import ModelChoice, available_models
from app.ui.controller import ChatController
from app.ui.draft_check import CHECKING, DraftChecker
from app.ui.worker import DRAFTER_MODES, REPEAT_PENALTY_RANGE, ChatSettings, ModelInfo
from engine.choices import ACCEPT_RULES, TREE_MODES
from engine.tuning import K_MAX

DRAFTER_HELP = {
    "off": "Plain decoding: one target pass per token",
    "model": "A small draft model proposes tokens (pick it below)",
    "ngram": "Prompt lookup: copies continuations of text already in the conversation",
    "layerskip": "The target's own first layers draft for the full model",
    "head": "A head trained on this model's own replies (Chat ▸ Train a Drafter for This Model…)",
    "auto": "Pick the best drafter from measured costs and acceptance",
}
NO_DRAFT_HELP = ("Pick a draft model under Draft model first: a smaller model of the "
                 "target's family (Models… downloads one)")
NO_HEAD_HELP = ("No drafter head is trained for this model yet: Chat ▸ Train a Drafter for "
                "This Model… trains one")
ACCEPT_HELP = {
    "coupled": "Same noise for draft and target: output identical to plain decoding",
    "rejection": "Leviathan/Chen rejection sampling: same distribution, accepts more often",
}
TREE_HELP = {
    "auto": "Verify several guesses per position in one pass where the measured costs say "
            "the extra rows pay (coupled rule); losing branches show as rejected ghosts",
    "off": "Chains only: one guess per position",
}
NO_DRAFT = "(no draft model)"
CANNOT_DRAFT = "Cannot draft for this target: "
DRAFT_MODEL_HELP = "The model that drafts for the model and auto drafters"
CHOOSE_FOLDER = "Choose a folder…"
CHOOSE = "\x00choose-folder"  # the item data of CHOOSE_FOLDER, never a model spec
CHOICE_ROLE = Qt.ItemDataRole.UserRole + 1  # a draft entry's ModelChoice
CHECKING_HELP = "Checking that it shares the target's tokenizer…"
CHECKING_LABEL = " (checking…)"


class SettingsPanel(QWidget):
    models_requested = Signal()  # "Models…": open the model manager

    def __init__(self, controller: ChatController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self._target_path: Path | None = None
        self._target_note = ("", "")  # the status row's text and tooltip for the target
        self._updating = False
        self._chosen_draft: ModelChoice | None = None  # a chosen folder awaiting its check
        self._checker = DraftChecker(self)
        self._checker.verdict_arrived.connect(self._on_verdict_arrived)

        self.target_combo = QComboBox()
        self.draft_combo = QComboBox()
        self.draft_model = QStandardItemModel(self)
        self.draft_combo.setModel(self.draft_model)
        self.drafter_combo = QComboBox()
        for mode in DRAFTER_MODES:
            self.drafter_combo.addItem(mode, mode)
            self.drafter_combo.setItemData(self.drafter_combo.count() - 1, DRAFTER_HELP[mode],
                                           Qt.ItemDataRole.ToolTipRole)
        self.k_auto = QCheckBox("auto")
        self.k_spin = QSpinBox()
        self.k_spin.setRange(1, K_MAX)  # the engine's limit: a longer draft was refused
        self.k_spin.setValue(4)
        self.accept_combo = QComboBox()
        for rule in ACCEPT_RULES:
            self.accept_combo.addItem(rule, rule)
            self.accept_combo.setItemData(self.accept_combo.count() - 1, ACCEPT_HELP[rule],
                                          Qt.ItemDataRole.ToolTipRole)
        self.tree_combo = QComboBox()
        for mode in TREE_MODES:
            self.tree_combo.addItem(mode, mode)
            self.tree_combo.setItemData(self.tree_combo.count() - 1, TREE_HELP[mode],
                                        Qt.ItemDataRole.ToolTipRole)
        self.temperature = _double(0.0, 2.0, 0.1, 2)
        self.top_p = _double(0.01, 1.0, 0.05, 2)  # the engine refuses 0: it keeps nothing
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 100000)
        self.top_k.setSpecialValueText("off")
        self.min_p = _double(0.0, 1.0, 0.01, 2)
        self.repetition_penalty = _double(*REPEAT_PENALTY_RANGE, 0.05, 2)
        self.repetition_penalty.setSpecialValueText("off")  # at the minimum, 1
        self.repetition_penalty.setToolTip(
            "Repeat penalty: above 1 makes tokens of the last 64 (the prompt's included) less "
            "likely. 1.1 breaks a small model's loops; it also works against code edits, which "
            "repeat their input. 1 = off")
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 131072)
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        # the row is "My chats": short labels keep the panel narrow
        self.learn_check = QCheckBox("Record for training")
        self.learn_check.setToolTip(
            "Record my chats for drafter training: keep each reply's model features on disk (in the app-data folder, bounded, "
            "oldest dropped) so Train a Drafter learns from your own chats. Off by default.")
        self.improve_check = QCheckBox("Improve the drafter")
        self.improve_check.setToolTip(
            "Improve the drafter from my chats. Records them too; once enough new replies are recorded and a drafter head "
            "exists for this model, fine-tune it briefly between replies.")
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("Optional instructions for every reply")
        self.system_prompt.setFixedHeight(80)
        self.system_prompt.setTabChangesFocus(True)  # Tab typed a tab and held the keyboard
        self.model_status = QLabel("")
        self.model_status.setObjectName("modelStatus")
        self.model_status.setWordWrap(True)
        self.models_button = QPushButton("Models…")
        self.models_button.setToolTip("Search, download, import and delete models (Ctrl+Shift+M)")
        self.models_button.clicked.connect(self.models_requested)

        for combo in (self.target_combo, self.draft_combo, self.drafter_combo, self.accept_combo):
            # Long model names must not widen the panel; the full name is in the tooltip.
            combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            combo.setMinimumContentsLength(8)
        self.draft_combo.setToolTip(DRAFT_MODEL_HELP)
        k_row = QHBoxLayout()
        k_row.setContentsMargins(0, 0, 0, 0)
        k_row.addWidget(self.k_auto)
        k_row.addWidget(self.k_spin, 1)
        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        form.addRow("Target", self.target_combo)
        form.addRow("", self.model_status)
        form.addRow("", self.models_button)
        form.addRow("Drafter", self.drafter_combo)
        form.addRow("Draft model", self.draft_combo)
        form.addRow("K", k_row)
        form.addRow("Acceptance", self.accept_combo)
        form.addRow("Draft trees", self.tree_combo)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Min-p", self.min_p)
        form.addRow("Repeat penalty", self.repetition_penalty)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("Seed", self.seed)
        form.addRow("My chats", self.learn_check)
        form.addRow("", self.improve_check)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        title = QLabel("Settings")
        title.setObjectName("panelTitle")
        layout.addWidget(title)
        layout.addLayout(form)
        layout.addWidget(QLabel("System prompt"))
        layout.addWidget(self.system_prompt)
        layout.addStretch(1)

        self.set_settings(controller.settings)
        for signal in (self.target_combo.currentIndexChanged, self.draft_combo.currentIndexChanged,
                       self.drafter_combo.currentIndexChanged, self.accept_combo.currentIndexChanged,
                       self.tree_combo.currentIndexChanged,
                       self.k_auto.toggled, self.k_spin.valueChanged, self.temperature.valueChanged,
                       self.top_p.valueChanged, self.top_k.valueChanged, self.min_p.valueChanged,
                       self.repetition_penalty.valueChanged,
                       self.max_tokens.valueChanged, self.seed.valueChanged,
                       self.learn_check.toggled, self.improve_check.toggled,
                       self.system_prompt.textChanged):
            signal.connect(self._on_edited)
        controller.settings_changed.connect(self._on_settings_changed)
        controller.model_loading.connect(self._on_model_loading)
        controller.model_loaded.connect(self._on_model_loaded)
        controller.model_load_failed.connect(self._on_model_load_failed)
        controller.head_available.connect(self._on_head_available)

    # -- reading and writing ---------------------------------------------------------------
    def settings(self) -> ChatSettings:
        draft = self.draft_combo.currentData()
        if draft == CHOOSE:
            draft = self.controller.settings.draft
        target = self.target_combo.currentData()
        return ChatSettings(
            target=str(target if target and target != CHOOSE else self.controller.settings.target),
            draft=str(draft) if draft else None,
            drafter=str(self.drafter_combo.currentData()),
            k=None if self.k_auto.isChecked() else self.k_spin.value(),
            accept=str(self.accept_combo.currentData()),
            tree=str(self.tree_combo.currentData()),
            temperature=self.temperature.value(),
            top_p=self.top_p.value(),
            top_k=self.top_k.value(),
            min_p=self.min_p.value(),
            repetition_penalty=self.repetition_penalty.value(),
            max_tokens=self.max_tokens.value(),
            seed=self.seed.value(),
            system_prompt=self.system_prompt.toPlainText(),
            learn_from_chats=self.learn_check.isChecked(),
            improve_drafter=self.improve_check.isChecked(),
        )

    def set_settings(self, s: ChatSettings) -> None:
        self._updating = True
        try:
            self._fill_targets(s.target)
            self._fill_drafts(s.draft)
            _select(self.drafter_combo, s.drafter)
            _select(self.accept_combo, s.accept)
            _select(self.tree_combo, s.tree)
            self.k_auto.setChecked(s.k is None)
            self.k_spin.setEnabled(s.k is not None)
            if s.k is not None:
                self.k_spin.setValue(s.k)
            self.temperature.setValue(s.temperature)
            self.top_p.setValue(s.top_p)
            self.top_k.setValue(s.top_k)
            self.min_p.setValue(s.min_p)
            self.repetition_penalty.setValue(s.repetition_penalty)
            self.max_tokens.setValue(s.max_tokens)
            self.seed.setValue(s.seed)
            self.learn_check.setChecked(s.learn_from_chats)
            self.improve_check.setChecked(s.improve_drafter)
            if self.system_prompt.toPlainText() != s.system_prompt:
                self.system_prompt.setPlainText(s.system_prompt)
            self._sync_enabled()
        finally:
            self._updating = False

    def _fill_targets(self, current: str) -> None:
        self.target_combo.clear()
        for choice in available_models(extra=(current,)):
            self.target_combo.addItem(choice.label, choice.spec)
            self.target_combo.setItemData(self.target_combo.count() - 1,
                                          str(choice.path or choice.spec),
                                          Qt.ItemDataRole.ToolTipRole)
        self.target_combo.insertSeparator(self.target_combo.count())
        self.target_combo.addItem(CHOOSE_FOLDER, CHOOSE)
        _select(self.target_combo, current)

    def _fill_drafts(self, current: str | None) -> None:
        """List every model; those that cannot pair with the target are disabled, with why."""
        self.draft_model.clear()
        none_item = QStandardItem(NO_DRAFT)
        none_item.setData(None, Qt.ItemDataRole.UserRole)
        self.draft_model.appendRow(none_item)
        extra = tuple(x for x in (current, self.controller.settings.target) if x)
        for choice in available_models(extra=extra):
            item = QStandardItem(choice.label)
            item.setData(choice.spec, Qt.ItemDataRole.UserRole)
            item.setData(choice, CHOICE_ROLE)
            self._show_pairing(item)
            self.draft_model.appendRow(item)
        choose = QStandardItem(CHOOSE_FOLDER)
        choose.setData(CHOOSE, Qt.ItemDataRole.UserRole)
        choose.setToolTip("A model folder (config.json, tokenizer.json, *.safetensors)")
        self.draft_model.appendRow(choose)
        _select(self.draft_combo, current)

    def _show_pairing(self, item: QStandardItem) -> None:
        """Enable a draft entry, or disable it with why (or "checking…" until known)."""
        choice: ModelChoice = item.data(CHOICE_ROLE)
        reason = self._checker.reason(self._target_path, choice)
        item.setText(choice.label + (CHECKING_LABEL if reason == CHECKING else ""))
        item.setEnabled(reason is None)
        if reason is None:
            item.setToolTip(str(choice.path))
        else:
            item.setToolTip(CHECKING_HELP if reason == CHECKING else f"{CANNOT_DRAFT}{reason}")

    def refresh_models(self) -> None:
        """Re-read the model lists (after a download, import or delete), keeping the choice."""
        self._updating = True
        try:
            self._fill_targets(self.controller.settings.target)
            self._fill_drafts(self.controller.settings.draft)
            self._sync_model_drafter()
        finally:
            self._updating = False

    def draft_reason(self, spec: str) -> str | None:
        """The hover text of a draft entry, or None when it is selectable (`CHECKING_HELP`
        while its tokenizer is being compared with the target's)."""
        for row in range(self.draft_model.rowCount()):
            item = self.draft_model.item(row)
            if item.data(Qt.ItemDataRole.UserRole) == spec:
                return None if item.isEnabled() else item.toolTip()
        return "not listed"

    def _sync_enabled(self) -> None:
        mode = self.drafter_combo.currentData()
        self._sync_model_drafter()
        self.k_spin.setEnabled(not self.k_auto.isChecked() and mode != "off")
        self.k_auto.setEnabled(mode != "off")
        self.accept_combo.setEnabled(mode != "off")
        # the rejection rule verifies chains only (engine/tree_verify.py)
        self.tree_combo.setEnabled(mode != "off" and self.accept_combo.currentData() == "coupled")

    def _sync_model_drafter(self) -> None:
        """`model` is offered only once a draft model that can pair with the target is
        chosen (a reply with it would only fail); the draft picker stays open in every
        mode, so that choosing one is always possible."""
        draft = self.draft_combo.currentData()
        reason = self.draft_reason(draft) if draft and draft != CHOOSE else NO_DRAFT_HELP
        item = self.drafter_combo.model().item(self.drafter_combo.findData("model"))
        item.setEnabled(reason is None)
        # a draft chosen earlier (a restored setting) that cannot draft says so on hover
        refused = reason is not None and reason.startswith(CANNOT_DRAFT)
        self.draft_combo.setToolTip(reason if refused else DRAFT_MODEL_HELP)
        if reason is None:
            item.setToolTip(DRAFTER_HELP["model"])
        elif reason in (NO_DRAFT_HELP, CHECKING_HELP):
            item.setToolTip(reason)
        else:
            why = reason.removeprefix(CANNOT_DRAFT)
            item.setToolTip(f"Pick another draft model: the chosen one cannot draft for this "
                            f"target ({why})")

    # -- events --------------------------------------------------------------------------
    def _on_edited(self, *_: object) -> None:
        if self._updating:
            return
        for role, combo in (("target", self.target_combo), ("draft", self.draft_combo)):
            if combo.currentData() == CHOOSE:
                self._updating = True  # the current choice stays until a folder is chosen
                try:
                    _select(combo, getattr(self.controller.settings, role))
                finally:
                    self._updating = False
                # after the popup has closed, not from inside its selection signal
                QTimer.singleShot(0, lambda role=role: self.choose_folder(role))
                return
        self._sync_enabled()
        self.controller.set_settings(self.settings())

    def choose_folder(self, role: str) -> None:
        """Ask for a model folder and use it as the "target" or "draft" (a draft once its
        tokenizer check has passed)."""
        title = "Choose a target model folder" if role == "target" else \
            "Choose a draft model folder"
        chosen = QFileDialog.getExistingDirectory(self, title)
        if not chosen:
            return
        if not (Path(chosen) / "config.json").is_file():
            self.model_status.setText(f"{chosen}: not a model folder (it has no config.json)")
            return
        current = self.controller.settings
        if role == "target":
            self.controller.set_settings(replace(current, target=chosen))
        elif self._target_path is None:
            self.controller.set_settings(replace(current, draft=chosen))
        else:
            # the tokenizer check a reply would make (tokenizer files only, no weights), so
            # a draft that cannot draft is refused here, not when a message is sent
            self._chosen_draft = ModelChoice(chosen, Path(chosen).name, Path(chosen))
            self._use_chosen_draft()

    def _use_chosen_draft(self) -> None:
        """Take the draft folder chosen, or refuse it, once its tokenizer check has ended."""
        choice = self._chosen_draft
        if choice is None:
            return
        reason = self._checker.reason(self._target_path, choice)
        if reason == CHECKING:
            self.model_status.setText(f"Checking {choice.label}…")
            self.model_status.setToolTip(CHECKING_HELP)
            return
        self._chosen_draft = None
        if reason:  # the row has room for a line or two: the reasons go on hover
            self.model_status.setText(f"{choice.label} cannot draft for this target")
            self.model_status.setToolTip(f"{CANNOT_DRAFT}{reason}")
            return
        self.model_status.setText(self._target_note[0])  # a refusal said before is over
        self.model_status.setToolTip(self._target_note[1])
        self.controller.set_settings(replace(self.controller.settings, draft=choice.spec))

    def _on_verdict_arrived(self) -> None:
        for row in range(self.draft_model.rowCount()):
            item = self.draft_model.item(row)
            if item.data(CHOICE_ROLE) is not None:
                self._show_pairing(item)
        self._sync_model_drafter()
        self._use_chosen_draft()

    def shutdown(self) -> None:
        """The window is closing: stop the tokenizer checks' thread."""
        self._checker.shutdown()

    def _on_settings_changed(self, settings: ChatSettings) -> None:
        if settings != self.settings():  # changed elsewhere (menu, test, restore)
            self.set_settings(settings)

    def _on_model_loading(self, spec: str) -> None:
        self.model_status.setText(f"Loading {spec}…")
        self.model_status.setToolTip("")

    def _on_model_load_failed(self, spec: str, _message: str) -> None:
        model = self.controller.model
        self.model_status.setText(f"Could not load {model_name(spec)}" + (
            f"; still using {model.name}" if model is not None else ""))

    def _on_head_available(self, available: bool) -> None:
        """`head` is offered only for a target with a trained head; without one its entry is
        greyed out and says how to train one (a reply with it would only fail)."""
        index = self.drafter_combo.findData("head")
        item = self.drafter_combo.model().item(index)
        item.setEnabled(available)
        item.setToolTip(DRAFTER_HELP["head"] if available else NO_HEAD_HELP)

    def _on_model_loaded(self, info: ModelInfo) -> None:
        if info.spec != self.controller.settings.target:
            self.model_status.setText(f"Draft {info.name} ready")
            return
        self._target_path = Path(info.path) if info.path else None
        note = f"{info.name} · {info.model_type} · {info.backend}"
        if info.template_warning:
            # the banner and the tooltip carry the whole warning: here its six wrapped
            # lines were cut off at the top and bottom of this row
            note += "\nNo chat template"
        self.model_status.setText(note)
        self.model_status.setToolTip(info.template_warning or "")
        self._target_note = (note, info.template_warning or "")
        self._updating = True
        try:
            self._fill_targets(info.spec)
            self._fill_drafts(self.controller.settings.draft)
            self._sync_model_drafter()
        finally:
            self._updating = False


def model_name(spec: str) -> str:
    """A model spec as a label names it: a folder by its name, "demo" or a repo id as is."""
    return Path(spec).name if spec.startswith(("/", "~", ".")) else spec


def _double(lo: float, hi: float, step: float, decimals: int) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(lo, hi)
    box.setSingleStep(step)
    box.setDecimals(decimals)
    return box


def _select(combo: QComboBox, data: object) -> None:
    index = combo.findData(data)
    combo.setCurrentIndex(index if index >= 0 else 0)
