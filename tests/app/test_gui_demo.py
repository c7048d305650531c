"""The app on the real demo model (SmolLM2-135M): real text, every token kind, screenshots.

Screenshots go to tests/artifacts/screenshots/ (gitignored) for a person to look at:
main window mid-reply with speculation shown, clean Markdown mode, comparison panes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication

from app.store import COMPLETE
from app.ui.theme import is_dark
from app.ui.token_render import KIND_STYLES
from app.ui.worker import ChatSettings
from engine.events import Step, TokenKind
from tests.app.test_gui import fragments, kind_of

TIMEOUT = 300_000
PROMPT = ("Here is code:\n```python\ndef add(a, b):\n    return a + b\n```\n"
          "Rewrite the function add with type hints and a docstring.")


@pytest.mark.slow
def test_demo_model_reply_kinds_markdown_and_comparison(qtbot, make_gui, demo_model_dir: Path,
                                                        screenshots_dir: Path) -> None:
    settings = ChatSettings(target=str(demo_model_dir), drafter="ngram", k=4, max_tokens=80)
    gui = make_gui(settings)
    window = gui.window
    qtbot.waitUntil(lambda: gui.controller.model is not None, timeout=TIMEOUT)
    assert window.model_label.text().startswith(gui.controller.model.name)

    produced: set[TokenKind] = set()

    def record(_m, step: Step, _s) -> None:
        produced.update(t.kind for t in step.tokens if t.text)

    gui.controller.step_received.connect(record)
    window.composer.set_text(PROMPT)
    window.composer.send_button.click()
    card = window.chat_view.cards[-1]
    qtbot.waitUntil(lambda: len(card.text()) > 90 and gui.controller.generating, timeout=TIMEOUT)
    window.grab().save(str(screenshots_dir / "main_mid_reply.png"))
    qtbot.waitUntil(lambda: not gui.controller.generating, timeout=TIMEOUT)

    [_, reply] = gui.store.messages(gui.controller.conversation_id)
    assert reply.status == COMPLETE and "def add" in reply.content
    # every kind the ngram drafter produced shows in the document with its style
    assert produced == set(TokenKind)
    dark = is_dark(card.palette())
    styled = set()
    for _text, fmt, _pos in fragments(card.document()):
        kind = kind_of(fmt)
        if kind is not None:
            fg, bg = KIND_STYLES[kind].colors(dark)
            assert fmt.background().color().name() == bg if bg else True
            assert fmt.foreground().color().name() == fg if fg else True
            styled.add(kind)
    assert styled == set(TokenKind)
    assert card.footer.text().endswith("tokens/pass")
    window.grab().save(str(screenshots_dir / "main_finished_speculation.png"))

    # clean mode: Markdown with a highlighted code block and a working copy link
    window.speculation_action.trigger()
    assert not window.chat_view.show_speculation
    assert all(kind_of(f) is None for _, f, _ in fragments(card.document()))
    assert card.browser.code_blocks and "def add" in card.browser.code_blocks[0]
    assert "```" not in card.document().toPlainText()
    card.browser.anchorClicked.emit(QUrl("copy-code:0"))
    assert QGuiApplication.clipboard().text() == card.browser.code_blocks[0]
    window.grab().save(str(screenshots_dir / "main_clean_markdown.png"))
    window.speculation_action.trigger()

    # speculative vs plain on the same prompt and seed: identical text
    gui.controller.set_settings(ChatSettings(target=str(demo_model_dir), drafter="ngram", k=4,
                                             max_tokens=48))
    window.compare_action.trigger()
    with qtbot.waitSignal(gui.controller.comparison_finished, timeout=TIMEOUT) as blocker:
        window.comparison_view.replay_button.click()
    qtbot.waitUntil(lambda: not gui.controller.generating, timeout=TIMEOUT)
    result = blocker.args[0]
    assert result.identical and result.plain_text.strip()
    assert "identical output" in window.comparison_view.result_label.text()
    window.grab().save(str(screenshots_dir / "comparison.png"))

    # the system switching to dark: cards, tokens and code follow
    from PySide6.QtGui import QColor, QPalette
    from PySide6.QtWidgets import QApplication

    window.compare_action.trigger()
    dark = QPalette()
    for role, color in ((QPalette.ColorRole.Window, "#1e1e1e"), (QPalette.ColorRole.Base, "#252526"),
                        (QPalette.ColorRole.AlternateBase, "#2d2d30"),
                        (QPalette.ColorRole.Button, "#333337"), (QPalette.ColorRole.Mid, "#555555"),
                        (QPalette.ColorRole.Midlight, "#3c3c3c"),
                        (QPalette.ColorRole.WindowText, "#eeeeee"), (QPalette.ColorRole.Text, "#eeeeee"),
                        (QPalette.ColorRole.ButtonText, "#eeeeee"),
                        (QPalette.ColorRole.PlaceholderText, "#9a9a9a")):
        dark.setColor(role, QColor(color))
    light = QApplication.palette()
    QApplication.setPalette(dark)
    try:
        window.grab().save(str(screenshots_dir / "main_dark.png"))
    finally:
        QApplication.setPalette(light)
    for name in ("main_mid_reply", "main_clean_markdown", "comparison", "main_dark"):
        assert (screenshots_dir / f"{name}.png").stat().st_size > 10_000
