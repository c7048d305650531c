"""Speculative vs plain: the same prompt and seed decoded both ways, side by side.

The controller races the two on the engine worker: they take turns of half a second, so
both texts arrive at once, each at its own pace (the speculative run is also the chat's
reply). This view shows each in its own pane with its own gauge (styled by token fate, or
clean Markdown, as the chat view's "Show speculation" says), then the measured speedup and whether the two texts are identical (with the coupled acceptance rule they
must be).
"""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.ui.chat_view import TokenBrowser
from app.ui.controller import ChatController, ComparisonResult
from app.ui.gauge import GaugeWidget
from app.ui.theme import widget_is_dark
from app.ui.token_render import markdown_refresh_ms
from engine.events import Stats, Step

REPLAY_TIP = "Run this chat's last message again, with and without speculation"
NO_PROMPT_TIP = "Nothing to replay yet: send a message in this chat first"
BUSY_TIP = "Available when the reply in progress finishes"


class ComparisonPane(QFrame):
    """One run: its title, its token-styled text, its own gauge."""

    def __init__(self, title: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("comparisonPane")
        self.steps: list[Step] = []
        self._texts: list[str] = []  # each step's text (joined, not taken again per refresh)
        self.show_speculation = True  # follows the chat view's "Show speculation"
        self.show_rejected = True
        self.show_marks = False  # follows View ▸ Mark Token Kinds by Shape
        self.title = QLabel(title)
        self.title.setObjectName("paneTitle")
        self.browser = TokenBrowser(fit_height=False)
        self.gauge = GaugeWidget("")
        self.gauge.title.hide()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.addWidget(self.title)
        layout.addWidget(self.browser, 1)
        layout.addWidget(self.gauge)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(0)
        self._timer.timeout.connect(self.render)

    def reset(self, title: str) -> None:
        self.title.setText(title)
        self.steps = []
        self._texts = []
        self.gauge.reset()
        self.browser.clear()

    def add_step(self, step: Step, stats: Stats) -> None:
        self.steps.append(step)
        self._texts.append(step.text)
        self.gauge.show_stats(stats)
        if not self._timer.isActive():  # (a refresh on its way is not put off)
            self._timer.start(0 if self.show_speculation
                              else markdown_refresh_ms(sum(map(len, self._texts))))

    def render(self) -> None:
        self.browser.show_reply(self.steps, self.text(), speculation=self.show_speculation,
                                show_rejected=self.show_rejected, dark=widget_is_dark(self),
                                marks=self.show_marks)
        bar = self.browser.verticalScrollBar()
        bar.setValue(bar.maximum())

    def text(self) -> str:
        return "".join(self._texts)


class ComparisonView(QWidget):
    def __init__(self, controller: ChatController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.active = False
        self.result: ComparisonResult | None = None
        self.speculative = ComparisonPane("Speculative")
        self.plain = ComparisonPane("Plain decoding")
        self.result_label = QLabel("Send a message, or replay the last prompt, to race "
                                   "speculative decoding against plain decoding.")
        self.result_label.setObjectName("comparisonResult")
        self.result_label.setWordWrap(True)
        self.replay_button = QPushButton("Replay last prompt")
        self.replay_button.clicked.connect(controller.replay_comparison)
        self._update_replay()

        panes = QSplitter(Qt.Orientation.Horizontal)
        panes.addWidget(self.speculative)
        panes.addWidget(self.plain)
        panes.setChildrenCollapsible(False)
        top = QHBoxLayout()
        top.setContentsMargins(12, 8, 12, 0)
        top.addWidget(self.result_label, 1)
        top.addWidget(self.replay_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(top)
        layout.addWidget(panes, 1)

        controller.comparison_started.connect(self._on_comparison_started)
        controller.prompt_progressed.connect(self._on_prompt_progressed)
        controller.plain_prompt_progressed.connect(self._on_plain_prompt_progressed)
        controller.step_received.connect(self._on_step_received)
        controller.plain_step_received.connect(self._on_plain_step_received)
        controller.comparison_finished.connect(self._on_comparison_finished)
        controller.generating_changed.connect(self._on_generating_changed)
        for signal in (controller.conversation_opened, controller.message_added):
            signal.connect(lambda *_: self._update_replay())

    def _update_replay(self) -> None:
        """Replay is offered only when it can run: a prompt to replay, nothing generating."""
        if self.controller.generating:
            enabled, tip = False, BUSY_TIP
        elif self.controller.last_prompt() is None:
            enabled, tip = False, NO_PROMPT_TIP
        else:
            enabled, tip = True, REPLAY_TIP
        self.replay_button.setEnabled(enabled)
        self.replay_button.setToolTip(tip)

    def set_show_speculation(self, on: bool) -> None:
        """Tokens styled by fate, or clean Markdown, as in the chat view."""
        for pane in (self.speculative, self.plain):
            pane.show_speculation = on
            pane.render()

    def set_show_rejected(self, on: bool) -> None:
        for pane in (self.speculative, self.plain):
            pane.show_rejected = on
            pane.render()

    def set_show_marks(self, on: bool) -> None:
        """Token kinds marked by shape too, as in the chat view."""
        for pane in (self.speculative, self.plain):
            pane.show_marks = on
            pane.render()

    def _on_comparison_started(self, spec_label: str, plain_label: str) -> None:
        self.active = True
        self.result = None
        self.speculative.reset(spec_label)
        self.plain.reset(plain_label)
        self.result_label.setText("Racing speculative against plain decoding with the same "
                                  "seed; they take turns on the engine, so each gauge shows "
                                  "its own pace…")

    def _on_prompt_progressed(self, done: int, total: int) -> None:
        if self.active:
            self.speculative.gauge.show_prompt_progress(done, total)

    def _on_plain_prompt_progressed(self, done: int, total: int) -> None:
        if self.active:
            self.plain.gauge.show_prompt_progress(done, total)

    def _on_step_received(self, _message_id: int, step: Step, stats: Stats) -> None:
        if self.active:
            self.speculative.add_step(step, stats)

    def _on_plain_step_received(self, step: Step, stats: Stats) -> None:
        if self.active:
            self.plain.add_step(step, stats)

    def _on_comparison_finished(self, result: ComparisonResult) -> None:
        self.result = result
        self.speculative.render()
        self.plain.render()
        self.speculative.gauge.show_final(result.speculative)
        self.plain.gauge.show_final(result.plain)
        check = ("✓ identical output" if result.identical
                 else "✗ outputs differ (expected only with the rejection rule)")
        if result.speedup >= 1.0:
            verdict = f"<b>{result.speedup:.2f}× faster</b> with speculation"
        else:
            verdict = f"<b>{result.speedup:.2f}×</b>: speculation was slower on this prompt"
        self.result_label.setText(
            f"{verdict} · {result.speculative.decode_tps:.1f} vs "
            f"{result.plain.decode_tps:.1f} tok/s · {check}")

    def _on_generating_changed(self, generating: bool) -> None:
        self._update_replay()
        if not generating:
            self.active = False
            if self.result is None and self.speculative.steps:
                self.result_label.setText("Stopped before both runs finished.")
