"""Draft trees in the app: the setting, ghosts at their position naming their branch, a
step that fell back to a plain step, and their storage.

The live tests run the real window on the engine thread: the draft model's trees (its
runner-ups as sibling leaves) give ghosts, and the draft model patched to return a
malformed tree gives fallback steps (the issue's bad-input case).
"""

from __future__ import annotations

import logging

from PySide6.QtWidgets import QApplication

from app.store import step_from_json, step_to_json
from app.ui.chat_view import TokenBrowser
from app.ui.token_render import shown_text, step_warning_tooltip, token_tooltip
from app.ui.worker import ChatSettings
from engine.drafters.base import Draft
from engine.drafters.model import ModelDrafter
from engine.events import Step, Token, TokenKind
from tests.app.test_gui import fragments, kind_of, wait_idle

# a verified tree (Paris -> {was -> then, is}; France; Lyon) as the engine orders it for
# display: the walk took "Paris" then " is" and the target's " nice"; branches 3 and 4
# left at depth 1 (before "Paris"), branch 1 at depth 2 (before " is")
TREE_STEP = Step((
    Token(4, " France", TokenKind.REJECTED, None, "branch 3 of 4, diverged at depth 1"),
    Token(8, " Lyon", TokenKind.REJECTED, None, "branch 4 of 4, diverged at depth 1"),
    Token(1, " Paris", TokenKind.ACCEPTED, 0.9),
    Token(3, " was", TokenKind.REJECTED, None, "branch 1 of 4, diverged at depth 2"),
    Token(7, " then", TokenKind.REJECTED, None, "branch 1 of 4, diverged at depth 2"),
    Token(2, " is", TokenKind.ACCEPTED, 0.7),
    Token(5, " nice", TokenKind.BONUS, 0.5),
), n_drafted=6, n_accepted=2, k=3, drafter="ngram")
ERROR = ("model: draft tree: node 0 has parent 1, which does not come before it (a parent "
         "after its child, or a cycle); ran a plain step instead")
FALLBACK_STEP = Step((Token(6, " again", TokenKind.TARGET, 0.4),), error=ERROR)
STEPS = [Step((Token(9, "The capital is", TokenKind.TARGET, 0.8),)), TREE_STEP, FALLBACK_STEP,
         Step((Token(10, ",", TokenKind.TARGET, 0.6),)), FALLBACK_STEP]
TEXT = "The capital is Paris is nice again, again"


def test_a_ghost_tooltip_names_its_branch() -> None:
    tip = token_tooltip(TREE_STEP.tokens[0])
    assert tip.startswith("rejected:")
    assert tip.splitlines()[1] == "draft tree branch 3 of 4, diverged at depth 1"
    assert "draft tree" not in token_tooltip(TREE_STEP.tokens[2])  # committed: no branch


def test_ghosts_and_fallbacks_survive_the_store() -> None:
    for step in (TREE_STEP, FALLBACK_STEP):
        assert step_from_json(step_to_json(step)) == step
    # rows saved before trees (four fields, no error) still load
    old = step_from_json('{"t": [[1, "a", "accepted", 0.5]], "d": 1, "a": 1}')
    assert old.tokens[0].branch == "" and old.error == ""


def test_the_chat_view_shows_ghosts_at_their_position(qtbot, screenshots_dir) -> None:
    browser = TokenBrowser(fit_height=False)
    qtbot.addWidget(browser)
    font = browser.font()
    font.setPointSize(15)
    browser.setFont(font)
    browser.resize(560, 60)
    browser.show_reply(STEPS, TEXT, speculation=True, show_rejected=True, dark=False)
    frags = list(fragments(browser.document()))
    shown = [(text, kind_of(fmt)) for text, fmt, _ in frags]
    R, A, T = TokenKind.REJECTED, TokenKind.ACCEPTED, TokenKind.TARGET
    assert shown == [
        ("The capital is", T),
        (" France", R), ("\N{LIGHT VERTICAL BAR}", None), (" Lyon", R),  # two branches
        (" Paris", A), (" was", R), (" then", R), (" is", A), (" nice", TokenKind.BONUS),
        ("\N{WARNING SIGN}", None), (" again", T), (",", T), (" again", T),
    ]
    tips = [fmt.toolTip() for _, fmt, _ in frags]
    assert tips[1].splitlines()[1] == "draft tree branch 3 of 4, diverged at depth 1"
    assert tips[3].splitlines()[1] == "draft tree branch 4 of 4, diverged at depth 1"
    assert tips[5].splitlines()[1] == "draft tree branch 1 of 4, diverged at depth 2"
    assert all(fmt.fontStrikeOut() == (kind is R) for (_, kind), (_, fmt, _) in
               zip(shown, frags, strict=True) if kind is not None)
    # a fallback step: underlined, its reason in the tooltip; the marker only where the
    # reason first appears in the reply
    assert tips[9] == step_warning_tooltip(ERROR)
    for i in (10, 12):
        assert frags[i][1].fontUnderline() and tips[i].endswith(ERROR)
    assert not frags[11][1].fontUnderline()
    browser.show()
    QApplication.processEvents()
    browser.grab().save(str(screenshots_dir / "tree_ghosts.png"))
    # hidden guesses hide a tree's ghosts too (the marker stays: it is not a guess)
    browser.show_reply(STEPS, TEXT, speculation=True, show_rejected=False, dark=False)
    assert browser.document().toPlainText() == TEXT.replace(" again", "\N{WARNING SIGN} again", 1)
    # clean Markdown: the reply's text only
    browser.show_reply(STEPS, TEXT, speculation=False, show_rejected=True, dark=False)
    assert browser.document().toPlainText().strip() == TEXT


def shows(text: str) -> bool:
    """Whether a piece of text leaves a visible character in the document."""
    return any(c.isprintable() and not c.isspace() for c in text)


def expected_tips(steps: list[Step]) -> list[str]:
    """The tooltips the speculation view must show, in the steps' display order."""
    out: list[str] = []
    marked: set[str] = set()
    for step in steps:
        if step.error and step.error not in marked:
            marked.add(step.error)
            out.append(step_warning_tooltip(step.error))
        previous = None
        for t in step.tokens:
            ghost = t.kind is TokenKind.REJECTED
            if ghost and previous is not None and previous.kind is TokenKind.REJECTED \
                    and previous.branch != t.branch:
                out.append("")  # the bar between two branches' ghosts
            if shows(shown_text(t)):
                out.append(token_tooltip(t, step.error))
            previous = t
    return out


def document_tips(doc) -> list[str]:
    return [fmt.toolTip() for text, fmt, _ in fragments(doc) if shows(text)]


def collapse(tips: list[str]) -> list[str]:
    """Neighbouring fragments with one format may merge: compare runs, not fragments."""
    return [t for i, t in enumerate(tips) if i == 0 or tips[i - 1] != t]


def test_live_tree_ghosts_stand_after_the_token_they_hang_from(qtbot, make_gui, tiny_pair,
                                                                screenshots_dir) -> None:
    target, draft = tiny_pair
    gui = make_gui(ChatSettings(target=str(target), draft=str(draft), drafter="model", k=4,
                                max_tokens=24))
    wait_idle(qtbot, gui)
    steps: list[Step] = []
    gui.controller.step_received.connect(lambda _m, step, _s: steps.append(step))
    gui.controller.send("What is the capital of France?")
    wait_idle(qtbot, gui)
    card = gui.window.chat_view.cards[-1]
    tips = collapse(document_tips(card.document()))
    assert tips == collapse(expected_tips(steps))  # the document is the engine's order
    # a runner-up beside an accepted first draft: its ghost stands before that token (it
    # hangs from the previous step's last token), not after the step's committed tokens
    def next_committed(i: int) -> str:
        return next(tip for tip in tips[i + 1:] if tip and not tip.startswith("rejected:"))

    early = [i for i, tip in enumerate(tips) if tip.startswith("rejected:")
             and tip.splitlines()[1].endswith("diverged at depth 1")]
    assert any(next_committed(i).startswith("accepted:") for i in early), tips
    for step in steps:
        seen = 0
        for t in step.tokens:  # in every step: each ghost after the tokens above its fork
            if t.kind is TokenKind.REJECTED and t.branch:
                assert seen == int(t.branch.rsplit(" ", 1)[1]) - 1, step
            seen += t.kind.committed
    # the gauge's tokens/pass counts committed tokens only, never a ghost
    committed = sum(len(s.committed) for s in steps)
    assert gui.window.gauge.tokens_label.text() == str(committed)
    assert gui.window.gauge.tau_label.text() == f"{committed / len(steps):.2f}"
    assert sum(len(s.tokens) for s in steps) > committed
    gui.window.resize(1100, 640)
    QApplication.processEvents()
    gui.window.grab().save(str(screenshots_dir / "tree_ghosts_window.png"))
    # clean Markdown hides every ghost
    gui.window.chat_view.set_show_speculation(False)
    assert not any(kind_of(f) is TokenKind.REJECTED for _, f, _ in fragments(card.document()))
    assert card.document().toPlainText().strip() == card.message.content.strip()
    gui.window.chat_view.set_show_speculation(True)
    gui.close()
    # reopened from the history file: the same rendering, ghosts where they were
    again = make_gui(ChatSettings(target=str(target)))
    assert collapse(document_tips(again.window.chat_view.cards[-1].document())) == tips


def test_a_fallback_step_is_marked_and_said_once(qtbot, make_gui, tiny_pair, monkeypatch,
                                                 caplog, screenshots_dir) -> None:
    def malformed(self, context, k, extra, **_) -> Draft:
        return Draft((1, 2), None, (1, -1))  # node 0's parent comes after it

    monkeypatch.setattr(ModelDrafter, "propose_tree", malformed)
    target, draft = tiny_pair
    gui = make_gui(ChatSettings(target=str(target), draft=str(draft), drafter="model", k=4,
                                max_tokens=12))
    wait_idle(qtbot, gui)
    steps: list[Step] = []
    gui.controller.step_received.connect(lambda _m, step, _s: steps.append(step))
    caplog.set_level(logging.WARNING, logger="understudy.steps")
    gui.controller.send("def add(a, b):")
    wait_idle(qtbot, gui)
    fell_back = [s for s in steps if s.error]
    assert len(fell_back) >= 2 and {s.error for s in fell_back} == {ERROR}
    assert all(s.drafter == "none" and not s.n_drafted for s in fell_back)
    card = gui.window.chat_view.cards[-1]
    marks = [f.toolTip() for text, f, _ in fragments(card.document())
             if text == "\N{WARNING SIGN}"]
    assert marks == [step_warning_tooltip(ERROR)]  # one marker per reason, not per step
    underlined = {f.toolTip() for text, f, _ in fragments(card.document()) if f.fontUnderline()}
    assert underlined and underlined == {token_tooltip(t, ERROR) for s in fell_back
                                         for t in s.tokens if shows(shown_text(t))}
    assert collapse(document_tips(card.document())) == collapse(expected_tips(steps))
    # the status bar says it once, with a count; the log has it once, not once per step
    line = gui.window.step_warnings
    assert line.isVisible()
    assert line.text() == f"\N{WARNING SIGN} {len(fell_back)} steps ran without drafts: {ERROR}"
    assert f"{len(fell_back)}× {ERROR}" in line.toolTip()
    logged = [r.getMessage() for r in caplog.records if r.name == "understudy.steps"]
    assert logged == [f"a step fell back to a plain step: {ERROR}"]
    gui.window.resize(1100, 640)
    QApplication.processEvents()
    gui.window.grab().save(str(screenshots_dir / "step_fallback_window.png"))
    # the marker stays with the reply when the chat is reopened; a new reply starts afresh
    gui.controller.set_settings(ChatSettings(target=str(target), drafter="off",
                                             max_tokens=4))
    gui.controller.send("hello")
    wait_idle(qtbot, gui)
    assert not line.isVisible() and not line.counts
    gui.close()
    again = make_gui(ChatSettings(target=str(target)))
    reopened = again.window.chat_view.cards[1].document()
    assert [f.toolTip() for text, f, _ in fragments(reopened)
            if text == "\N{WARNING SIGN}"] == marks


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
