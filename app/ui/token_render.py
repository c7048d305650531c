"""Turn replies into the HTML the chat view shows: pure functions, no widgets.

Two renderings of the same reply:

* speculation shown: one `<span>` per token, styled by its `TokenKind` (accepted green,
  replaced amber, bonus blue, rejected drafts as struck-through red ghosts where the engine
  placed them: right after the committed token their branch hangs from), each with a
  tooltip naming its kind, the target's probability and a ghost's branch; a thin bar parts
  two neighbouring ghosts of different branches. With `marks` on (View ▸ Mark Token Kinds
  by Shape), corrected tokens are also underlined and bonus ones overlined, so a reader who
  cannot tell green from amber (deuteranopia) still can tell the kinds apart. Tokens
  inside a fenced code block keep their colours in a monospace font, and each block's
  opening fence line ends with a Copy link that copies the block's committed code (no
  ghosts, no fences). A step that fell back to a plain step (`Step.error`) is underlined
  in amber with the reason in its tooltip; the first step of a reply with each reason
  also gets a warning marker (a drafter that keeps failing would otherwise litter the
  reply with them);
* clean: the committed text as Markdown (markdown-it-py, CommonMark + tables), code blocks
  highlighted by pygments with a copy link, as a coding assistant's reply is expected to look.

A user's message is shown as typed, except that its fenced code is a code block like a
reply's. Code lines wrap at the card's width (QTextBrowser has no per-block scrolling, and a
card is exactly as tall as its text), keeping their indentation.

The HTML stays inside the subset QTextDocument understands (inline styles, tables, pre).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name, guess_lexer
from pygments.util import ClassNotFound

from app.store import Message, stats_from_dict
from engine.context_fit import dropped_note
from engine.events import CUT_MARK, Stats, Step, Token, TokenKind

MONO = "Menlo, 'SF Mono', Consolas, 'DejaVu Sans Mono', monospace"
COPY_SCHEME = "copy-code"  # anchors "copy-code:<n>" ask the view to copy code block n
GHOST_SEPARATOR = "\N{LIGHT VERTICAL BAR}"  # between two branches' ghosts (no tooltip)
CODE_LABEL_TIP = "The code block's language"  # the label above a code block


@dataclass(frozen=True)
class KindStyle:
    """How one token kind looks in the light and dark palettes, and what it means."""

    label: str
    meaning: str
    light_fg: str | None
    light_bg: str | None
    dark_fg: str | None
    dark_bg: str | None
    strike: bool = False
    # a text-decoration shown only with marks on: a cue that does not rely on colour
    mark: str = ""

    def colors(self, dark: bool) -> tuple[str | None, str | None]:
        return (self.dark_fg, self.dark_bg) if dark else (self.light_fg, self.light_bg)


KIND_STYLES: dict[TokenKind, KindStyle] = {
    TokenKind.ACCEPTED: KindStyle(
        "accepted", "drafted, and the target agreed", "#0b5d1e", "#cdf3d5", "#a6f0b4", "#1e4b2b"),
    TokenKind.REPLACED: KindStyle(
        "corrected", "the target's own token where the draft was wrong",
        "#7a4300", "#ffdf9e", "#ffd48a", "#5c3b08", mark="underline"),
    TokenKind.BONUS: KindStyle(
        "bonus", "the target's extra token after every draft passed",
        "#0b3b8f", "#d3e4ff", "#b0cdff", "#1b3763", mark="overline"),
    TokenKind.REJECTED: KindStyle(
        "rejected", "a drafted guess the target threw away (never part of the reply)",
        "#c0392b", None, "#ff8a80", None, strike=True),
    TokenKind.TARGET: KindStyle(
        "target", "decoded by the target alone (no draft)", None, None, None, None),
}
LEGEND_ORDER = (TokenKind.ACCEPTED, TokenKind.REPLACED, TokenKind.BONUS, TokenKind.REJECTED,
                TokenKind.TARGET)


def kind_css(kind: TokenKind, dark: bool, marks: bool = False) -> str:
    """The inline CSS of a token of this kind; `marks` adds its shape cue (`KindStyle.mark`).

    Accepted tokens get no mark: they are most of a reply, and their background alone
    (lighter or darker than the page) already parts them from unstyled target tokens.
    """
    style = KIND_STYLES[kind]
    fg, bg = style.colors(dark)
    parts = []
    if fg:
        parts.append(f"color:{fg}")
    if bg:
        parts.append(f"background-color:{bg}")
    if style.strike:
        parts.append("text-decoration:line-through")
    elif marks and style.mark:
        parts.append(f"text-decoration:{style.mark}")
    return ";".join(parts)


WARNING_COLORS = ("#9a6700", "#f0b72f")  # light, dark: the fallback marker
WARNING_MARK = "\N{WARNING SIGN}"


def token_tooltip(token: Token, warning: str = "") -> str:
    """What hovering a token says: its kind (and a ghost's draft-tree branch), what that
    means, the target's probability, and why its step fell back (`warning`), if it did."""
    style = KIND_STYLES[token.kind]
    prob = "n/a" if token.prob is None else f"{token.prob:.1%}"
    shown = token.text if token.text.strip() and token.text.isprintable() else repr(token.text)
    branch = f"\ndraft tree {token.branch}" if token.branch else ""
    note = f"\n{WARNING_MARK} {warning}" if warning else ""
    return (f"{style.label}: {style.meaning}{branch}\ntoken {token.id} {shown!s}\n"
            f"target probability {prob}{note}")


def step_warning_tooltip(error: str) -> str:
    return ("A draft was refused: this step ran as a plain step (so did every step "
            f"underlined like it):\n{error}")


def is_decoration(tooltip: str, text: str, anchor: str) -> bool:
    """Whether a run of the shown reply is the view's, not the message's: a rejected guess,
    a fallback step's marker, the bar between two branches' ghosts, or a code block's
    label and Copy link. Copying a selection leaves these out (`tooltip`, `text` and
    `anchor` are a run's tooltip, text and link target, as the document holds them)."""
    return (tooltip.startswith((f"{KIND_STYLES[TokenKind.REJECTED].label}:",
                                step_warning_tooltip(""), CODE_LABEL_TIP))
            or anchor.startswith(f"{COPY_SCHEME}:")
            or (not tooltip and text == GHOST_SEPARATOR))


def _escape(text: str) -> str:
    return html.escape(text, quote=False)


def shown_text(token: Token) -> str:
    """The text a token shows: its own, except that a ghost must stay visible even when
    its text is empty or only control characters (a newline), and never shows U+FFFD: a
    rejected token that is part of a character (byte-level vocabularies split CJK and
    emoji into bytes) decodes alone to U+FFFD, which read as broken text in the reply."""
    if token.kind is not TokenKind.REJECTED:
        return token.text
    text = token.text.replace(CUT_MARK, "")
    return text if any(c.isprintable() for c in text) else "\N{WHITE SQUARE}"


def token_span(token: Token, dark: bool = False, warning: str = "", code: bool = False,
               marks: bool = False) -> str:
    """One token as a styled span with its tooltip (`code`: in a monospace font; `marks`:
    with its kind's shape cue)."""
    text = shown_text(token)
    if not text:
        return ""
    css = kind_css(token.kind, dark, marks)
    if code:
        css = f"{css};font-family:{MONO}" if css else f"font-family:{MONO}"
    if warning:  # a fallback step is a plain step (target tokens): no mark to clash with
        underline = f"text-decoration:underline;text-decoration-color:{WARNING_COLORS[dark]}"
        css = f"{css};{underline}" if css else underline
    title = html.escape(token_tooltip(token, warning), quote=True)
    return f'<span style="{css}" title="{title}">{_escape(text)}</span>'


def warning_span(error: str, dark: bool = False) -> str:
    """The marker in front of a step that fell back to a plain step; hovering says why."""
    title = html.escape(step_warning_tooltip(error), quote=True)
    return (f'<span style="color:{WARNING_COLORS[dark]}; font-weight:bold" '
            f'title="{title}">{WARNING_MARK}</span>')


def ghost_separator(dark: bool = False) -> str:
    """A thin muted bar between two neighbouring ghosts of different branches."""
    return f'<span style="color:{"#6e7681" if dark else "#a0a7b0"}">{GHOST_SEPARATOR}</span>'


def _is_fence(line: str) -> bool:
    """Whether a line opens or closes a fenced code block (CommonMark: up to three spaces,
    then three backticks or tildes)."""
    stripped = line.lstrip(" ")
    return len(line) - len(stripped) <= 3 and stripped.startswith(("```", "~~~"))


class FenceTracker:
    """Follows the committed text token by token and says which tokens are code: those
    inside a fenced block, and the fence lines themselves. It also keeps each block's
    committed code (what its Copy link copies: no fences, no rejected guesses).

    Tokens do not respect lines, so a token is code when the text is in code just before
    or just after it; token boundaries at a line break (the usual case) keep the words
    around a block in the text font.
    """

    def __init__(self) -> None:
        self.fence = ""  # the open fence's marker ("```" or "~~~"), "" outside a block
        self.line = ""  # the text of the line being written (its start: enough for a fence)
        self.blocks: list[str] = []  # each block's code lines ended so far
        self._code = ""  # the open block's line being written, in full
        self.opened_at = -1  # where in the last text fed an opening fence's line ended

    def in_code(self) -> bool:
        return bool(self.fence) or _is_fence(self.line)

    def code(self, index: int) -> str:
        """Block `index`'s code so far (a block still streaming: with its unfinished line)."""
        if not 0 <= index < len(self.blocks):
            return ""
        partial = self._code if self.fence and index == len(self.blocks) - 1 else ""
        return self.blocks[index] + partial

    def feed(self, text: str) -> bool:
        """Add committed text; True if it belongs to code. `opened_at` says at which
        character of `text` (its newline) a block's opening fence line ended, else -1."""
        before = self.in_code()
        self.opened_at = -1
        *ended, current = text.split("\n")
        offset = 0
        for part in ended:
            offset += len(part) + 1
            line, code_line = self.line + part, self._code + part
            self.line = self._code = ""
            if _is_fence(line):
                marker = line.strip()[:3]
                if not self.fence:
                    self.fence = marker
                    self.blocks.append("")
                    self.opened_at = offset - 1
                    continue
                if marker == self.fence and line.strip().strip(marker[0]) == "":
                    self.fence = ""  # a closing fence: only the marker's characters
                    continue
            if self.fence:
                self.blocks[-1] += code_line + "\n"
        self.line = (self.line + current)[:80]  # a long line costs nothing
        if self.fence:
            self._code += current
        return before or self.in_code()


def copy_anchor(index: int) -> str:
    """A code block's Copy link (what `is_decoration` and the view's anchor handler know)."""
    return f'<a href="{COPY_SCHEME}:{index}" style="font-size:small">Copy</a>'


def copy_link(index: int) -> str:
    """The Copy link at the end of a code block's opening fence line (coloured mode)."""
    return (f'<a href="{COPY_SCHEME}:{index}" style="text-decoration:none">&nbsp;&nbsp;</a>'
            f'{copy_anchor(index)}')


class TokensHtml:
    """Writes a reply's steps as styled HTML one step at a time, so a reply being
    streamed can add each new step's spans to what is shown rather than render the whole
    reply again (which made each step cost as much as the reply so far: seconds of a
    frozen window per step near the end of a reply of thousands of tokens). What
    crosses steps is kept here: the open code fence, the fallback reasons already marked.
    """

    def __init__(self, *, show_rejected: bool = True, dark: bool = False,
                 marks: bool = False) -> None:
        self.show_rejected = show_rejected
        self.dark = dark
        self.marks = marks
        self.marked: set[str] = set()  # one marker per reason; later steps are only underlined
        self.fences = FenceTracker()

    def step(self, step: Step) -> str:
        """The inner HTML (for a pre-wrap block) of the next step."""
        out: list[str] = []
        dark, marks = self.dark, self.marks
        if step.error and step.error not in self.marked:
            self.marked.add(step.error)
            out.append(warning_span(step.error, dark))
        previous: Token | None = None
        for token in step.tokens:
            if token.kind is TokenKind.REJECTED:
                if not self.show_rejected:
                    continue
                if (previous is not None and previous.kind is TokenKind.REJECTED
                        and previous.branch != token.branch):
                    out.append(ghost_separator(dark))
                code = self.fences.in_code()  # a ghost is not part of the text
            else:
                code = self.fences.feed(token.text)
                at = self.fences.opened_at
                if at >= 0:  # a block opened: its Copy link ends the fence's line
                    head, tail = token.text[:at], token.text[at:]
                    out.append(token_span(replace(token, text=head), dark, step.error, code,
                                          marks))
                    out.append(copy_link(len(self.fences.blocks) - 1))
                    token = replace(token, text=tail)
            out.append(token_span(token, dark, step.error, code, marks))
            previous = token
        return "".join(out)


def tokens_html(steps: Iterable[Step], *, show_rejected: bool = True, dark: bool = False,
                marks: bool = False) -> str:
    """A reply with every token styled by its fate, in the steps' display order (inner
    HTML for a pre-wrap block); `show_rejected` off drops the ghosts, `marks` on adds
    each kind's shape cue."""
    writer = TokensHtml(show_rejected=show_rejected, dark=dark, marks=marks)
    return "".join(writer.step(step) for step in steps)


def wrap_pre(inner: str) -> str:
    """A block that keeps spaces and newlines as they are (token text is raw text)."""
    return f'<div style="white-space:pre-wrap">{inner}</div>'


def wrap_pre_inline(inner: str) -> str:
    """`wrap_pre` for HTML added at the end of a block that `wrap_pre` opened (a block
    element there would start a new paragraph)."""
    return f'<span style="white-space:pre-wrap">{inner}</span>'


def plain_html(text: str) -> str:
    """Raw text (a user's message) as HTML that keeps its line breaks."""
    return wrap_pre(_escape(text))


def kinds_present(steps: Iterable[Step]) -> set[TokenKind]:
    return {t.kind for s in steps for t in s.tokens}


# -- clean mode: Markdown ------------------------------------------------------------------
@dataclass
class RenderedMarkdown:
    html: str
    code_blocks: list[str] = field(default_factory=list)


def _lexer(code: str, lang: str):
    if lang:
        try:
            return get_lexer_by_name(lang)
        except ClassNotFound:
            pass
    try:
        return guess_lexer(code) if code.strip() else TextLexer()
    except ClassNotFound:
        return TextLexer()


def code_block_html(code: str, lang: str, index: int, dark: bool) -> str:
    """A highlighted code block in a shaded table cell, with a copy link above it."""
    formatter = HtmlFormatter(nowrap=True, noclasses=True,
                              style="github-dark" if dark else "default")
    body = highlight(code, _lexer(code, lang), formatter).rstrip("\n")
    bg = "#161b22" if dark else "#f4f6f8"
    border = "#30363d" if dark else "#d8dee4"
    muted = "#8b949e" if dark else "#57606a"
    label = _escape(lang) if lang else "code"
    return (
        f'<table width="100%" cellspacing="0" cellpadding="8" '
        f'style="background-color:{bg}; border:1px solid {border}; margin-top:4px; margin-bottom:4px">'
        f'<tr><td><span style="color:{muted}; font-size:small" title="{CODE_LABEL_TIP}">'
        f'{label}&nbsp;&nbsp;</span>{copy_anchor(index)}'
        f'<pre style="font-family:{MONO}; margin:0; white-space:pre-wrap">{body}</pre>'
        "</td></tr></table>"
    )


def _fence_lang(info: str) -> str:
    return info.strip().split()[0] if info.strip() else ""


def _markdown_parser(dark: bool, blocks: list[str]) -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable(
        ["table", "strikethrough"])
    inline_bg = "#2d333b" if dark else "#eff1f3"

    def fence(self, tokens, idx, options, env) -> str:
        tok = tokens[idx]
        blocks.append(tok.content)
        return code_block_html(tok.content, _fence_lang(tok.info), len(blocks) - 1, dark)

    def code_inline(self, tokens, idx, options, env) -> str:
        return (f'<code style="font-family:{MONO}; background-color:{inline_bg}">'
                f"{_escape(tokens[idx].content)}</code>")

    md.add_render_rule("fence", fence)
    md.add_render_rule("code_block", fence)
    md.add_render_rule("code_inline", code_inline)
    return md


def markdown_html(text: str, dark: bool = False) -> RenderedMarkdown:
    """Markdown (possibly still streaming: an open fence renders as a code block) to HTML."""
    blocks: list[str] = []
    body = _markdown_parser(dark, blocks).render(text)
    return RenderedMarkdown(body, blocks)


MARKDOWN_CHARS_PER_MS = 100  # a streaming Markdown reply waits 1 ms per 100 characters
MARKDOWN_REFRESH_MAX_MS = 400


def markdown_refresh_ms(chars: int) -> int:
    """How long a streaming reply shown as Markdown waits before it is rendered again.

    Markdown cannot be added to a step at a time (a later line can make a table or close
    a list), so each refresh renders the whole reply: about 0.1 s at 30k characters. A
    refresh at every step kept the GUI thread busy most of the time near the end of a long
    reply; waiting in proportion to its length keeps that to about a quarter.
    """
    return min(MARKDOWN_REFRESH_MAX_MS, chars // MARKDOWN_CHARS_PER_MS)


def user_message_html(text: str, dark: bool = False) -> RenderedMarkdown:
    """A user's message as typed (no Markdown: their asterisks and line breaks are theirs),
    except that fenced code shows as a code block with a copy link, like a reply's."""
    lines = text.split("\n")
    parts: list[str] = []
    blocks: list[str] = []
    at = 0

    def typed(upto: int) -> None:
        chunk = "\n".join(lines[at:upto]).strip("\n")
        if chunk:
            parts.append(plain_html(chunk))

    fences = [t for t in MarkdownIt("commonmark").parse(text)
              if t.type == "fence" and t.level == 0 and t.map]  # not in a list or quote
    for tok in fences:
        start, end = tok.map
        typed(start)
        blocks.append(tok.content)
        parts.append(code_block_html(tok.content, _fence_lang(tok.info), len(blocks) - 1, dark))
        at = end
    typed(len(lines))
    return RenderedMarkdown("".join(parts), blocks)


# -- numbers -------------------------------------------------------------------------------
def stopped_reading(stats: Stats) -> bool:
    """Whether the reply was stopped before its first token (while the prompt was read):
    it has no speed to show."""
    return stats.finish_reason == "cancelled" and not stats.generated_tokens


def footer_text(stats: Stats) -> str:
    """The line under a finished reply: "42.1 tok/s · 212 tokens · 81% accepted · 3.4 tokens/pass"."""
    parts = [f"{stats.decode_tps:.1f} tok/s", f"{stats.generated_tokens} tokens"]
    if stats.n_drafted:
        parts.append(f"{stats.acceptance:.0%} accepted")
    parts.append(f"{stats.tau:.1f} tokens/pass")
    if stats.finish_reason == "length":
        parts.append("stopped at the token limit")
    if stats.dropped_messages:
        parts.append(dropped_note(stats.dropped_messages))
    return " · ".join(parts)


STATUS_NOTES = {
    "stopped": "stopped",
    "interrupted": "interrupted: the app closed before this reply finished",
    "failed": "failed",
}


def conversation_markdown(title: str, messages: Sequence[Message]) -> str:
    """A conversation exported as Markdown, with each reply's numbers under it."""
    lines = [f"# {title}", ""]
    for m in messages:
        heading = {"user": "You", "assistant": "Assistant", "system": "System"}.get(m.role, m.role)
        model = f" ({m.model})" if m.role == "assistant" and m.model else ""
        lines += [f"## {heading}{model}", "", m.content, ""]
        stats = stats_from_dict(m.stats)
        note = STATUS_NOTES.get(m.status, "")
        if m.role == "assistant" and (stats or note):
            numbers = footer_text(stats) if stats and stats.generated_tokens else ""
            meta = " · ".join(x for x in (numbers, note) if x)
            lines += [f"*{meta}*", ""]
    return "\n".join(lines).rstrip() + "\n"
