"""The standalone engine thread behind `understudy serve` (the app uses its EngineWorker).

MLX streams are thread-local, so this thread loads the models and makes every MLX call;
jobs reach it through a FIFO queue. One long-lived `ChatSession` per served model keeps
its KV cache between requests, so an editor's follow-up that repeats the file only
prefills what changed.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from app.server.jobs import Job, ModelCard, run_job

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """What the engine thread loads: a target, an optional draft model, a drafter to warm up."""

    model: str = "demo"
    draft: str | None = None
    warm_drafter: str = "auto"  # calibrated at start, so the first request is not slow


class EngineThread:
    """Owns MLX for the server: loads the models, then runs jobs one at a time."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._card: ModelCard | None = None
        self._thread = threading.Thread(target=self._main, name="understudy-engine",
                                        daemon=True)

    def start(self) -> ModelCard:
        """Start the thread and wait until the model is loaded; re-raise a load error."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        assert self._card is not None
        return self._card

    def models(self) -> list[ModelCard]:
        return [self._card] if self._card is not None else []

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the job in hand, drop the rest, and join the thread."""
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _main(self) -> None:
        try:
            session = self._load()
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        while (job := self._jobs.get()) is not None:
            run_job(session, job)
        while True:  # shutting down: jobs still queued end now, with a reason
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                run_job(session, job)
        # Buffers this thread's MLX stream cached must be freed on this thread: left for
        # interpreter exit, MLX 0.32 aborts the process ("terminate called ...").
        del session
        import mlx.core as mx

        mx.clear_cache()

    def _load(self):
        from engine.decode import ChatSession, GenerateOptions
        from engine.drafters.head_io import require_head, usable_head
        from engine.loading import load_model

        target = load_model(self.spec.model)  # no chat template: a ChatTemplateWarning line
        draft = load_model(self.spec.draft) if self.spec.draft else None
        drafter = self.spec.warm_drafter
        # the trained head rides along whenever one exists, so a request may name `head`
        # and `auto` weighs it, as in the app and the CLI
        head = require_head(target) if drafter == "head" else usable_head(target, log.warning)
        session = ChatSession(target, draft, head)
        if drafter not in ("none", *session.drafters) and drafter != "auto":
            from engine.errors import EngineError

            raise EngineError(f"--drafter {drafter} is not available for this model "
                              f"(available: none, auto, {', '.join(session.drafters)})")
        if drafter != "none":
            ids = target.tokenizer.encode("Hello", add_special_tokens=True) or [0]
            for _ in session.generate_ids(ids, GenerateOptions(max_tokens=1, drafter=drafter)):
                pass
            session.reset()
        self._card = ModelCard(id=target.name, context_window=session.context_window,
                               tokenizer=target.tokenizer, drafters=session.drafters)
        return session
