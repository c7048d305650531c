"""The engine worker: the one thread that makes every MLX call for the life of the app.

MLX streams are thread-local, so a model must be used on the thread that loaded it. One
`EngineWorker` QObject lives on one QThread; the GUI talks to it only through queued
signals (`EngineHost` holds the thread and forwards requests) and receives one signal per
target pass (`step_generated`), never one per character. Stop is a `threading.Event` the
request carries: the GUI sets it directly, the engine checks it between steps, and the
worker stops reading after the step in flight. Engine errors come back as readable
messages (`generation_failed`, `model_load_failed`), never as exceptions in the GUI.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from PySide6.QtCore import QObject, QThread, QTimer, Signal, Slot

from engine.errors import EngineError
from engine.events import Finished, PromptProgress, Step

log = logging.getLogger(__name__)

DRAFTER_MODES = ("off", "model", "ngram", "layerskip", "head", "auto")
NO_DRAFT_MODEL = ("The model drafter needs a draft model: pick one under Draft model in the "
                  "side panel, or choose another drafter.")
# Quit waits this long for the engine thread: a reply stops at its next step, but a model
# load or a calibration cannot be interrupted (the app then leaves without it: app.ui.gui)
ENGINE_STOP_MS = 10_000
# A race's turn: long enough that a turn's fixed cost (building the first pass with the
# machine idle, waiting for the last) stays a small share, short enough to look live.
RACE_TURN_S = 0.5
# "Improve the drafter from my chats": a short fine-tune once the chats have added this
# many recorded positions since the head last trained (a few dozen replies)
FINETUNE_AFTER = 2000


@dataclass(frozen=True)
class ChatSettings:
    """What the settings panel controls; saved with every reply it produced."""

    target: str = "demo"
    draft: str | None = None  # a draft model spec, used when drafter == "model" (or "auto")
    drafter: str = "auto"  # one of DRAFTER_MODES; "off" is plain decoding
    k: int | None = None  # draft length; None = adaptive
    accept: str = "coupled"
    tree: str = "auto"  # draft trees: "auto" (where they pay) or "off" (chains)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # 1 = off. Small models at temperature 0 fall into loops a mild penalty (1.1) breaks;
    # it is off by default because it also penalizes what code edits must repeat
    repetition_penalty: float = 1.0
    max_tokens: int = 512
    seed: int = 0
    system_prompt: str = ""
    # opt-in (they keep features of the user's chats on disk): record replies for drafter
    # training, and fine-tune the head from them in the background (records as well)
    learn_from_chats: bool = False
    improve_drafter: bool = False

    @property
    def records_chats(self) -> bool:
        return self.learn_from_chats or self.improve_drafter

    @property
    def engine_drafter(self) -> str:
        return "none" if self.drafter == "off" else self.drafter

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ChatSettings:
        """Tolerant of unknown, missing and unusable keys (settings saved by other versions,
        or edited by hand): a value of the wrong type or outside its range is dropped with a
        warning naming it, and that setting keeps its default. One bad value used to stop
        the app at start-up."""
        kept = {}
        for f in fields(cls):
            if f.name not in (d or {}):
                continue
            value = d[f.name]
            if _usable(f.name, value):
                kept[f.name] = value
            else:
                log.warning("saved setting %s = %r is not usable; using %r", f.name, value,
                            f.default)
        return cls(**kept)

    def to_options(self, *, plain: bool = False):
        """The engine's GenerateOptions for these settings (`plain` forces no drafter)."""
        from engine.decode import GenerateOptions
        from engine.sampling import SamplingParams

        sampling = SamplingParams(temperature=self.temperature, top_k=self.top_k,
                                  top_p=self.top_p, min_p=self.min_p,
                                  repetition_penalty=self.repetition_penalty, seed=self.seed)
        return GenerateOptions(max_tokens=self.max_tokens, sampling=sampling,
                               drafter="none" if plain else self.engine_drafter,
                               k=self.k, accept=self.accept, tree=self.tree)


# the panel's range for the repetition penalty: 1 (off) and up, as other chat apps offer it;
# the engine takes any positive value, but a saved one the panel cannot show would be used
# while the panel said otherwise
REPEAT_PENALTY_RANGE = (1.0, 3.0)

# settings the engine never sees as such (the rest are checked by the engine's own rules)
TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "target": lambda v: isinstance(v, str) and bool(v),
    "draft": lambda v: v is None or isinstance(v, str),
    "drafter": lambda v: isinstance(v, str) and v in DRAFTER_MODES,  # the panel's words
    "system_prompt": lambda v: isinstance(v, str),
    "learn_from_chats": lambda v: isinstance(v, bool),
    "improve_drafter": lambda v: isinstance(v, bool),
    "repetition_penalty": lambda v: (isinstance(v, int | float) and not isinstance(v, bool)
                                     and REPEAT_PENALTY_RANGE[0] <= v <= REPEAT_PENALTY_RANGE[1]),
}


def _usable(name: str, value: Any) -> bool:
    """Whether a saved setting can stand: by its type, or by the engine's own checks of the
    options it becomes (GenerateOptions, SamplingParams), so the ranges live in one place."""
    check = TYPE_CHECKS.get(name)
    if check is not None:
        return check(value)
    try:
        replace(ChatSettings(), **{name: value}).to_options()
    except (EngineError, TypeError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class GenerationRequest:
    """One reply to generate. `cancel` is shared with the GUI, which sets it on Stop."""

    request_id: int
    messages: tuple[dict[str, str], ...]
    settings: ChatSettings
    cancel: threading.Event = field(default_factory=threading.Event)
    plain: bool = False  # the comparison's plain-decoding run
    continue_final: bool = False  # write on from the end of the last (assistant) message
    # text the reply may repeat (the reply it replaces): prompt lookup drafts from it
    reference: str = ""


@dataclass(frozen=True)
class ModelInfo:
    """What the GUI may know about a loaded model (never the model itself)."""

    spec: str
    name: str
    path: str
    model_type: str
    backend: str
    template_warning: str | None = None
    context_window: int = 0  # tokens the model reads at most (0: unknown)


class EngineWorker(QObject):
    """Loads models and generates replies; lives on the engine thread (see EngineHost)."""

    model_loading = Signal(str)  # spec
    model_load_progressed = Signal(str, int, int)  # spec, weight bytes read, of total
    model_loaded = Signal(object)  # ModelInfo
    head_available = Signal(str, bool)  # target spec, whether a trained head loads for it
    model_load_failed = Signal(str, str)  # spec, message
    doctor_reported = Signal(object)  # list[str]: `understudy doctor`'s report lines
    generation_started = Signal(int)  # request id
    prompt_progressed = Signal(int, int, int)  # request id, tokens done, total
    step_generated = Signal(int, object, object)  # request id, Step, Stats after it
    generation_finished = Signal(int, object)  # request id, Finished
    generation_failed = Signal(int, str)  # request id, message
    training_progressed = Signal(object)  # engine.training.job.TrainProgress
    training_ended = Signal(object, str)  # the last TrainProgress (or None), error message
    finetune_started = Signal()  # a background fine-tune from the user's chats began
    finetune_ended = Signal(object, str)  # its last TrainProgress (or None), error message
    online_warned = Signal(str)  # a problem with the online training buffer (one line)

    def __init__(self) -> None:
        super().__init__()
        self._target_spec: str | None = None
        self._target = None  # LoadedModel
        self._drafts: dict[str, Any] = {}  # spec -> LoadedModel
        self._sessions: dict[str | None, Any] = {}  # draft spec -> ChatSession on the target
        self._head: tuple[str, Any] | None = None  # (target spec, its trained head or None)
        self._training: Any = None  # the train_drafter generator while a job runs
        self._background = False  # whether that job is a fine-tune the app started itself
        self._last_progress: Any = None
        self._online: tuple[tuple[str, tuple[int, ...]], Any] | None = None  # key, buffer
        self.finetune_after = FINETUNE_AFTER  # recorded positions between fine-tunes
        self.finetune_steps: int | None = None  # steps of one fine-tune; None: the default

    # -- loading -------------------------------------------------------------------------
    @Slot(str)
    def load_target(self, spec: str) -> None:
        """Load `spec` as the target (a no-op when it is already loaded); a failure is
        `model_load_failed`, said by `_ensure_target`."""
        with contextlib.suppress(ModelLoadFailed):
            self._ensure_target(spec)

    def _ensure_target(self, spec: str) -> None:
        if self._target is not None and self._target_spec == spec:
            return
        self.model_loading.emit(spec)
        with self._load_failures_said(spec):
            if self._target is not None:
                # a folder that cannot load (a bad config.json, no tokenizer) fails here,
                # before the model in use is let go, so it stays loaded and answering
                _check_loadable(spec)
            self._target = self._target_spec = None
            self._sessions.clear()
            self._head = None
            self._close_online()
            loaded = self._load(spec)
        self._target, self._target_spec = loaded, spec
        self.model_loaded.emit(_model_info(spec, loaded))
        self._say_head_available()

    @contextlib.contextmanager
    def _load_failures_said(self, spec: str) -> Iterator[None]:
        """Turn a failed load into `model_load_failed` (the GUI said "Loading…" for it,
        whether a load, a reply or the server asked), raised on as `ModelLoadFailed`."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - any failure becomes a message, not a crash
            message = _describe(exc)
            self.model_load_failed.emit(spec, message)
            raise ModelLoadFailed(message) from exc

    def _say_head_available(self) -> None:
        """Tell the GUI whether `head` can draft for the loaded target (so the drafter list
        offers it only then); loads the head the first reply would load anyway."""
        if self._target is not None and self._target_spec is not None:
            self.head_available.emit(str(self._target_spec), self._trained_head() is not None)

    def _draft_model(self, spec: str):
        """The draft model for `spec`, loaded once. Its tokenizer is checked against the
        target's first (their files only), so a draft that cannot draft for the target is
        refused before its weights are read and never reported as ready."""
        if spec not in self._drafts:
            from engine.compat import require_compatible
            from engine.loading import resolve_model_path

            require_compatible(self._target.path, resolve_model_path(spec))
            self.model_loading.emit(spec)
            self._drafts.clear()  # keep one draft in memory at a time
            with self._load_failures_said(spec):
                self._drafts[spec] = self._load(spec)
            self.model_loaded.emit(_model_info(spec, self._drafts[spec]))
        return self._drafts[spec]

    def _load(self, spec: str):
        """load_model, reporting the weights read at most once per 0.1% of them."""
        from engine.loading import load_model

        last = -1

        def progressed(done: int, total: int) -> None:
            nonlocal last
            permille = done * 1000 // max(total, 1)
            if permille != last:
                last = permille
                self.model_load_progressed.emit(spec, done, total)

        return load_model(spec, on_progress=progressed)

    def _session(self, settings: ChatSettings, plain: bool):
        """The ChatSession for this target and draft pairing (kept across turns)."""
        from engine.decode import ChatSession

        if not plain and settings.drafter == "model" and not settings.draft:
            raise EngineError(NO_DRAFT_MODEL)  # (the engine's words are the command line's)
        self._ensure_target(settings.target)
        wants_draft = not plain and settings.drafter in ("model", "auto") and settings.draft
        key = settings.draft if wants_draft else None
        if key not in self._sessions:
            draft = self._draft_model(key) if key else None
            self._sessions[key] = ChatSession(self._target, draft, self._trained_head())
        return self._sessions[key]

    def _trained_head(self):
        """The target's trained drafter head, if any (every session carries it, so that
        `head` and `auto` can use it; a broken one is logged and left out)."""
        from engine.drafters.head_io import usable_head

        if self._head is None or self._head[0] != self._target_spec:
            self._head = (str(self._target_spec), usable_head(self._target, log.warning))
        return self._head[1]

    # -- recording chats for drafter training (opt-in) -----------------------------------
    def _chat_session(self, settings: ChatSettings, plain: bool):
        """The session for a chat reply, recording it when the user opted in."""
        session = self._session(settings, plain)
        session.set_online(self._online_buffer(session) if settings.records_chats else None)
        return session

    def _online_buffer(self, session):
        """The target's online buffer for the session's feature layers (opened once)."""
        from engine.training.online import open_buffer

        key = (str(self._target_spec), tuple(session.feature_layers))
        if self._online is None or self._online[0] != key:
            self._close_online()
            self._online = (key, open_buffer(session.target.path, key[1],
                                             on_problem=self.online_warned.emit))
        return self._online[1]

    def _close_online(self) -> None:
        if self._online is not None:
            self._online[1].close()  # what was recorded reaches the disk
            self._online = None

    def _maybe_finetune(self, settings: ChatSettings) -> None:
        """After a reply: with "Improve the drafter from my chats" on, a head for this
        target, and enough new recorded positions since it last trained, start a short
        fine-tune from them (between replies, like the training window's job)."""
        from engine.drafters.head_io import current_checkpoint, head_root, read_record
        from engine.training.job import JOB_LOCK, finetune_options, train_drafter
        from engine.training.locks import held_elsewhere
        from engine.training.online import due_for_finetune

        if not settings.improve_drafter or self._training is not None or self._online is None:
            return
        if self._trained_head() is None:
            return
        buffer = self._online[1]
        root = head_root(self._target.path)
        if held_elsewhere(root / JOB_LOCK):
            return  # another job (the CLI's) is training this head: its checkpoints count
        ckpt = current_checkpoint(root)
        record = read_record(ckpt) if ckpt is not None else None
        if not due_for_finetune(buffer, record, self.finetune_after):
            return
        try:
            buffer.flush()
            self._training = train_drafter(self._target, finetune_options(self.finetune_steps),
                                           threading.Event())
        except Exception as exc:  # noqa: BLE001 - any failure becomes a message
            self.finetune_ended.emit(None, _describe(exc))
            return
        self._background = True
        self._last_progress = None
        self.finetune_started.emit()
        QTimer.singleShot(0, self._train_slice)

    # -- training a drafter head ---------------------------------------------------------
    @Slot(str, float, object)
    def train_drafter(self, spec: str, minutes: float, cancel: threading.Event) -> None:
        """Start training a head for `spec`, one short slice per event-loop turn: a reply
        requested meanwhile runs between two slices (training pauses while it is written)."""
        from engine.training.job import TrainOptions, train_drafter

        if self._training is not None and self._background:
            self._training.close()  # the user's job replaces a background fine-tune
            self._training, self._background = None, False
        if self._training is not None:
            return
        try:
            self._ensure_target(spec)
            options = TrainOptions(minutes=minutes, gen_batch=8, max_new=128)
            self._training = train_drafter(self._target, options, cancel)
            self._last_progress = None
        except Exception as exc:  # noqa: BLE001 - any failure becomes a message
            self.training_ended.emit(None, _describe(exc))
            return
        QTimer.singleShot(0, self._train_slice)

    def _train_slice(self) -> None:
        if self._training is None:
            return
        try:
            progress = next(self._training)
        except StopIteration:
            self._end_training("")
            return
        except Exception as exc:  # noqa: BLE001
            self._end_training(_describe(exc))
            return
        self._last_progress = progress
        if not self._background:
            self.training_progressed.emit(progress)
        QTimer.singleShot(0, self._train_slice)

    def _end_training(self, error: str) -> None:
        background = self._background
        self._training, self._background = None, False
        self._sessions.clear()  # the next reply's session picks up the new head
        self._head = None
        self._say_head_available()
        if background:
            self.finetune_ended.emit(self._last_progress, error)
        else:
            self.training_ended.emit(self._last_progress, error)

    # -- generation ----------------------------------------------------------------------
    @Slot(object)
    def generate(self, request: GenerationRequest) -> None:
        """Run one request to its end, emitting one signal per event."""
        rid = request.request_id
        if request.cancel.is_set():  # stopped while waiting in the queue
            self.generation_failed.emit(rid, "cancelled before it started")
            return
        try:
            session = self._chat_session(request.settings, request.plain)
            options = replace(request.settings.to_options(plain=request.plain),
                              reference=request.reference)
            self.generation_started.emit(rid)
            events = session.generate(list(request.messages), options, request.cancel,
                                      continue_final=request.continue_final)
            finished = None
            try:
                for event in events:
                    if isinstance(event, Step):
                        self.step_generated.emit(rid, event, session.stats)
                    elif isinstance(event, PromptProgress):
                        self.prompt_progressed.emit(rid, event.done, event.total)
                    elif isinstance(event, Finished):
                        finished = event
            finally:
                events.close()
            if finished is None:
                raise EngineError("the engine stopped without finishing the reply")
            self.generation_finished.emit(rid, finished)
        except Exception as exc:  # noqa: BLE001 - any failure becomes a banner, not a crash
            self.generation_failed.emit(rid, _describe(exc))
            return
        self._maybe_finetune(request.settings)

    @Slot(object, object)
    def race(self, spec: GenerationRequest, plain: GenerationRequest) -> None:
        """Speculative and plain decoding of one request side by side, so the user watches
        both texts arrive: they take turns of RACE_TURN_S on this thread (`engine.turns`),
        and each one's Stats count only its own turns' time, so the gauges and the speedup
        compare the two on the same machine load."""
        from engine.decode import ChatSession
        from engine.turns import take_turns

        requests = {"spec": spec, "plain": plain}
        if spec.cancel.is_set():
            for r in requests.values():
                self.generation_failed.emit(r.request_id, "cancelled before it started")
            return
        ended: set[str] = set()
        streams: dict[str, Any] = {}
        try:
            # plain decoding gets caches of its own for the race, freed when it ends (the
            # chat's session may be this very object when no draft model is loaded)
            sessions = {"spec": self._chat_session(spec.settings, False),
                        "plain": ChatSession(self._target)}
            for name, r in requests.items():
                self.generation_started.emit(r.request_id)
                streams[name] = sessions[name].generate(
                    list(r.messages), r.settings.to_options(plain=r.plain), r.cancel)
            turns = take_turns(streams, lambda _steps, seconds: seconds >= RACE_TURN_S)
            try:
                for turn in turns:
                    rid, ev = requests[turn.name].request_id, turn.event
                    if isinstance(ev, Step):
                        stats = replace(sessions[turn.name].stats, decode_s=turn.own_s)
                        self.step_generated.emit(rid, ev, stats)
                    elif isinstance(ev, PromptProgress):
                        self.prompt_progressed.emit(rid, ev.done, ev.total)
                    else:
                        ended.add(turn.name)
                        stats = replace(ev.stats, decode_s=turn.own_s)
                        self.generation_finished.emit(rid, replace(ev, stats=stats))
            finally:
                turns.close()
        except Exception as exc:  # noqa: BLE001 - any failure becomes a banner, not a crash
            message = _describe(exc)
            for name, r in requests.items():
                if name not in ended:
                    self.generation_failed.emit(r.request_id, message)
        finally:
            for events in streams.values():
                events.close()  # trims the caches to what each reply committed
        if "spec" in ended:
            self._maybe_finetune(spec.settings)

    @Slot(bool)
    def run_doctor(self, recheck: bool) -> None:
        """`understudy doctor` here: on a Mac the kernels' self-test runs MLX on the GPU."""
        from engine.doctor import run_doctor

        try:
            lines = run_doctor(recheck=recheck).lines()
        except Exception as e:  # the Diagnostics window shows it instead of the report
            lines = [f"doctor failed: {_describe(e)}"]
        self.doctor_reported.emit(lines)

    @Slot(object, object)
    def serve_job(self, job: Any, settings: ChatSettings) -> None:
        """Run one request of the local server (`app.server.jobs.Job`) on this thread, in
        turn with the chat's replies; the server's own queue bounds how many wait."""
        from app.server.jobs import JobFailed, run_job

        try:
            session = self._session(settings, settings.drafter == "off")
            session.set_online(None)  # "My chats" records the chat's replies, not API calls
        except Exception as exc:  # noqa: BLE001 - the client gets the message, not a crash
            job.emit(JobFailed(_describe(exc), 500))
            return
        run_job(session, job)


class ModelLoadFailed(EngineError):
    """A load that failed and has been reported (`model_load_failed`) already."""


def _check_loadable(spec: str) -> None:
    """Raise what loading `spec` would, as far as it shows without reading the weights."""
    from engine.loading import DEMO_SPEC, inspect_weights, resolve_model_path

    if spec.strip() == DEMO_SPEC:
        return  # ours: a damaged demo folder is made again by the load itself
    folder = resolve_model_path(spec)
    inspect_weights(folder)
    if not (folder / "tokenizer.json").is_file():
        raise EngineError(f"{folder / 'tokenizer.json'}: missing (only models with a fast "
                          "tokenizer.json are supported)")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, EngineError):
        return str(exc)
    log.error("engine worker failed:\n%s", "".join(traceback.format_exception(exc)))
    return f"Internal error ({type(exc).__name__}): {exc}"


def _model_info(spec: str, loaded) -> ModelInfo:
    config = getattr(loaded, "config", {}) or {}
    return ModelInfo(
        spec=spec,
        name=str(getattr(loaded, "name", spec)),
        path=str(getattr(loaded, "path", "")),
        model_type=str(config.get("model_type", "?")),
        backend=str(getattr(loaded, "backend", "?")),
        template_warning=getattr(getattr(loaded, "tokenizer", None), "template_warning", None),
        # the window the engine holds replies to (ChatSession.context_window)
        context_window=int(loaded.model.args.max_position_embeddings),
    )


class EngineHost(QObject):
    """The GUI thread's handle on the engine thread: starts it, forwards requests, stops it."""

    _load_requested = Signal(str)
    _doctor_requested = Signal(bool)
    _generate_requested = Signal(object)
    _race_requested = Signal(object, object)
    _train_requested = Signal(str, float, object)
    _serve_requested = Signal(object, object)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._ids = itertools.count(1)
        self._active: dict[int, threading.Event] = {}
        self.thread = QThread()
        self.thread.setObjectName("understudy-engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self.thread.finished.connect(self.worker.deleteLater)
        self._load_requested.connect(self.worker.load_target)
        self._doctor_requested.connect(self.worker.run_doctor)
        self._generate_requested.connect(self.worker.generate)
        self._race_requested.connect(self.worker.race)
        self._train_requested.connect(self.worker.train_drafter)
        self._train_cancel = threading.Event()
        self._serve_requested.connect(self.worker.serve_job)
        self.worker.generation_finished.connect(self._on_request_ended)
        self.worker.generation_failed.connect(self._on_request_ended)
        self.thread.start()

    def new_request_id(self) -> int:
        return next(self._ids)

    def load(self, spec: str) -> None:
        self._load_requested.emit(spec)

    def doctor(self, recheck: bool = False) -> None:
        """Run `understudy doctor` on the engine thread; the report arrives as
        `worker.doctor_reported`."""
        self._doctor_requested.emit(recheck)

    def generate(self, request: GenerationRequest) -> None:
        self._active[request.request_id] = request.cancel
        self._generate_requested.emit(request)

    def race(self, spec: GenerationRequest, plain: GenerationRequest) -> None:
        """Speculative and plain decoding of the same prompt, side by side (`race`)."""
        for r in (spec, plain):
            self._active[r.request_id] = r.cancel
        self._race_requested.emit(spec, plain)

    def serve(self, job: Any, settings: ChatSettings) -> None:
        """Queue a server job on the engine thread (callable from the server's thread)."""
        self._serve_requested.emit(job, settings)

    def cancel(self, request_id: int) -> None:
        event = self._active.get(request_id)
        if event is not None:
            event.set()

    def train_drafter(self, spec: str, minutes: float) -> None:
        """Train a drafter head for `spec` for up to `minutes`, between replies."""
        self._train_cancel = threading.Event()
        self._train_requested.emit(spec, float(minutes), self._train_cancel)

    def cancel_training(self) -> None:
        """Stop training after the slice in flight (a checkpoint is written)."""
        self._train_cancel.set()

    def cancel_all(self) -> None:
        for event in list(self._active.values()):
            event.set()

    @property
    def busy(self) -> bool:
        return bool(self._active)

    def _on_request_ended(self, request_id: int, _payload: object) -> None:
        self._active.pop(request_id, None)

    def shutdown(self, timeout_ms: int = ENGINE_STOP_MS) -> bool:
        """Stop any reply (and training), then quit and join the engine thread; returns
        whether it stopped within `timeout_ms` (False: it is still inside an MLX call)."""
        self.cancel_all()
        self.cancel_training()
        if self.thread.isRunning():
            self.thread.quit()
            return bool(self.thread.wait(timeout_ms))
        return True
