"""The server's contract with the one thread that owns MLX.

A `Job` is a checked request in engine terms (prompt ids, `GenerateOptions`, a cancel flag)
plus `emit`, a thread-safe callback the engine thread calls with each event. Two
`EngineBackend`s run jobs: `engine_thread.EngineThread` for `understudy serve`, and the
app's `EngineWorker` (its chat and the server's requests queue on the same thread). Both
run a job with `run_job`, the only place the server drives the engine. `JobQueue` bounds
how many jobs may wait (a full queue is a 429) and writes the request log.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine.decode import GenerateOptions
from engine.errors import EngineError
from engine.events import Finished, PromptProgress, Step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobFailed:
    """The job ended without a reply; `status` is the HTTP status the client should see."""

    message: str
    status: int = 500


JobEvent = PromptProgress | Step | Finished | JobFailed


@dataclass(frozen=True)
class ModelCard:
    """What the server may know about a model it serves (never the model itself)."""

    id: str
    context_window: int
    tokenizer: Any  # engine.tokenizer.Tokenizer: pure Python, safe to use off the engine thread
    drafters: tuple[str, ...] = ("ngram",)
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class Job:
    """One request for the engine thread; `emit` is called there with every event."""

    job_id: str
    endpoint: str
    model: str
    prompt_ids: tuple[int, ...]
    options: GenerateOptions
    emit: Callable[[JobEvent], None]
    cancel: threading.Event = field(default_factory=threading.Event)


class EngineBackend(Protocol):
    """Whatever owns MLX for the server: runs submitted jobs one at a time, in order."""

    def models(self) -> list[ModelCard]:
        """The models a request may name now."""
        ...

    def submit(self, job: Job) -> None:
        """Queue `job`; it runs on the engine thread after every job submitted before it."""
        ...


def run_job(session: Any, job: Job) -> None:
    """Run `job` on `session` (an engine ChatSession), emitting every event, then the end.

    Must be called on the thread that loaded the session's models. Always ends with exactly
    one `Finished` or `JobFailed`. The engine checks `job.cancel` between steps.
    """
    if job.cancel.is_set():
        job.emit(JobFailed("cancelled before it started", 499))
        return
    try:
        events = session.generate_ids(job.prompt_ids, job.options, job.cancel)
        with closing(events):  # trims the caches to what was committed, even on error
            for event in events:
                job.emit(event)
    except EngineError as e:
        job.emit(JobFailed(str(e), 400))
    except Exception as e:  # noqa: BLE001 - a bug must not take the engine thread down
        log.error("server job failed:\n%s", "".join(traceback.format_exception(e)))
        job.emit(JobFailed(f"internal error ({type(e).__name__}): {e}", 500))


@dataclass(frozen=True)
class RequestRecord:
    """One line of the request log (the app shows these live)."""

    at: float  # time.time() when it ended
    endpoint: str
    model: str
    prompt_tokens: int
    prefilled_tokens: int
    completion_tokens: int
    decode_tps: float
    tau: float
    drafter: str
    finish: str  # engine finish reason, or "error: ..." for a failed or rejected request
    status: int = 200  # the HTTP status the client got (4xx: rejected before the engine)


class QueueFull(Exception):
    """More jobs are waiting than the queue holds."""


class JobQueue:
    """Admission in front of a backend: at most one running plus `max_waiting` waiting.

    The count drops when the engine ends a job (not when its client leaves), so a client that
    disconnects frees its place only once the engine has actually stopped its generation.
    """

    def __init__(self, backend: EngineBackend, max_waiting: int = 16,
                 on_record: Callable[[RequestRecord], None] | None = None,
                 keep: int = 200) -> None:
        self.backend = backend
        self.max_waiting = max_waiting
        self.on_record = on_record
        self.records: deque[RequestRecord] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def submit(self, job: Job) -> None:
        """Hand `job` to the backend, or raise QueueFull without touching it."""
        with self._lock:
            if self._in_flight >= 1 + self.max_waiting:
                raise QueueFull
            self._in_flight += 1
        try:
            self.backend.submit(replace(job, emit=self._watch(job)))
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _watch(self, job: Job) -> Callable[[JobEvent], None]:
        def emit(event: JobEvent) -> None:
            if isinstance(event, Finished | JobFailed):
                self._release()
                self._record(job, event)
            job.emit(event)

        return emit

    def _record(self, job: Job, event: Finished | JobFailed) -> None:
        if isinstance(event, Finished):
            s = event.stats
            record = RequestRecord(time.time(), job.endpoint, job.model, s.prompt_tokens,
                                   s.prefilled_tokens, s.generated_tokens, s.decode_tps, s.tau,
                                   job.options.drafter, s.finish_reason or "?")
        else:
            record = RequestRecord(time.time(), job.endpoint, job.model, len(job.prompt_ids),
                                   0, 0, 0.0, 0.0, job.options.drafter,
                                   f"error: {event.message}", event.status)
        self.records.append(record)
        if self.on_record is not None:
            try:
                self.on_record(record)
            except Exception:  # noqa: BLE001 - a log viewer must not break serving
                log.exception("request log callback failed")
