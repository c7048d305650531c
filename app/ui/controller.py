"""The chat controller: the GUI thread's glue between the views, the store and the engine.

It turns user intents (send, stop, regenerate, edit-and-resend, compare) into store writes
and `GenerationRequest`s for the engine thread, saves every step as it arrives (so a crash
loses at most the step in flight), and re-emits what the views need. It knows no widgets;
views get it in their `__init__` and connect to its signals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from PySide6.QtCore import QObject, Signal

from app.store import (
    COMPLETE,
    DEFAULT_TITLE,
    FAILED,
    INTERRUPTED,
    STOPPED,
    Message,
    Store,
    stats_from_dict,
)
from app.ui.worker import ChatSettings, EngineHost, GenerationRequest, ModelInfo
from engine.events import Finished, Stats, Step

TITLE_LENGTH = 48


@dataclass(frozen=True)
class ComparisonResult:
    """Speculative against plain decoding of one prompt with one seed."""

    speculative: Stats
    plain: Stats
    speculative_text: str
    plain_text: str

    @property
    def identical(self) -> bool:
        return self.speculative_text == self.plain_text

    @property
    def speedup(self) -> float:
        return self.speculative.decode_tps / self.plain.decode_tps if self.plain.decode_tps else 0.0


@dataclass
class _Reply:
    request: GenerationRequest
    message_id: int | None  # None for the comparison's plain run (not a chat message)
    conversation_id: int
    comparison: bool = False
    # a continuation: the reply as it stood, whose text and numbers the new run extends
    earlier: Message | None = None
    # this run's running totals, from its latest step: what a reply cut off by the app
    # closing keeps (the engine's Finished never arrives then)
    live: Stats | None = None
    # (done, total) of the prompt read so far (done counts a cached prefix too), for a
    # reply closed before its first token
    prompt: tuple[int, int] = (0, 0)
    # its conversation was deleted while it ran: the engine is stopping it, and what
    # still arrives is neither saved nor shown
    dropped: bool = False


def _earlier_stats(reply: _Reply) -> Stats | None:
    """The numbers a continued reply had before the run that did not finish (None for a
    new reply: it has none yet)."""
    return stats_from_dict(reply.earlier.stats) if reply.earlier is not None else None


def _stopped_stats(reply: _Reply) -> Stats:
    """The numbers of a reply stopped where it stands, without the engine's last word: its
    latest step's totals (after a continued reply's earlier ones), or, before its first
    token, what a Stop while the prompt is read saves (no tokens, the prompt read so far)."""
    done, total = reply.prompt
    live = reply.live or Stats(prompt_tokens=total, prefilled_tokens=done)
    live = replace(live, finish_reason="cancelled")
    before = _earlier_stats(reply)
    return before.then(live) if before is not None else live


def title_from(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), DEFAULT_TITLE)
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


def continuable(message: Message) -> bool:
    """Whether a reply was cut short (its token limit, Stop, a crash, an error after some
    text), so Continue may write on from its end."""
    if message.role != "assistant" or not message.content.strip():
        return False
    if message.status in (STOPPED, INTERRUPTED, FAILED):
        return True
    stats = stats_from_dict(message.stats)
    return message.status == COMPLETE and stats is not None and stats.finish_reason == "length"


def sent_to_model(message: Message) -> bool:
    """Whether a stored message is part of what a reply's request sends (a reply that
    failed before its first token has nothing to say)."""
    return bool(message.content) or message.role == "user"



def load_failure_text(spec: str, message: str) -> str:
    """The banner's words for a model that would not load. The engine's error names the
    file it is about (".../config.json: not found"); inside the model's folder that file
    is named from the folder, and one not found is not named again, so the banner names
    the model's path once."""
    if message.startswith(f"model {spec!r} "):  # "model '/x' not found: no folder at /x; …"
        message = message[len(f"model {spec!r} "):].replace(
            f"no folder at {Path(spec).expanduser()}", "no such folder", 1)
    for folder in dict.fromkeys((spec, str(Path(spec).expanduser().resolve()))):
        folder = folder.rstrip("/")
        if folder and message.startswith(f"{folder}/"):
            message = message[len(folder) + 1:]
            break
        if folder and message.startswith(f"{folder}:"):
            message = message[len(folder) + 1:].lstrip()
            break
    return f"Could not load model {spec!r}: {message}"

class ChatController(QObject):
    conversations_changed = Signal()
    conversation_opened = Signal(object)  # list[Message] of the newly current conversation
    message_added = Signal(object)  # Message (a user message or a new, empty reply)
    prompt_progressed = Signal(int, int)  # done, total
    step_received = Signal(int, object, object)  # message id, Step, Stats
    reply_finished = Signal(object)  # the final Message as stored
    reply_updated = Signal(object)  # a finished reply's Message again: its comparison joined it
    reply_discarded = Signal(int)  # message id of a reply that failed before its first step
    reply_resumed = Signal(object)  # the Message a continuation writes on (status generating)
    generating_changed = Signal(bool)
    error_raised = Signal(str)
    settings_changed = Signal(object)  # ChatSettings
    model_loading = Signal(str)
    model_load_progressed = Signal(int, int)  # weight bytes read, of total
    model_loaded = Signal(object)  # ModelInfo
    model_load_failed = Signal(str, str)  # spec, message (the model in use is unchanged)
    head_available = Signal(bool)  # whether the current target has a trained head
    comparison_started = Signal(str, str)  # speculative label, plain label
    plain_prompt_progressed = Signal(int, int)  # done, total of the plain run
    plain_step_received = Signal(object, object)  # Step, Stats of the plain run
    comparison_finished = Signal(object)  # ComparisonResult
    status_message = Signal(str)  # a passing note for the status bar (background work)

    def __init__(self, store: Store, host: EngineHost, settings: ChatSettings | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.host = host
        self.settings = settings or ChatSettings()
        self.conversation_id: int | None = None
        self.model: ModelInfo | None = None
        # the target to open when the first one fails to load (the app's demo model), so a
        # saved model that has gone away leaves a working app; None: stay without a model
        self.fallback_target: str | None = None
        self.has_head = False  # a trained head loads for the current target (head_available)
        self._reply: _Reply | None = None
        self._race_plain: _Reply | None = None  # a comparison's plain run, racing _reply
        self._spec_finished: Finished | None = None
        self._plain_finished: Finished | None = None
        self._spec_message_id: int | None = None
        w = host.worker
        w.model_loading.connect(self._on_model_loading)
        w.model_loaded.connect(self._on_model_loaded)
        w.head_available.connect(self._on_head_available)
        w.model_load_progressed.connect(self._on_model_load_progressed)
        w.model_load_failed.connect(self._on_model_load_failed)
        w.prompt_progressed.connect(self._on_prompt_progressed)
        w.step_generated.connect(self._on_step_generated)
        w.generation_finished.connect(self._on_generation_finished)
        w.generation_failed.connect(self._on_generation_failed)
        w.finetune_started.connect(self._on_finetune_started)
        w.finetune_ended.connect(self._on_finetune_ended)
        w.online_warned.connect(self.status_message)

    # -- state ---------------------------------------------------------------------------
    @property
    def generating(self) -> bool:
        return self._reply is not None or self._race_plain is not None

    @property
    def comparing(self) -> bool:
        """Whether what is generating is a comparison's race (not a plain chat reply)."""
        return self._race_plain is not None or (self._reply is not None and self._reply.comparison)

    @property
    def generating_conversation_id(self) -> int | None:
        """The conversation whose reply is being written (None when none is, or only one
        of a deleted conversation is still stopping)."""
        for reply in (self._reply, self._race_plain):
            if reply is not None and not reply.dropped:
                return reply.conversation_id
        return None

    @property
    def generating_here(self) -> bool:
        """Whether the reply being written is the open conversation's (Stop is offered
        there alone: elsewhere it would end a reply out of view)."""
        running = self.generating_conversation_id
        return running is not None and running == self.conversation_id

    @property
    def current_request(self) -> GenerationRequest | None:
        """The request the engine is working on (its `cancel` event is what Stop sets)."""
        return self._reply.request if self._reply else None

    def load_model(self, spec: str | None = None) -> None:
        if spec is not None and spec != self.settings.target:
            self.settings = replace(self.settings, target=spec)
            self.settings_changed.emit(self.settings)
        self.host.load(self.settings.target)

    def set_settings(self, settings: ChatSettings) -> None:
        old = self.settings
        if settings == old:
            return
        self.settings = settings
        self.settings_changed.emit(settings)
        if settings.target != old.target:
            self.host.load(settings.target)

    # -- conversations -------------------------------------------------------------------
    def new_conversation(self) -> None:
        """Show an empty chat. It is saved with its first message (`send`), so clicking
        New chat again, or leaving it, leaves no empty chats behind."""
        self.open_conversation(None)

    def open_conversation(self, conversation_id: int | None) -> None:
        """Make a conversation current; its messages go out without their steps (a long
        chat holds hundreds of thousands of tokens): a view reads the steps of those it
        shows (`with_steps`)."""
        self.conversation_id = conversation_id
        msgs = (self.store.messages(conversation_id, with_steps=False)
                if conversation_id is not None else [])
        self.conversation_opened.emit(msgs)

    def with_steps(self, messages: Sequence[Message]) -> list[Message]:
        """`messages` with their replies' steps (token fates) read from the store."""
        return [replace(m, steps=self.store.steps(m.id)) if m.role == "assistant" else m
                for m in messages]

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        self.store.rename_conversation(conversation_id, title)
        self.conversations_changed.emit()

    def delete_conversation(self, conversation_id: int) -> None:
        """Delete a conversation at once; a reply running in it is stopped, and what the
        engine sends before it stops is dropped (its message no longer exists)."""
        for reply in (self._reply, self._race_plain):
            if reply is not None and reply.conversation_id == conversation_id:
                reply.dropped = True
                self.host.cancel(reply.request.request_id)
        self.store.delete_conversation(conversation_id)
        self.conversations_changed.emit()
        if conversation_id == self.conversation_id:
            remaining = self.store.conversations()
            self.open_conversation(remaining[0].id if remaining else None)

    def messages(self) -> list[Message]:
        """The open conversation's messages, without their steps."""
        return (self.store.messages(self.conversation_id, with_steps=False)
                if self.conversation_id else [])

    # -- intents -------------------------------------------------------------------------
    def send(self, text: str, *, compare: bool = False, reference: str = "") -> bool:
        """Add a user message and start the reply (and, with `compare`, the plain run).
        `reference`: text the reply may repeat, which prompt lookup drafts from."""
        if not text.strip() or self.generating:
            return False
        if self.conversation_id is None or self.store.conversation(self.conversation_id) is None:
            conv = self.store.create_conversation(title_from(text))
            self.conversation_id = conv.id
            self.conversation_opened.emit([])
        elif not self.store.messages(self.conversation_id, with_steps=False):
            self.store.rename_conversation(self.conversation_id, title_from(text))
        msg = self.store.add_message(self.conversation_id, "user", text)
        self.message_added.emit(msg)
        self.conversations_changed.emit()
        self._start_reply(compare, reference)
        return True

    def stop(self) -> None:
        """Stop the reply in flight within one step (and a comparison's plain run)."""
        for reply in (self._reply, self._race_plain):
            if reply is not None:
                self.host.cancel(reply.request.request_id)

    def close(self) -> None:
        """The app is closing (or crashed): stop, and record a reply in flight as stopped,
        not crashed, with the numbers of what it wrote (the engine's Finished would come
        too late).

        A reply closed while its prompt was read is kept as Stop keeps it then: empty,
        stopped, no tokens; a continuation that wrote nothing stays as it was."""
        was_generating = self.generating
        self.stop()
        reply, self._reply, self._race_plain = self._reply, None, None
        if reply is not None and reply.message_id is not None and not reply.dropped:
            if reply.earlier is not None and reply.live is None:
                self.store.finish_reply(reply.message_id, status=reply.earlier.status,
                                        stats=_earlier_stats(reply), error=reply.earlier.error)
            else:
                self.store.finish_reply(reply.message_id, status=STOPPED,
                                        stats=_stopped_stats(reply))
            self.reply_finished.emit(self.store.message(reply.message_id))
        if was_generating:
            self.generating_changed.emit(False)

    def regenerate(self, message_id: int) -> bool:
        """Drop an assistant reply (and anything after it) and generate it again. The new
        reply is drafted from the old one where it repeats it (prompt lookup's reference):
        another temperature, seed or system prompt often changes only part of a reply."""
        msg = self.store.message(message_id, with_steps=False)
        if msg is None or msg.role != "assistant" or self.generating:
            return False
        self.store.delete_messages_from(msg.conversation_id, msg.position)
        self.open_conversation(msg.conversation_id)
        self._start_reply(compare=False, reference=msg.content)
        return True

    def last_continuable(self) -> int | None:
        """The id of the conversation's last message when Continue may write on from it
        (a reply cut short, nothing generating), else None."""
        if self.generating or self.conversation_id is None:
            return None
        messages = self.store.messages(self.conversation_id, with_steps=False)
        return messages[-1].id if messages and continuable(messages[-1]) else None

    def continue_reply(self, message_id: int) -> bool:
        """Write on from the end of the conversation's last reply, when it was cut short
        (`continuable`): the new text and steps extend the same message."""
        msg = self.store.message(message_id, with_steps=False)
        if msg is None or self.generating or not continuable(msg):
            return False
        last = self.store.messages(msg.conversation_id, with_steps=False)[-1]
        if last.id != msg.id:
            return False
        if msg.conversation_id != self.conversation_id:
            self.open_conversation(msg.conversation_id)
        self.store.resume_reply(msg.id)  # (drops a cut character's mark from its end)
        resumed = self.store.message(msg.id)
        assert resumed is not None
        self.reply_resumed.emit(resumed)
        request = GenerationRequest(self.host.new_request_id(), self._engine_messages(),
                                    self.settings, continue_final=True)
        earlier = replace(msg, content=resumed.content)
        self._reply = _Reply(request, msg.id, msg.conversation_id, earlier=earlier)
        self._spec_finished = self._plain_finished = None
        self.generating_changed.emit(True)
        self.host.generate(request)
        return True

    def edit_and_resend(self, message_id: int, text: str) -> bool:
        """Replace a user message (dropping what followed it) and reply to the new text,
        drafting from the reply the old text got where the new one repeats it."""
        msg = self.store.message(message_id, with_steps=False)
        if msg is None or msg.role != "user" or self.generating or not text.strip():
            return False
        later = [m for m in self.store.messages(msg.conversation_id, with_steps=False)
                 if m.position > msg.position]
        old_reply = later[0].content if later and later[0].role == "assistant" else ""
        self.store.delete_messages_from(msg.conversation_id, msg.position)
        self.open_conversation(msg.conversation_id)
        return self.send(text, reference=old_reply)

    def last_prompt(self) -> Message | None:
        """The open conversation's last user message: what Replay runs again (None in an
        empty chat)."""
        if self.conversation_id is None:
            return None
        msgs = self.store.messages(self.conversation_id, with_steps=False)
        return next((m for m in reversed(msgs) if m.role == "user"), None)

    def replay_comparison(self) -> bool:
        """Run the conversation's last prompt again both ways (replacing the last reply)."""
        prompt = self.last_prompt() if not self.generating else None
        if prompt is None or self.conversation_id is None:
            return False
        self.store.delete_messages_from(self.conversation_id, prompt.position + 1)
        self.open_conversation(self.conversation_id)
        self._start_reply(compare=True)
        return True

    # -- requests ------------------------------------------------------------------------
    def _engine_messages(self) -> tuple[dict[str, str], ...]:
        out: list[dict[str, str]] = []
        if self.settings.system_prompt.strip():
            out.append({"role": "system", "content": self.settings.system_prompt})
        for m in self.store.messages(self.conversation_id, with_steps=False):
            if not sent_to_model(m):
                continue
            if m.role == "user" and out and out[-1]["role"] == "user":
                # the reply between them failed before its first token: one turn, as
                # chat templates that require alternating roles refuse two in a row
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{m.content}"}
            else:
                out.append({"role": m.role, "content": m.content})
        return tuple(out)

    def _start_reply(self, compare: bool, reference: str = "") -> None:
        assert self.conversation_id is not None
        settings = self.settings
        messages = self._engine_messages()
        reply_msg = self.store.begin_reply(self.conversation_id, model=settings.target,
                                           settings=settings.as_dict())
        self.message_added.emit(reply_msg)
        # a comparison races on equal terms: neither side gets the old reply to copy
        request = GenerationRequest(self.host.new_request_id(), messages, settings,
                                    reference="" if compare else reference)
        self._reply = _Reply(request, reply_msg.id, self.conversation_id, comparison=compare)
        self._spec_finished = self._plain_finished = None
        self.generating_changed.emit(True)
        if not compare:
            self.host.generate(request)
            return
        plain = GenerationRequest(self.host.new_request_id(), messages, settings, plain=True)
        self._race_plain = _Reply(plain, None, self.conversation_id, comparison=True)
        spec_label = f"Speculative ({settings.drafter}, K {settings.k or 'auto'})"
        self.comparison_started.emit(spec_label, "Plain decoding")
        self.host.race(request, plain)

    def _which(self, request_id: int) -> _Reply | None:
        """The reply (the chat's, or a comparison's plain run) a request id belongs to."""
        for reply in (self._reply, self._race_plain):
            if reply is not None and reply.request.request_id == request_id:
                return reply
        return None

    def _forget(self, reply: _Reply) -> None:
        """A reply whose conversation was deleted has ended: nothing is left to save."""
        if reply is self._reply:
            self._reply = None
        if reply is self._race_plain:
            self._race_plain = None
        self._spec_finished = self._plain_finished = None  # a deleted race compares nothing
        self._idle_if_done()

    def _on_prompt_progressed(self, request_id: int, done: int, total: int) -> None:
        reply = self._which(request_id)
        if reply is None or reply.dropped:
            return
        if reply.message_id is None:
            self.plain_prompt_progressed.emit(done, total)
        else:
            reply.prompt = (done, total)
            self.prompt_progressed.emit(done, total)

    def _on_step_generated(self, request_id: int, step: Step, stats: Stats) -> None:
        reply = self._which(request_id)
        if reply is None or reply.dropped:
            return
        if reply.message_id is None:
            self.plain_step_received.emit(step, stats)
            return
        self.store.append_step(reply.message_id, step)
        reply.live = stats
        self.step_received.emit(reply.message_id, step, stats)

    def _on_generation_finished(self, request_id: int, finished: Finished) -> None:
        reply = self._which(request_id)
        if reply is None:
            return
        if reply.dropped:
            self._forget(reply)
            return
        if reply.message_id is None:
            self._race_plain = None
            self._plain_finished = finished
        else:
            self._reply = None
            cancelled = finished.stats.finish_reason == "cancelled"
            stats, text = finished.stats, finished.text
            if reply.earlier is not None:
                before = _earlier_stats(reply)
                stats = before.then(stats) if before is not None else stats
                text = reply.earlier.content + text
            self.store.finish_reply(reply.message_id, status=STOPPED if cancelled else COMPLETE,
                                    stats=stats, text=text)
            self.reply_finished.emit(self.store.message(reply.message_id))
            self.conversations_changed.emit()
            if reply.comparison:
                self._spec_finished = finished
                self._spec_message_id = reply.message_id
        self._finish_comparison()
        self._idle_if_done()

    def _on_generation_failed(self, request_id: int, message: str) -> None:
        reply = self._which(request_id)
        if reply is None:
            return
        if reply.dropped:
            self._forget(reply)
            return
        cancelled = reply.request.cancel.is_set()
        if reply.message_id is None:
            self._race_plain = None
            # a failed race fails both runs: the chat reply's banner already says why
            if not cancelled and self._spec_finished is not None:
                self.error_raised.emit(message)
            self._idle_if_done()
            return
        self._reply = None
        msg = self.store.message(reply.message_id)
        if msg is not None and not msg.steps:
            self.store.delete_messages_from(msg.conversation_id, msg.position)
            self.reply_discarded.emit(reply.message_id)
        elif (msg is not None and reply.earlier is not None
              and msg.content == reply.earlier.content):
            # a continuation that wrote nothing: the reply stays as it was
            self.store.finish_reply(msg.id, status=reply.earlier.status,
                                    stats=_earlier_stats(reply), error=reply.earlier.error)
            self.reply_finished.emit(self.store.message(msg.id))
        else:
            self.store.finish_reply(reply.message_id, status=STOPPED if cancelled else FAILED,
                                    stats=_earlier_stats(reply), error=message)
            self.reply_finished.emit(self.store.message(reply.message_id))
        if not cancelled:
            self.error_raised.emit(message)
        self._idle_if_done()

    def _finish_comparison(self) -> None:
        """Once both runs of a race have finished: save and announce the comparison."""
        spec, plain = self._spec_finished, self._plain_finished
        if spec is None or plain is None or self._spec_message_id is None:
            return
        self._spec_finished = self._plain_finished = None
        if "cancelled" in (spec.stats.finish_reason, plain.stats.finish_reason):
            return  # a stopped race compares nothing
        result = ComparisonResult(spec.stats, plain.stats, spec.text, plain.text)
        self.store.set_comparison(self._spec_message_id, {
            "plain_decode_tps": plain.stats.decode_tps,
            "speculative_decode_tps": spec.stats.decode_tps,
            "speedup": result.speedup,
            "identical": result.identical,
            "plain_finish_reason": plain.stats.finish_reason,
        })
        self.reply_updated.emit(self.store.message(self._spec_message_id))
        self.comparison_finished.emit(result)

    def _idle_if_done(self) -> None:
        if not self.generating:
            self.generating_changed.emit(False)

    # -- learning from the user's chats (opt-in) -------------------------------------------
    def _on_finetune_started(self) -> None:
        self.status_message.emit("Improving the drafter from your chats…")

    def _on_finetune_ended(self, last, error: str) -> None:
        if error:
            self.status_message.emit(f"Could not improve the drafter from your chats: {error}")
        elif last is not None and last.new_checkpoint:
            top1 = (f", held-out top-1 {last.heldout_top1:.0%}"
                    if last.heldout_top1 is not None else "")
            self.status_message.emit(f"Drafter improved from your chats ({last.step} steps"
                                     f"{top1})")

    # -- model state ---------------------------------------------------------------------
    def _on_model_loading(self, spec: str) -> None:
        self.model_loading.emit(spec)

    def _on_model_load_progressed(self, _spec: str, done: int, total: int) -> None:
        self.model_load_progressed.emit(done, total)

    def _on_model_loaded(self, info: ModelInfo) -> None:
        if info.spec == self.settings.target:
            self.model = info
        self.model_loaded.emit(info)

    def _on_head_available(self, spec: str, available: bool) -> None:
        if spec == self.settings.target:
            self.has_head = available
            self.head_available.emit(available)

    def _on_model_load_failed(self, spec: str, message: str) -> None:
        """A target that failed to load gives way to the one loaded before it (still in
        memory, or loaded again), or at start to `fallback_target`: the app stays usable.
        A draft's failure is the failed reply's message, said there."""
        self.model_load_failed.emit(spec, message)
        if spec != self.settings.target:
            return
        said = load_failure_text(spec, message)
        if self.model is not None and self.model.spec != spec:
            previous, said = self.model.spec, f"{said} — still using {self.model.name}."
        elif self.fallback_target not in (None, spec):
            previous, said = self.fallback_target, f"{said} — opening {self.fallback_target!r} instead."
        else:
            previous = None
        self.error_raised.emit(said)
        if previous is not None:
            self.load_model(previous)
