"""Token styling, clean Markdown, footers and export: pure functions, checked as Qt reads them."""

from __future__ import annotations

import pytest
from PySide6.QtGui import QTextDocument

from app.store import Message
from app.ui.gauge import RateTracker
from app.ui.token_render import (
    KIND_STYLES,
    footer_text,
    kind_css,
    markdown_html,
    token_tooltip,
    tokens_html,
    user_message_html,
    wrap_pre,
)
from engine.events import Stats, Step, Token, TokenKind

STEPS = (
    Step((Token(1, "def", TokenKind.TARGET, 0.5),)),
    Step((Token(2, " add", TokenKind.ACCEPTED, 0.91), Token(3, "(x", TokenKind.REJECTED, 0.02),
          Token(4, "(a", TokenKind.REPLACED, 0.77)), n_drafted=2, n_accepted=1, k=2,
         drafter="ngram"),
    Step((Token(5, ",", TokenKind.ACCEPTED, 0.99), Token(6, " b", TokenKind.BONUS, 0.88)),
         n_drafted=1, n_accepted=1, k=1, drafter="ngram"),
    Step((Token(7, "):\n    <&>", TokenKind.TARGET, 0.4),)),
)


def doc_of(html: str) -> QTextDocument:
    doc = QTextDocument()
    doc.setHtml(html)
    return doc


def formats_by_text(doc: QTextDocument) -> dict[str, object]:
    out = {}
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            out[frag.text()] = frag.charFormat()
            it += 1
        block = block.next()
    return out


@pytest.mark.parametrize("dark", [False, True])
def test_every_kind_gets_its_style_and_tooltip(qapp, dark: bool) -> None:
    doc = doc_of(wrap_pre(tokens_html(STEPS, dark=dark)))
    assert doc.toPlainText() == "def add(x(a, b):\n    <&>"  # raw text, spaces and newline kept
    fmts = formats_by_text(doc)
    expect = {" add": TokenKind.ACCEPTED, "(x": TokenKind.REJECTED, "(a": TokenKind.REPLACED,
              " b": TokenKind.BONUS, "def": TokenKind.TARGET}
    for text, kind in expect.items():
        fmt = fmts[text]
        fg, bg = KIND_STYLES[kind].colors(dark)
        if fg:
            assert fmt.foreground().color().name() == fg
        if bg:
            assert fmt.background().color().name() == bg
        assert fmt.fontStrikeOut() == (kind is TokenKind.REJECTED)
        assert fmt.toolTip().startswith(KIND_STYLES[kind].label + ":")
    assert "77.0%" in fmts["(a"].toolTip()


def test_hiding_rejected_leaves_exactly_the_committed_text(qapp) -> None:
    doc = doc_of(wrap_pre(tokens_html(STEPS, show_rejected=False)))
    assert doc.toPlainText() == "".join(s.text for s in STEPS)


def test_a_rejected_piece_of_a_character_never_shows_a_replacement_mark(qapp) -> None:
    """A byte-level draft token that is one byte of 你 decodes alone to U+FFFD; as a ghost
    it showed that mark in the reply. It shows as a stray byte's square instead."""
    steps = [Step((Token(1, "你", TokenKind.ACCEPTED, 0.9),
                   Token(2, "\ufffd", TokenKind.REJECTED, 0.4),
                   Token(3, "好", TokenKind.REPLACED, 0.8)),
                  n_drafted=2, n_accepted=1, k=2, drafter="model"),
             Step((Token(4, " \ufffd", TokenKind.ACCEPTED, 0.3),
                   Token(5, "\ufffd", TokenKind.REJECTED, 0.3),
                   Token(6, "!", TokenKind.REPLACED, 0.9)),
                  n_drafted=2, n_accepted=1, k=2, drafter="model")]
    shown = doc_of(wrap_pre(tokens_html(steps))).toPlainText()
    assert shown == "你\N{WHITE SQUARE}好 \ufffd\N{WHITE SQUARE}!"  # committed text as is
    assert doc_of(wrap_pre(tokens_html(steps, show_rejected=False))).toPlainText() == (
        "你好 \ufffd!")


@pytest.mark.parametrize("dark", [False, True])
def test_marks_add_a_shape_to_corrected_and_bonus_only(dark: bool) -> None:
    """Colour-blind readers (green vs amber) tell corrected from accepted by an underline,
    bonus by an overline; a ghost keeps its strike-through and nothing else changes."""
    colours = {kind: kind_css(kind, dark) for kind in TokenKind}
    fg, bg = KIND_STYLES[TokenKind.REPLACED].colors(dark)
    assert colours[TokenKind.REPLACED] == f"color:{fg};background-color:{bg}"  # colour only
    assert colours[TokenKind.REJECTED].endswith(";text-decoration:line-through")
    assert colours[TokenKind.TARGET] == ""
    assert not any("underline" in c or "overline" in c for c in colours.values())
    marked = {kind: kind_css(kind, dark, marks=True) for kind in TokenKind}
    assert marked[TokenKind.REPLACED] == colours[TokenKind.REPLACED] + ";text-decoration:underline"
    assert marked[TokenKind.BONUS] == colours[TokenKind.BONUS] + ";text-decoration:overline"
    for kind in (TokenKind.ACCEPTED, TokenKind.REJECTED, TokenKind.TARGET):
        assert marked[kind] == colours[kind]


@pytest.mark.parametrize("marks", [False, True])
def test_marks_show_in_the_document_as_qt_reads_it(qapp, marks: bool) -> None:
    fmts = formats_by_text(doc_of(wrap_pre(tokens_html(STEPS, marks=marks))))
    decorations = {text: (f.fontUnderline(), f.fontOverline(), f.fontStrikeOut())
                   for text, f in fmts.items()}
    assert decorations["(a"] == (marks, False, False)  # corrected: underlined
    assert decorations[" b"] == (False, marks, False)  # bonus: overlined
    assert decorations["(x"] == (False, False, True)  # rejected: struck through either way
    for text in ("def", " add", ","):  # target and accepted: no line
        assert decorations[text] == (False, False, False)
    assert fmts["(a"].background().color().name() == KIND_STYLES[TokenKind.REPLACED].light_bg


def test_tooltip_names_kind_and_probability() -> None:
    tip = token_tooltip(Token(9, " x", TokenKind.BONUS, 0.125))
    assert tip.splitlines()[0].startswith("bonus: ")
    assert tip.endswith("target probability 12.5%")
    assert token_tooltip(Token(9, "y", TokenKind.TARGET, None)).endswith("n/a")


def test_markdown_highlights_code_and_collects_blocks(qapp) -> None:
    text = "Here:\n\n```python\ndef f(x):\n    return x  # done\n```\n\nUse `f` **twice**."
    rendered = markdown_html(text)
    assert rendered.code_blocks == ["def f(x):\n    return x  # done\n"]
    assert 'href="copy-code:0"' in rendered.html
    doc = doc_of(rendered.html)
    plain = doc.toPlainText()
    assert "def f(x):\n    return x  # done" in plain and "Use f twice." in plain
    fmts = formats_by_text(doc)
    assert fmts["def"].foreground().color().name() != fmts["f"].foreground().color().name() or \
        fmts["def"].fontWeight() != fmts["f"].fontWeight()  # keyword styled unlike a name
    assert fmts["twice"].fontWeight() > fmts["Use "].fontWeight()


def test_markdown_open_fence_while_streaming(qapp) -> None:
    rendered = markdown_html("Start:\n```py\nprint(1")
    assert rendered.code_blocks == ["print(1"]
    assert "print" in doc_of(rendered.html).toPlainText()


def is_mono(fmt) -> bool:
    return any("Mono" in f or f == "monospace" for f in fmt.fontFamilies() or [])


LONG_LINE = "    print(os.path.join(dirpath, name), 'a long string that goes on past the edge')"


def test_a_long_code_line_wraps_at_the_width_keeping_its_indentation(qapp) -> None:
    """QTextBrowser cannot scroll one block sideways, and a card is as tall as its text:
    a code line wider than the card wraps instead of being cut off at its edge."""
    rendered = markdown_html(f"```python\ndef f():\n{LONG_LINE}\n```")
    doc = doc_of(rendered.html)
    doc.setTextWidth(260)
    assert doc.size().width() <= 260
    assert f"def f():\n{LONG_LINE}" in doc.toPlainText()  # the spaces are the code's
    assert rendered.code_blocks == [f"def f():\n{LONG_LINE}\n"]


def code_steps(text: str) -> tuple[Step, ...]:
    """One token per line break or run of non-breaks, as a tokenizer splits them."""
    import re

    return tuple(Step((Token(i, piece, TokenKind.ACCEPTED, 0.9),))
                 for i, piece in enumerate(re.findall(r"\n|[^\n]+", text)))


def test_speculation_shows_fenced_code_in_monospace_keeping_colours(qapp) -> None:
    text = "Here:\n```python\nx = 1\n```\nDone.\n~~~\n```\ny\n~~~\nEnd"
    ghost = Step((Token(90, "z", TokenKind.REJECTED, 0.1),))
    steps = code_steps(text)
    steps = steps[:5] + (ghost,) + steps[5:]  # a ghost inside the block, after "x = 1"
    doc = doc_of(wrap_pre(tokens_html(steps)))
    shown = doc.toPlainText().replace("z", "")
    assert shown.count("  Copy\n") == 2  # each opening fence's line ends with a Copy link
    assert shown.replace("  Copy", "") == text
    fmts = formats_by_text(doc)
    assert not is_mono(fmts["Here:"]) and not is_mono(fmts["Done."]) and not is_mono(fmts["End"])
    for code in ("```python", "x = 1", "z", "```", "y", "~~~"):
        found = [f for t, f in fmts.items() if t.startswith(code)]
        assert found and is_mono(found[0]), code
    assert fmts["x = 1"].background().color().name() == KIND_STYLES[TokenKind.ACCEPTED].light_bg
    assert fmts["z"].fontStrikeOut()


def test_a_users_fenced_code_is_a_code_block_and_the_rest_stays_as_typed(qapp) -> None:
    text = f"Here is *my* code:\n```python\nimport os\n{LONG_LINE}\n```\nAdd type hints.\n  Thanks"
    rendered = user_message_html(text)
    assert rendered.code_blocks == [f"import os\n{LONG_LINE}\n"]
    assert 'href="copy-code:0"' in rendered.html
    doc = doc_of(rendered.html)
    plain = doc.toPlainText()
    assert "```" not in plain and "Here is *my* code:" in plain  # no Markdown outside code
    assert "Add type hints.\n  Thanks" in plain
    fmts = formats_by_text(doc)
    assert is_mono(fmts["import"]) and not is_mono(fmts["Here is *my* code:"])
    doc.setTextWidth(260)
    assert doc.size().width() <= 260
    assert user_message_html("No code, just *text*").code_blocks == []
    assert doc_of(user_message_html("a\n\nb").html).toPlainText() == "a\n\nb"


def test_footer_text() -> None:
    stats = Stats(generated_tokens=212, decode_s=212 / 42.1, target_passes=62, n_drafted=200,
                  n_accepted=162)
    assert footer_text(stats) == "42.1 tok/s · 212 tokens · 81% accepted · 3.4 tokens/pass"
    plain = Stats(generated_tokens=10, decode_s=2.0, target_passes=10)
    assert footer_text(plain) == "5.0 tok/s · 10 tokens · 1.0 tokens/pass"
    cut = Stats(generated_tokens=10, decode_s=2.0, target_passes=10, dropped_messages=4,
                finish_reason="length")
    assert footer_text(cut) == ("5.0 tok/s · 10 tokens · 1.0 tokens/pass · stopped at the "
                                "token limit · 4 earliest messages left out to fit the "
                                "context window")


def test_rate_tracker_never_reports_a_burst() -> None:
    """Five tokens landing at once after 0.5 s of waiting is 10 tok/s, not a spike."""
    tracker = RateTracker(window_s=1.0)
    assert tracker.add(0.5, 5) == pytest.approx(10.0)
    assert tracker.add(0.5001, 6) == pytest.approx(6 / 0.5001)  # a quick bonus token
    assert tracker.add(1.0, 11) == pytest.approx(11.0)
    rate = tracker.add(2.0, 16)  # window: since the sample at 1.0 s
    assert rate == pytest.approx(5.0)
    assert len(tracker.history) == 4


def test_conversation_markdown_export() -> None:
    from app.ui.token_render import conversation_markdown

    stats = {"generated_tokens": 10, "decode_s": 2.0, "target_passes": 5, "n_drafted": 8,
             "n_accepted": 5}
    msgs = [Message(1, 1, 0, "user", "Why?"),
            Message(2, 1, 1, "assistant", "Because.", model="demo", stats=stats),
            Message(3, 1, 2, "assistant", "Partial", status="interrupted"),
            # stopped while its prompt was read: no numbers to report
            Message(4, 1, 3, "assistant", "", status="stopped",
                    stats={"generated_tokens": 0, "finish_reason": "cancelled"})]
    md = conversation_markdown("Questions", msgs)
    assert md == ("# Questions\n\n## You\n\nWhy?\n\n## Assistant (demo)\n\nBecause.\n\n"
                  "*5.0 tok/s · 10 tokens · 62% accepted · 2.0 tokens/pass*\n\n"
                  "## Assistant\n\nPartial\n\n"
                  "*interrupted: the app closed before this reply finished*\n\n"
                  "## Assistant\n\n\n\n*stopped*\n")
