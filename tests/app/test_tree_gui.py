"""Draft trees in the app: the setting, ghosts that name their branch, and their storage."""

from __future__ import annotations

from PySide6.QtWidgets import QApplication

from app.store import step_from_json, step_to_json
from app.ui.chat_view import TokenBrowser
from app.ui.token_render import token_tooltip
from app.ui.worker import ChatSettings
from engine.events import Step, Token, TokenKind
from tests.app.test_gui import fragments, kind_of, wait_idle

# a verified tree: "Paris" accepted, " is" accepted on the second branch; the first
# branch's " was" and the third branch's " France" lost; then a bonus token
TREE_STEP = Step((
    Token(1, "Paris", TokenKind.ACCEPTED, 0.9),
    Token(2, " is", TokenKind.ACCEPTED, 0.7),
    Token(3, " was", TokenKind.REJECTED, 0.2, "main branch"),
    Token(4, " France", TokenKind.REJECTED, 0.01, "branch 3 (forks at depth 1)"),
    Token(5, " nice", TokenKind.BONUS, 0.5),
), n_drafted=4, n_accepted=2, k=2, drafter="ngram")


def test_a_ghost_tooltip_names_its_branch() -> None:
    tip = token_tooltip(TREE_STEP.tokens[3])
    assert tip.startswith("rejected:")
    assert tip.endswith("from the draft tree's branch 3 (forks at depth 1)")
    assert "draft tree" not in token_tooltip(TREE_STEP.tokens[0])  # a chain token: no branch


def test_ghost_branches_survive_the_store() -> None:
    again = step_from_json(step_to_json(TREE_STEP))
    assert again == TREE_STEP
    # rows saved before trees (four fields) still load
    old = '{"t": [[1, "a", "accepted", 0.5]], "d": 1, "a": 1}'
    assert step_from_json(old).tokens[0].branch == ""


def test_the_chat_view_shows_ghosts_with_their_branch(qtbot, screenshots_dir) -> None:
    browser = TokenBrowser(fit_height=False)
    qtbot.addWidget(browser)
    browser.resize(420, 80)
    browser.show_reply([TREE_STEP], "Paris is nice", speculation=True, show_rejected=True,
                       dark=False)
    ghosts = [(text, fmt) for text, fmt, _ in fragments(browser.document())
              if kind_of(fmt) is TokenKind.REJECTED]
    assert [t for t, _ in ghosts] == [" was", " France"]
    assert ghosts[1][1].toolTip().endswith("branch 3 (forks at depth 1)")
    assert all(f.fontStrikeOut() for _, f in ghosts)
    browser.show()
    QApplication.processEvents()
    browser.grab().save(str(screenshots_dir / "tree_ghosts.png"))
    # hidden guesses hide a tree's ghosts too
    browser.show_reply([TREE_STEP], "Paris is nice", speculation=True, show_rejected=False,
                       dark=False)
    assert browser.document().toPlainText() == "Paris is nice"


def test_the_tree_setting_reaches_the_engine_options(qtbot, make_gui, tiny_pair) -> None:
    target, _ = tiny_pair
    gui = make_gui(ChatSettings(target=str(target), drafter="ngram", max_tokens=8))
    wait_idle(qtbot, gui)
    panel = gui.window.settings_panel
    assert panel.tree_combo.currentData() == "auto" and panel.tree_combo.isEnabled()
    panel.tree_combo.setCurrentIndex(panel.tree_combo.findData("off"))
    assert gui.controller.settings.tree == "off"
    assert gui.controller.settings.to_options().tree == "off"
    # the rejection rule verifies chains only: the setting has no say there
    panel.accept_combo.setCurrentIndex(panel.accept_combo.findData("rejection"))
    assert not panel.tree_combo.isEnabled()
    panel.drafter_combo.setCurrentIndex(panel.drafter_combo.findData("off"))
    assert not panel.tree_combo.isEnabled()
    assert ChatSettings.from_dict({"tree": "off"}).tree == "off"
    assert ChatSettings.from_dict({}).tree == "auto"  # settings saved before trees
