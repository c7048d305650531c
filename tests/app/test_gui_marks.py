"""View ▸ Mark Token Kinds by Shape: token kinds told apart without colour (deuteranopia
cannot tell accepted's green from corrected's amber), in the cards, the legend and the
comparison panes, remembered across a restart."""

from __future__ import annotations

from PySide6.QtGui import QTextDocument
from PySide6.QtWidgets import QApplication

from app.store import COMPLETE
from app.ui.theme import apply_theme, is_dark
from app.ui.token_render import KIND_STYLES, LEGEND_ORDER
from engine.events import Stats, Step, Token, TokenKind
from tests.app.test_gui import fragments, kind_of, plain_settings
from tests.app.test_gui_keyboard import dark_palette

A, C, B, R, T = (TokenKind.ACCEPTED, TokenKind.REPLACED, TokenKind.BONUS, TokenKind.REJECTED,
                 TokenKind.TARGET)
FALLBACK = "model: draft tree: node 0 has parent 1; ran a plain step instead"
STEPS = [
    Step((Token(1, "Speculative", T, 0.9),)),
    Step((Token(2, " decoding", A, 0.8), Token(3, " lets", A, 0.7), Token(4, " makes", R, 0.1),
          Token(5, " has", C, 0.6)), n_drafted=3, n_accepted=2, k=3, drafter="ngram"),
    Step((Token(6, " a", A, 0.9), Token(7, " small", A, 0.9), Token(8, " model", B, 0.5)),
         n_drafted=2, n_accepted=2, k=2, drafter="ngram"),
    Step((Token(9, " draft", A, 0.9), Token(10, " guesses", R, 0.2), Token(11, " tokens", C, 0.4)),
         n_drafted=2, n_accepted=1, k=2, drafter="ngram"),
    Step((Token(12, " that", T, 0.7),), error=FALLBACK),  # underlined amber: not a mark
    Step((Token(13, " the", A, 0.9), Token(14, " target", A, 0.9), Token(15, " checks", B, 0.6)),
         n_drafted=2, n_accepted=2, k=2, drafter="ngram"),
    Step((Token(16, " in", A, 0.9), Token(17, " one", R, 0.3), Token(18, " a", C, 0.5),
          Token(19, " single", T, 0.8), Token(20, " pass.", T, 0.9)),
         n_drafted=2, n_accepted=1, k=2, drafter="ngram"),
]
TEXT = "".join(s.text for s in STEPS)
MARKED = {C: (True, False, False), B: (False, True, False), R: (False, False, True),
          A: (False, False, False)}  # (underline, overline, strike-out) with marks on


def seed_reply(gui) -> None:
    store = gui.store
    cid = store.create_conversation("Marks").id
    store.add_message(cid, "user", "How does speculative decoding work?")
    reply = store.begin_reply(cid, model="tiny", settings={})
    for step in STEPS:
        store.append_step(reply.id, step)
    store.finish_reply(reply.id, status=COMPLETE, text=TEXT)
    gui.controller.open_conversation(cid)


def lines_by_kind(doc: QTextDocument) -> dict[TokenKind, set[tuple[bool, bool, bool]]]:
    """Each drafted kind's (underline, overline, strike-out) as the document holds them."""
    out: dict[TokenKind, set[tuple[bool, bool, bool]]] = {}
    for _text, fmt, _pos in fragments(doc):
        kind = kind_of(fmt)
        if kind is not None and kind is not T:  # (a fallback step's target is underlined)
            out.setdefault(kind, set()).add(
                (fmt.fontUnderline(), fmt.fontOverline(), fmt.fontStrikeOut()))
    return out


def expected(marks: bool) -> dict[TokenKind, set[tuple[bool, bool, bool]]]:
    return {k: {v if marks or k is R else (False, False, False)} for k, v in MARKED.items()}


def legend_lines(gui) -> dict[str, tuple[bool, bool, bool]]:
    doc = QTextDocument()
    doc.setHtml(gui.window.chat_view.legend.label.text())
    return {text.strip(): (f.fontUnderline(), f.fontOverline(), f.fontStrikeOut())
            for text, f, _ in fragments(doc) if text.strip()}


def legend_expected(marks: bool) -> dict[str, tuple[bool, bool, bool]]:
    lines = {k: v if marks or k is R else (False, False, False) for k, v in MARKED.items()}
    return {KIND_STYLES[k].label: lines.get(k, (False, False, False)) for k in LEGEND_ORDER}


def test_marks_toggle_rerenders_cards_legend_and_panes_and_persist(
        qtbot, make_gui, tiny_pair, screenshots_dir) -> None:
    gui = make_gui(plain_settings(tiny_pair[0]))
    window = gui.window
    window.resize(1280, 460)
    seed_reply(gui)
    card = window.chat_view.cards[-1]
    pane = window.comparison_view.speculative
    for step in STEPS:
        pane.add_step(step, Stats())
    pane.render()
    view_menu = next(m.menu() for m in window.menuBar().actions() if m.text() == "&View")
    assert window.marks_action in view_menu.actions()

    # off by default: colour alone, as before
    assert not window.marks_action.isChecked()
    assert lines_by_kind(card.document()) == expected(False)
    assert legend_lines(gui) == legend_expected(False)
    assert lines_by_kind(pane.browser.document()) == expected(False)
    shown = card.document().toPlainText()

    window.marks_action.trigger()
    assert window.chat_view.show_marks
    assert lines_by_kind(card.document()) == expected(True)  # the shown reply re-rendered
    assert legend_lines(gui) == legend_expected(True)
    assert lines_by_kind(pane.browser.document()) == expected(True)
    assert card.document().toPlainText() == shown  # the same text, ghosts where they were
    qtbot.waitUntil(lambda: card.isVisible() and card.height() > 40, timeout=5_000)
    window.chat_view.grab().save(str(screenshots_dir / "marks_light.png"))

    app = QApplication.instance()
    before = app.palette()
    app.setPalette(dark_palette())
    apply_theme(app)
    try:
        qtbot.waitUntil(lambda: is_dark(card.palette()), timeout=5_000)
        dark_bg = KIND_STYLES[C].dark_bg
        corrected = [f for _, f, _ in fragments(card.document()) if kind_of(f) is C]
        assert corrected and all(f.background().color().name() == dark_bg for f in corrected)
        assert lines_by_kind(card.document()) == expected(True)  # dark keeps the marks
        assert legend_lines(gui) == legend_expected(True)
        window.chat_view.grab().save(str(screenshots_dir / "marks_dark.png"))
    finally:
        app.setPalette(before)
        apply_theme(app)

    gui.close()  # saves the view's settings
    again = make_gui(plain_settings(tiny_pair[0]))
    assert again.window.marks_action.isChecked() and again.window.chat_view.show_marks
    assert lines_by_kind(again.window.chat_view.cards[-1].document()) == expected(True)
    assert legend_lines(again) == legend_expected(True)
    again.window.marks_action.trigger()  # and off again
    assert lines_by_kind(again.window.chat_view.cards[-1].document()) == expected(False)
    assert legend_lines(again) == legend_expected(False)


def test_the_legend_follows_the_views_palette_at_once(qtbot, make_gui, tiny_pair) -> None:
    """The view hears of a palette change before its children do (a desktop's switch to
    dark reaches the widgets in no set order): the legend, reading its own palette, kept
    the light chips on a dark window while the replies went dark."""
    gui = make_gui(plain_settings(tiny_pair[0]))
    view = gui.window.chat_view
    view.setPalette(dark_palette())  # the view first, then its children
    doc = QTextDocument()
    doc.setHtml(view.legend.label.text())
    chips = {text.strip(): f.background().color().name()
             for text, f, _ in fragments(doc) if text.strip()}
    assert chips[KIND_STYLES[A].label] == KIND_STYLES[A].dark_bg
    assert chips[KIND_STYLES[C].label] == KIND_STYLES[C].dark_bg
