"""The conversation: one card per message, replies styled token by token or as Markdown.

With "show speculation" on, a reply's tokens are coloured by fate (legend at the top) and
hovering one names its kind and the target's probability; off, the reply is clean Markdown
with highlighted code blocks and copy links. Both come from `app.ui.token_render`; this module
only lays them out and reacts to the controller. Rendering during streaming is coalesced
to one refresh per event-loop turn, so a burst of steps costs one layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import ceil

from PySide6.QtCore import QEvent, QMimeData, QPoint, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QAction,
    QContextMenuEvent,
    QFont,
    QGuiApplication,
    QResizeEvent,
    QTextCursor,
    QTextDocument,
    QTextOption,
    QWheelEvent,
)
from PySide6.QtWidgets import (
    QCheckBox,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QMenu,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QScrollBar,
    QSizePolicy,
    QTextBrowser,
    QToolButton,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from app.store import FAILED, GENERATING, INTERRUPTED, STOPPED, Message, stats_from_dict
from app.ui.chat_paging import batch_start
from app.ui.controller import ChatController, continuable, sent_to_model
from app.ui.theme import widget_is_dark
from app.ui.token_render import (
    COPY_SCHEME,
    KIND_STYLES,
    LEGEND_ORDER,
    TokensHtml,
    footer_text,
    is_decoration,
    kind_css,
    markdown_html,
    markdown_refresh_ms,
    user_message_html,
    wrap_pre,
    wrap_pre_inline,
)
from engine.events import Stats, Step

COPIED_MS = 1500  # how long a card's Copy button reads "Copied"
REGENERATE_TIP = ("Generate this reply again (what it repeats of this one is drafted from "
                  "it, so it arrives faster)")
# an earlier reply: what follows it was written from it, so it goes too
REGENERATE_EARLIER_TIP = ("Generate this reply again (replaces it and everything after it; "
                          "what it repeats of this one is drafted from it)")

STATUS_TEXT = {
    GENERATING: "generating…",
    STOPPED: "stopped",
    INTERRUPTED: "interrupted — the app closed before this reply finished",
    FAILED: "failed",
}


class TokenBrowser(QTextBrowser):
    """A read-only rich-text box that is as tall as its content and shows token tooltips."""

    code_copied = Signal()  # a code block's Copy link put it on the clipboard
    zoom_requested = Signal(int)  # Ctrl/⌘ + wheel: +1 larger, -1 smaller (View ▸ Zoom)

    def __init__(self, parent: QWidget | None = None, *, fit_height: bool = True) -> None:
        super().__init__(parent)
        self.code_blocks: list[str] = []
        # the steps shown with their token colours, and the writer that wrote them (None
        # while the box shows anything else): a step added is written alone
        self._writer: TokensHtml | None = None
        self._shown: list[Step] = []
        self._length = 0  # the document's length as they left it (else it was changed since)
        self.steps_rendered = 0  # steps written as HTML over the box's life (work done)
        self.setOpenLinks(False)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.anchorClicked.connect(self._on_anchor_clicked)
        self._fit = fit_height
        if fit_height:
            # No scroll bars: the text wraps at the width (code lines too, and a string
            # with no break, such as a long URL, anywhere) and the box is as tall as it.
            self.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
            self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
            self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
            self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
            self.document().documentLayout().documentSizeChanged.connect(self._fit_height)
        self.viewport().setAutoFillBackground(False)

    def show_reply(self, steps: Sequence[Step], text: str, *, speculation: bool,
                   show_rejected: bool, dark: bool, marks: bool = False) -> None:
        """A reply with its tokens styled by fate (`marks`: by shape too), or (`speculation`
        off) as clean Markdown.

        The chat's cards and the comparison's panes both show replies through this.
        """
        self.code_blocks = []
        if speculation and steps:
            self._show_tokens(steps, show_rejected, dark, marks)
        else:
            rendered = markdown_html(text, dark)
            self.show_html(rendered.html, rendered.code_blocks)

    def show_html(self, html: str, code_blocks: list[str]) -> None:
        """Anything but a reply's coloured tokens (a user's message, clean Markdown)."""
        self._writer = None
        self._shown = []
        self.code_blocks = code_blocks
        self.setHtml(html)

    def _show_tokens(self, steps: Sequence[Step], show_rejected: bool, dark: bool,
                     marks: bool) -> None:
        """Write only the steps not shown yet when those shown are how `steps` begins (a
        reply streaming, or finished as it streamed), in the same style; else all of them."""
        writer, shown = self._writer, self._shown
        n = len(shown)
        if (writer is not None and writer.show_rejected == show_rejected
                and writer.dark == dark and writer.marks == marks and 0 < n <= len(steps)
                and self.document().characterCount() == self._length
                and (steps[n - 1] is shown[-1] or list(steps[:n]) == shown)):
            new = steps[n:]
            if new:
                cursor = QTextCursor(self.document())
                cursor.movePosition(QTextCursor.MoveOperation.End)
                cursor.insertHtml(wrap_pre_inline("".join(writer.step(s) for s in new)))
                shown.extend(new)
                self.steps_rendered += len(new)
                self._length = self.document().characterCount()
            return
        writer = TokensHtml(show_rejected=show_rejected, dark=dark, marks=marks)
        self.setHtml(wrap_pre("".join(writer.step(s) for s in steps)))
        self._writer, self._shown = writer, list(steps)
        self.steps_rendered += len(steps)
        self._length = self.document().characterCount()

    def _fit_height(self, *_: object) -> None:
        self.setFixedHeight(int(self.document().size().height()) + 4)

    def tooltip_at(self, pos: QPoint) -> str:
        """The tooltip of the character under viewport position `pos` ('' if none)."""
        layout = self.document().documentLayout()
        offset = QPoint(self.horizontalScrollBar().value(), self.verticalScrollBar().value())
        at = layout.hitTest(pos + offset, Qt.HitTestAccuracy.ExactHit)
        if at < 0:
            return ""
        cursor = QTextCursor(self.document())
        cursor.setPosition(at + 1)  # the format of the character *before* the cursor
        return cursor.charFormat().toolTip()

    def wheelEvent(self, event: QWheelEvent) -> None:  # noqa: N802 - Qt override
        """Ctrl/⌘ + wheel zooms the whole conversation (`zoom_requested`); QTextBrowser's
        own zoom grew only the message under the pointer."""
        if event.modifiers() & Qt.KeyboardModifier.ControlModifier:
            if event.angleDelta().y():
                self.zoom_requested.emit(1 if event.angleDelta().y() > 0 else -1)
            event.accept()
            return
        super().wheelEvent(event)

    def viewportEvent(self, event: QEvent) -> bool:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.ToolTip:
            tip = self.tooltip_at(event.pos())
            if tip:
                QToolTip.showText(event.globalPos(), tip, self.viewport())
            else:
                QToolTip.hideText()
            return True
        return super().viewportEvent(event)

    def createMimeDataFromSelection(self) -> QMimeData:  # noqa: N802 - Qt override
        """Copy (⌘C, drag) gives the selected text as it reads: without rejected guesses,
        fallback markers, branch bars or code blocks' label and Copy link, and as plain
        text (rich text carried the token colours and struck-through ghosts along)."""
        mime = QMimeData()
        mime.setText(selected_text(self.textCursor()))
        return mime

    def contextMenuEvent(self, event: QContextMenuEvent) -> None:  # noqa: N802 - Qt override
        self.context_menu(event.pos()).exec(event.globalPos())

    def context_menu(self, pos: QPoint) -> QMenu:
        """The right-click menu at viewport position `pos`. On a code block's Copy link it
        offers Copy Code instead of Qt's Copy Link Location, which would copy the view's
        internal address ("copy-code:0") where the user wants the code."""
        menu = self.createStandardContextMenu(pos)
        anchor = self.anchorAt(pos)
        if anchor.startswith(f"{COPY_SCHEME}:"):
            for action in menu.actions():
                if action.objectName() == "link-copy":
                    menu.removeAction(action)
            copy_code = QAction("Copy Code", menu)
            copy_code.triggered.connect(lambda: self._on_anchor_clicked(QUrl(anchor)))
            first = menu.actions()[0] if menu.actions() else None
            menu.insertAction(first, copy_code)
            if first is not None:
                menu.insertSeparator(first)
        return menu

    def _on_anchor_clicked(self, url: QUrl) -> None:
        if url.scheme() == COPY_SCHEME:
            index = int(url.path() or "-1")
            code = self.code_block(index)
            if code is not None:
                QGuiApplication.clipboard().setText(code)
                self.code_copied.emit()

    def code_block(self, index: int) -> str | None:
        """What code block `index`'s Copy link copies: with the tokens coloured, the
        block's committed code as the writer followed it (the reply may still stream)."""
        if self._writer is not None:
            fences = self._writer.fences
            return fences.code(index) if 0 <= index < len(fences.blocks) else None
        return self.code_blocks[index] if 0 <= index < len(self.code_blocks) else None


def page_scroll(bar: QScrollBar, direction: int) -> None:
    """Move `bar` a page down (+1) or up (-1), as Page Down/Up in the bar's own widget."""
    bar.triggerAction(QScrollBar.SliderAction.SliderPageStepAdd if direction > 0
                      else QScrollBar.SliderAction.SliderPageStepSub)


def selected_text(cursor: QTextCursor) -> str:
    """The plain text of `cursor`'s selection less the view's decorations
    (`token_render.is_decoration`)."""
    doc = QTextDocument()
    QTextCursor(doc).insertFragment(cursor.selection())
    runs: list[tuple[int, int]] = []  # (position, length) of each decoration
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            fmt = frag.charFormat()
            if is_decoration(fmt.toolTip(), frag.text(), fmt.anchorHref()):
                runs.append((frag.position(), frag.length()))
            it += 1
        block = block.next()
    edit = QTextCursor(doc)
    for position, length in reversed(runs):
        edit.setPosition(position)
        edit.setPosition(position + length, QTextCursor.MoveMode.KeepAnchor)
        edit.removeSelectedText()
    return doc.toPlainText()


class MessageCard(QFrame):
    """One message: role, actions, body, and (for replies) the numbers footer."""

    copy_requested = Signal(int)
    edit_requested = Signal(int)
    regenerate_requested = Signal(int)
    continue_requested = Signal(int)

    def __init__(self, message: Message, view: ChatView) -> None:
        super().__init__()
        self.view = view
        self.message = message
        self.steps: list[Step] = list(message.steps)
        # each step's text, kept as it arrives: joining them is cheap where taking every
        # step's text from its tokens again at each refresh grew with the reply
        self._texts = [s.text for s in self.steps]
        self.live_stats: Stats | None = None
        self.setObjectName("userMessage" if message.role == "user" else "assistantMessage")
        self.role_label = QLabel("You" if message.role == "user" else "Assistant")
        self.role_label.setObjectName("roleLabel")
        self.browser = TokenBrowser()
        # what a screen reader says on reaching the text, and on each action of the card
        # ("Copy" alone is one of many in the column)
        what = "your message" if message.role == "user" else "the assistant's reply"
        self.browser.setAccessibleName(what[0].upper() + what[1:])
        self.footer = QLabel("")
        self.footer.setObjectName("messageFooter")
        self.footer.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # a long footer (numbers, the token limit, messages left out) wraps rather than
        # widening the card past the chat column
        self.footer.setWordWrap(True)

        # the role, then the actions beside it, or on a row below when the column is too
        # narrow for both (a reply cut short has three; side by side they widened the card
        # past the column and the chat scrolled sideways)
        self.header = QGridLayout()
        self.header.setContentsMargins(0, 0, 0, 0)
        self.header.setVerticalSpacing(0)
        self.header.setColumnStretch(0, 1)
        self.header.addWidget(self.role_label, 0, 0)
        self.actions = QHBoxLayout()
        self.actions.setContentsMargins(0, 0, 0, 0)
        self.actions.addStretch(1)
        self.copy_button = self._action("Copy", "Copy this message", self.copy_requested, what)
        self.actions.addWidget(self.copy_button)
        if message.role == "user":
            self.actions.addWidget(self._action("Edit", "Edit and resend", self.edit_requested,
                                                what))
        else:
            self.continue_button = self._action(
                "Continue", "Write on from where this reply was cut short",
                self.continue_requested, what)
            self.continue_button.hide()  # the view shows it on a last reply cut short
            self.actions.addWidget(self.continue_button)
            self.regenerate_button = self._action("Regenerate", REGENERATE_TIP,
                                                  self.regenerate_requested, what)
            self.actions.addWidget(self.regenerate_button)
        self.actions_row = 0
        self.header.addLayout(self.actions, 0, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.setSpacing(2)
        layout.addLayout(self.header)
        layout.addWidget(self.browser)
        layout.addWidget(self.footer)
        self.render()

    def fit_header(self, column_width: int) -> None:
        """Put the actions beside the role when both fit in `column_width` (the width the
        chat column gives a card), else on a row of their own below it."""
        margins = self.layout().contentsMargins()
        inner = column_width - margins.left() - margins.right() - 2 * self.frameWidth()
        beside = (self.role_label.sizeHint().width() + self.header.horizontalSpacing()
                  + self.actions.sizeHint().width())
        row = 0 if beside <= inner else 1
        if row != self.actions_row:
            self.header.removeItem(self.actions)
            if row == 0:
                self.header.addLayout(self.actions, 0, 1)
            else:
                self.header.addLayout(self.actions, 1, 0, 1, 2)
            self.actions_row = row

    def _action(self, text: str, tip: str, signal, what: str) -> QToolButton:
        button = QToolButton()
        button.setText(text)
        button.setToolTip(tip)
        button.setAccessibleName(f"{text} {what}")
        button.setAutoRaise(True)
        button.clicked.connect(lambda: signal.emit(self.message.id))
        return button

    def flash_copied(self) -> None:
        self.copy_button.setText("Copied")
        QTimer.singleShot(COPIED_MS, self, lambda: self.copy_button.setText("Copy"))

    def focus_order(self) -> list[QWidget]:
        """The card's widgets that Tab stops at, in order: its actions, then its text."""
        buttons = [self.actions.itemAt(i).widget() for i in range(self.actions.count())]
        return [b for b in buttons if b is not None] + [self.browser]

    @property
    def message_id(self) -> int:
        return self.message.id

    def document(self) -> QTextDocument:
        return self.browser.document()

    def add_step(self, step: Step, stats: Stats) -> None:
        self.steps.append(step)
        self._texts.append(step.text)
        self.live_stats = stats

    def finish(self, message: Message) -> None:
        """The reply as stored when it ends, or (a continuation starting) when it resumes."""
        self.message = message
        self.steps = list(message.steps)
        self._texts = [s.text for s in self.steps]
        self.live_stats = None
        self.render()

    def text(self) -> str:
        """The reply's committed text as it stands (streaming or final)."""
        if self.message.status == GENERATING:
            return "".join(self._texts)
        return self.message.content

    def render(self) -> None:
        dark = widget_is_dark(self.view)  # the view follows the app palette immediately
        m = self.message
        if m.role != "assistant":
            rendered = user_message_html(m.content, dark)  # pasted code shows as code
            self.browser.show_html(rendered.html, rendered.code_blocks)
        else:
            self.browser.show_reply(self.steps, self.text(), speculation=self.view.show_speculation,
                                    show_rejected=self.view.show_rejected, dark=dark,
                                    marks=self.view.show_marks)
        self._render_footer()

    def _render_footer(self) -> None:
        m = self.message
        if m.role != "assistant":
            self.footer.hide()
            return
        parts = []
        stats = self.live_stats if m.status == GENERATING else stats_from_dict(m.stats)
        if stats is not None and stats.generated_tokens:
            parts.append(footer_text(stats))
        note = STATUS_TEXT.get(m.status)
        if m.status == STOPPED and not m.content:
            note = "stopped before the reply began"  # (while the prompt was read)
        if note:
            parts.append(note)
        if m.error:
            parts.append(m.error)
        if m.comparison:
            c = m.comparison
            same = "identical output" if c.get("identical") else "outputs differ"
            parts.append(f"{c.get('speedup', 0):.2f}× vs plain ({same})")
        self.footer.setText(" · ".join(parts))
        self.footer.setVisible(bool(parts))


class Legend(QWidget):
    """Colour chips for every token kind, in the palette currently showing, with the
    shape cues the replies show (`marks`)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.label = QLabel()
        self.label.setTextFormat(Qt.TextFormat.RichText)
        # Narrow windows wrap the legend between chips (a clipped chip reads as a
        # different word) rather than forcing the whole window wider; squeezed beside the
        # check boxes it moves to a row of its own (`ChatView._place_legend`), so it asks
        # no width of that row.
        self.label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.label.setWordWrap(True)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.label)
        self.refresh()

    def refresh(self, marks: bool = False, dark: bool | None = None) -> None:
        """Write the chips again; `dark` is the view's palette, which a palette change
        reaches before it reaches the legend (default: the legend's own)."""
        dark = widget_is_dark(self) if dark is None else dark
        chips = []
        for kind in LEGEND_ORDER:
            style = KIND_STYLES[kind]
            css = kind_css(kind, dark, marks)
            chips.append(f'<span style="{css}">&nbsp;{style.label}&nbsp;</span>')
        self.label.setText("&nbsp; ".join(chips))  # the plain space is where a line may break
        self.label.setToolTip("\n".join(
            f"{KIND_STYLES[k].label}: {KIND_STYLES[k].meaning}" for k in LEGEND_ORDER))

    def one_line_width(self) -> int:
        """The width every chip needs to stand on one line."""
        doc = QTextDocument()
        doc.setDocumentMargin(0)
        doc.setDefaultFont(self.label.font())
        doc.setHtml(self.label.text())
        return ceil(doc.idealWidth()) + 2


class ChatView(QWidget):
    """The scrollable list of message cards for the open conversation."""

    edit_requested = Signal(int, str)  # message id, its text (for the composer)
    copied = Signal(str)  # what went to the clipboard, in words (the status bar says it)
    zoom_requested = Signal(int)  # Ctrl/⌘ + wheel over a message

    def __init__(self, controller: ChatController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.controller = controller
        self.show_speculation = True
        self.show_rejected = True
        self.show_marks = False  # View ▸ Mark Token Kinds by Shape: cues beyond colour
        self.cards: list[MessageCard] = []
        # the open conversation's messages older than the first card, not shown yet
        # (without steps): a long chat opens at its newest (`app.ui.chat_paging`)
        self.earlier: list[Message] = []
        self._dirty: set[int] = set()
        self._follow = True
        self.text_font: QFont | None = None  # the messages' font when zoomed (else the app's)
        # while set, the view keeps this card this far below its top as the column grows
        # above it (earlier messages shown), so the message being read stays in view
        self._anchor: tuple[MessageCard, int] | None = None

        self.legend = Legend()
        self.speculation_box = QCheckBox("Show speculation")
        self.speculation_box.setChecked(True)
        self.speculation_box.setToolTip("Colour each token by its fate; off shows clean Markdown")
        self.rejected_box = QCheckBox("Rejected guesses")
        self.rejected_box.setChecked(True)
        self.rejected_box.setToolTip("Show discarded draft tokens as struck-through ghosts")
        self.bar = QGridLayout()
        self.bar.setContentsMargins(12, 6, 12, 2)
        self.bar.setVerticalSpacing(2)
        self.bar.setColumnStretch(0, 1)
        self.bar.addWidget(self.rejected_box, 0, 1)
        self.bar.addWidget(self.speculation_box, 0, 2)
        self.legend_row = -1  # the bar row the legend is in (placed at the first resize)

        self.column = QWidget()
        self.column.setObjectName("chatColumn")
        self.column_layout = QVBoxLayout(self.column)
        self.column_layout.setContentsMargins(12, 8, 12, 8)
        self.column_layout.setSpacing(10)
        self.column_layout.addStretch(1)
        self.empty_label = QLabel("Type a question below and press Enter.")
        self.empty_label.setObjectName("emptyHint")
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.column_layout.insertWidget(0, self.empty_label)
        self.earlier_button = QPushButton("Show Earlier Messages")
        self.earlier_button.setObjectName("earlierButton")
        # its text changes with the count: the name stays, the count is the description
        self.earlier_button.setAccessibleName("Show earlier messages")
        # Enter presses it too: outside a dialog a push button takes only Space
        self.earlier_button.setAutoDefault(True)
        self.earlier_button.clicked.connect(self.show_earlier)
        self.earlier_button.hide()
        self.column_layout.insertWidget(0, self.earlier_button, 0, Qt.AlignmentFlag.AlignHCenter)
        # where the newest reply's prompt began, when the conversation outgrew the window
        self.context_divider = QLabel("The model no longer reads the messages above: the "
                                      "conversation outgrew its context window")
        self.context_divider.setObjectName("contextDivider")
        self.context_divider.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.context_divider.setWordWrap(True)
        self.context_divider.hide()
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setWidget(self.column)
        # the column is as wide as the view: cards wrap (text, footer, header actions)
        # rather than scroll sideways
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.viewport().installEventFilter(self)
        self.scroll.verticalScrollBar().rangeChanged.connect(self._on_range_changed)
        self.scroll.verticalScrollBar().valueChanged.connect(self._on_scrolled)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        layout.addLayout(self.bar)
        layout.addWidget(self.scroll, 1)
        self._place_legend()

        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.setInterval(0)
        self._render_timer.timeout.connect(self._render_dirty)

        self.speculation_box.toggled.connect(self.set_show_speculation)
        self.rejected_box.toggled.connect(self.set_show_rejected)
        controller.conversation_opened.connect(self._on_conversation_opened)
        controller.message_added.connect(self._on_message_added)
        controller.step_received.connect(self._on_step_received)
        controller.reply_finished.connect(self._on_reply_finished)
        controller.reply_updated.connect(self._on_reply_finished)
        controller.reply_discarded.connect(self._on_reply_discarded)
        controller.reply_resumed.connect(self._on_reply_finished)
        controller.generating_changed.connect(lambda _on: self._update_continue())

    # -- public --------------------------------------------------------------------------
    def card_for(self, message_id: int) -> MessageCard | None:
        return next((c for c in self.cards if c.message_id == message_id), None)

    def set_show_speculation(self, on: bool) -> None:
        self.show_speculation = on
        if self.speculation_box.isChecked() != on:
            self.speculation_box.setChecked(on)
        self.legend.setVisible(on)
        self.rejected_box.setEnabled(on)
        self.render_all()

    def set_show_rejected(self, on: bool) -> None:
        self.show_rejected = on
        if self.rejected_box.isChecked() != on:
            self.rejected_box.setChecked(on)
        self.render_all()

    def set_show_marks(self, on: bool) -> None:
        """Mark token kinds by shape as well as colour (underline, overline), for readers
        who cannot tell the kinds' colours apart."""
        self.show_marks = on
        self.render_all()

    def render_all(self) -> None:
        self.legend.refresh(self.show_marks, widget_is_dark(self))
        for card in self.cards:
            card.render()

    def resizeEvent(self, event: QResizeEvent) -> None:  # noqa: N802 - Qt override
        super().resizeEvent(event)
        self._place_legend()

    def eventFilter(self, watched: object, event: QEvent) -> bool:  # noqa: N802 - Qt override
        if watched is self.scroll.viewport() and event.type() == QEvent.Type.Resize:
            self._fit_headers()
        return super().eventFilter(watched, event)

    def scroll_page(self, direction: int) -> None:
        """Scroll the conversation a page up (-1) or down (+1): Page Up/Down in the composer."""
        page_scroll(self.scroll.verticalScrollBar(), direction)

    def set_text_font(self, font: QFont) -> None:
        """The messages' font (View ▸ Zoom), for the cards shown and those to come: set on
        each card's text, as a style-sheeted card does not pass its parent's font on."""
        self.text_font = QFont(font)
        for card in self.cards:
            card.browser.setFont(self.text_font)

    def _fit_headers(self) -> None:
        margins = self.column_layout.contentsMargins()
        width = self.scroll.viewport().width() - margins.left() - margins.right()
        for card in self.cards:
            card.fit_header(width)

    def _place_legend(self) -> None:
        """The legend beside the check boxes when all its chips fit there on one line, else
        on a row of its own below them, where it wraps a few chips per line (squeezed
        beside them it stacked one chip per line)."""
        margins = self.bar.contentsMargins()
        beside = (self.legend.one_line_width() + self.rejected_box.sizeHint().width()
                  + self.speculation_box.sizeHint().width() + 2 * self.bar.horizontalSpacing()
                  + margins.left() + margins.right())
        row = 0 if self.width() >= beside else 1
        if row != self.legend_row:
            self.bar.removeWidget(self.legend)
            if row == 0:
                self.bar.addWidget(self.legend, 0, 0)
            else:
                self.bar.addWidget(self.legend, 1, 0, 1, 3)
            self.legend_row = row

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt override
        if event.type() == QEvent.Type.PaletteChange:
            self.render_all()  # token colours and code highlighting have dark variants
        super().changeEvent(event)

    # -- controller events ---------------------------------------------------------------
    def _clear(self) -> None:
        for card in self.cards:
            self.column_layout.removeWidget(card)
            card.deleteLater()
        self.cards.clear()
        self.earlier = []
        self._dirty.clear()

    def _on_conversation_opened(self, messages: list[Message]) -> None:
        self._clear()
        start = batch_start(messages, len(messages))
        self.earlier = list(messages[:start])
        for m in self.controller.with_steps(messages[start:]):
            self._append_card(m)
        self._follow = True
        self._anchor = None
        self._update_earlier()
        self._update_empty()
        self._place_context_divider()
        self._update_continue()

    def show_earlier(self) -> None:
        """Show the next batch of the conversation's earlier messages above the first
        card, keeping the message in view where it is."""
        if not self.earlier:
            return
        start = batch_start(self.earlier, len(self.earlier))
        batch = self.controller.with_steps(self.earlier[start:])
        del self.earlier[start:]
        if self.cards:
            self._anchor = (self.cards[0],
                            self.cards[0].y() - self.scroll.verticalScrollBar().value())
        self._follow = False
        self.column_layout.removeWidget(self.context_divider)  # (placed again below)
        at = self.column_layout.indexOf(self.cards[0]) if self.cards else \
            self.column_layout.count() - 1
        cards = [self._new_card(m) for m in batch]
        for i, card in enumerate(cards):
            self.column_layout.insertWidget(at + i, card)
            # now, not a moment later as for a widget added to a shown layout: Tab (and
            # Qt passing the focus on from the button) skips widgets not shown yet
            card.show()
        self.cards[:0] = cards
        # Tab goes from the button to the messages it brought, oldest first (they joined
        # the end of the window's chain: after the side panel)
        self._chain_after(self.earlier_button, cards)
        if not self.earlier and self.earlier_button.hasFocus():
            # the button goes: the keyboard moves to the oldest message, where Tab would
            # have gone next, and the view scrolls to it
            cards[0].focus_order()[0].setFocus(Qt.FocusReason.TabFocusReason)
            self._anchor = (cards[0], self.column_layout.contentsMargins().top())
        self._update_earlier()
        self._place_context_divider()
        self._update_continue()

    def _update_earlier(self) -> None:
        n = len(self.earlier)
        self.earlier_button.setText(
            f"Show Earlier Messages ({n} more)" if n != 1 else "Show Earlier Message")
        self.earlier_button.setAccessibleDescription(
            f"{n} earlier messages are not shown" if n != 1 else
            "1 earlier message is not shown")
        self.earlier_button.setVisible(bool(n))

    def _update_continue(self) -> None:
        """Offer Continue on the conversation's last message alone, when it is a reply cut
        short and nothing is being generated; say on an earlier reply's Regenerate that it
        replaces what follows."""
        busy = self.controller.generating
        for i, card in enumerate(self.cards):
            if card.message.role == "assistant":
                last = i == len(self.cards) - 1
                card.continue_button.setVisible(not busy and last and continuable(card.message))
                card.regenerate_button.setToolTip(REGENERATE_TIP if last
                                                  else REGENERATE_EARLIER_TIP)
        self._fit_headers()  # Continue coming or going changes what fits on one row

    def _place_context_divider(self) -> None:
        """Put the divider before the first message the newest reply read, when that reply
        left earlier ones out to fit the context window (`Stats.dropped_messages` counts
        the messages its request sent, from the oldest)."""
        self.column_layout.removeWidget(self.context_divider)
        self.context_divider.hide()
        for i in range(len(self.cards) - 1, -1, -1):
            card = self.cards[i]
            if card.message.role != "assistant":
                continue
            stats = card.live_stats or stats_from_dict(card.message.stats)
            if stats is None or not stats.dropped_messages:
                return
            # the messages not shown yet come first in what was sent
            hidden = sum(sent_to_model(m) for m in self.earlier)
            sent = [c for c in self.cards[:i] if sent_to_model(c.message)]
            if hidden <= stats.dropped_messages < hidden + len(sent):
                at = self.column_layout.indexOf(sent[stats.dropped_messages - hidden])
                self.column_layout.insertWidget(at, self.context_divider)
                self.context_divider.show()
            return

    def _new_card(self, message: Message) -> MessageCard:
        card = MessageCard(message, self)
        if self.text_font is not None:
            card.browser.setFont(self.text_font)
        card.copy_requested.connect(self._on_copy_requested)
        card.browser.code_copied.connect(lambda: self.copied.emit("Code copied"))
        card.browser.zoom_requested.connect(self.zoom_requested)
        card.edit_requested.connect(self._on_edit_requested)
        card.regenerate_requested.connect(self._on_regenerate_requested)
        card.continue_requested.connect(self.controller.continue_reply)
        return card

    def _append_card(self, message: Message) -> MessageCard:
        card = self._new_card(message)
        self.column_layout.insertWidget(self.column_layout.count() - 1, card)
        # Tab reaches the card after the one above it, before the composer (a new widget
        # joins the end of the window's chain: after the side panel)
        self._chain_after(self.cards[-1].focus_order()[-1] if self.cards
                          else self.earlier_button, [card])
        self.cards.append(card)
        return card

    @staticmethod
    def _chain_after(previous: QWidget, cards: list[MessageCard]) -> None:
        """Put `cards`' Tab stops, in order, right after `previous` in the window's chain."""
        for card in cards:
            for widget in card.focus_order():
                QWidget.setTabOrder(previous, widget)
                previous = widget

    def _update_empty(self) -> None:
        self.empty_label.setVisible(not self.cards)

    def _on_message_added(self, message: Message) -> None:
        if message.conversation_id != self.controller.conversation_id:
            return
        self._append_card(message)
        self._follow = True
        self._anchor = None
        self._update_empty()
        self._update_continue()

    def _on_step_received(self, message_id: int, step: Step, stats: Stats) -> None:
        card = self.card_for(message_id)
        if card is None:
            return
        first = card.live_stats is None
        card.add_step(step, stats)
        if first:
            self._place_context_divider()
        self._dirty.add(message_id)
        if not self._render_timer.isActive():  # (a refresh on its way is not put off)
            self._render_timer.start(self.refresh_delay_ms(card))

    def refresh_delay_ms(self, card: MessageCard) -> int:
        """How long a streaming card waits for its next refresh: none when its tokens are
        shown (each refresh adds only the new ones), longer the longer its Markdown is."""
        return 0 if self.show_speculation else markdown_refresh_ms(len(card.text()))

    def _render_dirty(self) -> None:
        for message_id in self._dirty:
            card = self.card_for(message_id)
            if card is not None:
                card.render()
        self._dirty.clear()

    def _on_reply_finished(self, message: Message) -> None:
        card = self.card_for(message.id)
        if card is not None:
            self._dirty.discard(message.id)
            card.finish(message)
        self._place_context_divider()
        self._update_continue()

    def _on_reply_discarded(self, message_id: int) -> None:
        card = self.card_for(message_id)
        if card is not None:
            self.cards.remove(card)
            self.column_layout.removeWidget(card)
            card.deleteLater()
        self._update_empty()
        self._place_context_divider()
        self._update_continue()

    def _on_regenerate_requested(self, message_id: int) -> None:
        """Regenerate a reply; an earlier one only once the user agrees to lose the
        messages after it (the last reply stays one click)."""
        card = self.card_for(message_id)
        if card is None or self.controller.generating:
            return
        later = len(self.cards) - 1 - self.cards.index(card)
        if later and not self._confirm_regenerate(later):
            return
        self.controller.regenerate(message_id)

    def _confirm_regenerate(self, later: int) -> bool:
        box = QMessageBox(QMessageBox.Icon.Question, "Regenerate Reply",
                          "Regenerate this reply?", parent=self)
        what = "the later message" if later == 1 else f"all {later} later messages"
        box.setInformativeText(f"This replaces it and everything after it: {what} "
                               "will be deleted.")
        box.setStandardButtons(QMessageBox.StandardButton.Yes
                               | QMessageBox.StandardButton.Cancel)
        box.button(QMessageBox.StandardButton.Yes).setText("Regenerate")
        box.setDefaultButton(QMessageBox.StandardButton.Cancel)
        return box.exec() == QMessageBox.StandardButton.Yes

    def _on_copy_requested(self, message_id: int) -> None:
        """Copy a message; its button says so for a moment (a copy is otherwise silent)."""
        card = self.card_for(message_id)
        if card is not None:
            QGuiApplication.clipboard().setText(card.text())
            card.flash_copied()
            self.copied.emit("Message copied")

    def _on_edit_requested(self, message_id: int) -> None:
        card = self.card_for(message_id)
        if card is not None:
            self.edit_requested.emit(message_id, card.text())

    # -- keep the newest text in view while streaming, unless the user scrolled up ------
    def _on_scrolled(self, value: int) -> None:
        bar = self.scroll.verticalScrollBar()
        self._follow = value >= bar.maximum() - 24
        if self._anchored_value() not in (None, value):
            self._anchor = None  # the user scrolled: the view is theirs again

    def _anchored_value(self) -> int | None:
        """Where the anchor card's offset puts the scroll bar (None without one, or once
        its card has gone)."""
        if self._anchor is None or self._anchor[0] not in self.cards:
            self._anchor = None
            return None
        card, offset = self._anchor
        return card.y() - offset

    def _on_range_changed(self, _min: int, maximum: int) -> None:
        bar = self.scroll.verticalScrollBar()
        anchored = self._anchored_value()
        if anchored is not None:
            bar.setValue(anchored)
        elif self._follow:
            bar.setValue(maximum)
