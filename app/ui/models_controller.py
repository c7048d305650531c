"""The model manager's logic: hub search, downloads, library, token, offline mode.

No widgets: the Models panel and the token settings get this object in their `__init__`
and connect to its signals. Following ARCHITECTURE.md, hub work is asyncio coroutines on
the qasync loop (`@asyncSlot`) whose blocking huggingface_hub calls run in executor
threads (`loop.run_in_executor`), so the window never freezes and a dead hub costs at
most `HubConfig.timeout_s`. None of it touches MLX, except a GGUF import, which reads the
file with `mx.load`: that runs on `mlx_thread` (the engine thread) when one is given.

Progress comes from the download's executor thread: `app.hub.download` throttles it
(`progress_interval_s`) and emits it through a private signal whose receiver lives on the
GUI thread, so Qt queues it; the public `download_progressed` is always emitted there.

The token is read from `TokenStore` once and kept in memory; it goes into a `HubConfig`
(whose repr hides it) and nowhere else: not QSettings, not logs, not signals.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QSettings, QThread, Signal, Slot
from qasync import asyncSlot

from app.hub.api import HubAuthError, HubConfig
from app.hub.catalog import RecommendedPair, load_catalog
from app.hub.download import DownloadCancelled, DownloadProgress, download_model
from app.hub.library import (
    LocalModel,
    ModelNameTakenError,
    delete_model,
    import_model,
    list_models,
)
from app.hub.token_store import TokenStatus, TokenStore, mask
from engine.errors import EngineError

log = logging.getLogger(__name__)

OFFLINE_KEY = "hub/offline"
_UNREAD = object()


def _describe(exc: BaseException) -> str:
    """A user-facing line. Our errors are written to be shown; others only by type name,
    since an unknown library's message might carry a request (and its token)."""
    if isinstance(exc, EngineError):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return f"Unexpected error ({type(exc).__name__})."


def _opaque(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """`fn` bound to its arguments, with a repr that shows none of them.

    qasync logs what it runs at DEBUG level; a `functools.partial` would print its
    arguments, and `whoami` takes the token as one.
    """
    def job() -> Any:
        return fn(*args, **kwargs)

    job.__qualname__ = job.__name__ = getattr(fn, "__name__", "job")
    return job


@dataclass(frozen=True)
class ActiveDownload:
    repo_id: str
    cancel: threading.Event


class _ThreadRunner(QObject):
    """Runs a callable on the thread it was moved to; the result comes back through `done`."""

    run_requested = Signal(object)  # (fn, on_done)

    def __init__(self) -> None:
        super().__init__()
        self.run_requested.connect(self._run)

    @Slot(object)
    def _run(self, job: tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]]
             ) -> None:
        fn, on_done = job
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the awaiting coroutine
            on_done(None, e)
        else:
            on_done(result, None)


class ModelsController(QObject):
    """Owns the hub/library state behind the Models panel and the token settings."""

    search_started = Signal(str)
    search_finished = Signal(object)  # list[RepoSummary]
    search_failed = Signal(str)
    details_loaded = Signal(object)  # RepoDetails
    details_failed = Signal(str, str)  # repo id, message
    download_queued = Signal(str)
    download_started = Signal(str)
    download_progressed = Signal(object)  # DownloadProgress, at most every progress_interval_s
    download_finished = Signal(object)  # DownloadResult
    download_cancelled = Signal(str)
    download_failed = Signal(str, str)  # repo id, message
    token_needed = Signal(str)  # what to do (a gated/private repo, or a rejected token)
    library_changed = Signal(object)  # list[LocalModel]
    model_imported = Signal(object)  # LocalModel
    import_started = Signal(str)  # source path
    import_progressed = Signal(int, int)  # GGUF tensors converted, of total
    import_ended = Signal(bool)  # succeeded (after model_imported, library_failed or
    # import_name_taken)
    import_name_taken = Signal(str, str, str)  # source path, the name taken, a free one
    model_deleted = Signal(str, int)  # name, bytes freed
    library_failed = Signal(str)
    token_changed = Signal(object)  # TokenStatus
    token_checked = Signal(str)  # account name
    token_check_failed = Signal(str)
    offline_changed = Signal(bool)
    _progress_from_thread = Signal(object)
    _import_progress_from_thread = Signal(int, int)

    def __init__(self, qsettings: QSettings | None = None, *,
                 token_store: TokenStore | None = None,
                 catalog: tuple[RecommendedPair, ...] | None = None,
                 endpoint: str | None = None, cache_dir: Path | None = None,
                 timeout_s: float = 10.0, progress_interval_s: float = 0.1,
                 mlx_thread: QThread | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.qsettings = qsettings
        self.token_store = token_store or TokenStore()
        self._catalog = catalog
        self._endpoint, self._cache_dir, self.timeout_s = endpoint, cache_dir, timeout_s
        self.progress_interval_s = progress_interval_s
        self._offline = bool(qsettings is not None
                             and str(qsettings.value(OFFLINE_KEY, "false")).lower() == "true")
        self._token: Any = _UNREAD
        self._queue: deque[str] = deque()
        self._active: ActiveDownload | None = None
        self._draining = False
        self._search_seq = 0
        self._details_seq = 0
        self._library: list[LocalModel] = []
        self._runner: _ThreadRunner | None = None
        if mlx_thread is not None:
            self._runner = _ThreadRunner()
            self._runner.moveToThread(mlx_thread)
            mlx_thread.finished.connect(self._runner.deleteLater)
        self._progress_from_thread.connect(self._on_progress_from_thread)
        self._import_progress_from_thread.connect(self._on_import_progress_from_thread)

    # -- configuration -----------------------------------------------------------------
    def _current_token(self) -> str | None:
        if self._token is _UNREAD:
            self._token = self.token_store.get()
        return self._token

    def hub_config(self) -> HubConfig:
        """A fresh config: settings and environment as they are now."""
        return HubConfig(endpoint=self._endpoint, cache_dir=self._cache_dir,
                         offline=self._offline, timeout_s=self.timeout_s,
                         token=self._current_token())

    @property
    def cache(self) -> Path:
        return HubConfig(endpoint=self._endpoint, cache_dir=self._cache_dir).cache

    @property
    def offline(self) -> bool:
        """Effective offline mode: the switch, or HF_HUB_OFFLINE in the environment."""
        return self._offline or self.offline_forced

    @property
    def offline_forced(self) -> bool:
        return HubConfig(offline=False).is_offline

    @property
    def endpoint(self) -> str:
        return HubConfig(endpoint=self._endpoint).base_url

    def set_offline(self, on: bool) -> None:
        if on == self._offline:
            return
        self._offline = on
        if self.qsettings is not None:
            self.qsettings.setValue(OFFLINE_KEY, "true" if on else "false")
        self.offline_changed.emit(self.offline)

    def pairs(self) -> tuple[RecommendedPair, ...]:
        if self._catalog is None:
            self._catalog = load_catalog()
        return self._catalog

    # -- running blocking work ---------------------------------------------------------
    async def _in_executor(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, _opaque(fn, *args, **kwargs))

    async def _on_mlx_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn` on the engine thread (MLX streams are per thread) and await it."""
        if self._runner is None:
            return await self._in_executor(fn, *args, **kwargs)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def on_done(result: Any, error: BaseException | None) -> None:
            def settle() -> None:
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
            loop.call_soon_threadsafe(settle)

        self._runner.run_requested.emit((_opaque(fn, *args, **kwargs), on_done))
        return await future

    # -- search and details -------------------------------------------------------------
    @asyncSlot(str, str)
    async def search(self, query: str, author: str = "") -> None:
        """Search the hub (every author, or only `author`), loadable repos first; newest
        search wins."""
        self._search_seq += 1
        seq = self._search_seq
        self.search_started.emit(query)
        config = self.hub_config()
        try:
            from app.hub.api import preferred_author, search_models

            hits = await self._in_executor(search_models, query.strip(), config,
                                           author=author.strip() or None,
                                           prefer_author=preferred_author())
        except Exception as e:  # noqa: BLE001 - shown to the user
            if seq == self._search_seq:
                self.search_failed.emit(_describe(e))
            return
        if seq == self._search_seq:
            self.search_finished.emit(hits)

    @asyncSlot(str)
    async def load_details(self, repo_id: str) -> None:
        """Files, exact size and support verdict of one repo (fetches its config.json)."""
        self._details_seq += 1
        seq = self._details_seq
        try:
            from app.hub.api import repo_details

            details = await self._in_executor(repo_details, repo_id, self.hub_config())
        except Exception as e:  # noqa: BLE001
            if seq == self._details_seq:
                self.details_failed.emit(repo_id, _describe(e))
                if isinstance(e, HubAuthError):
                    self.token_needed.emit(str(e))
            return
        if seq == self._details_seq:
            self.details_loaded.emit(details)

    # -- downloads -----------------------------------------------------------------------
    @property
    def active_download(self) -> str | None:
        return self._active.repo_id if self._active else None

    @property
    def queued_downloads(self) -> tuple[str, ...]:
        return tuple(self._queue)

    def download(self, repo_id: str) -> None:
        """Queue `repo_id`; downloads run one at a time. A finished file is never refetched,
        so downloading a cancelled or interrupted repo again resumes it."""
        if repo_id == self.active_download or repo_id in self._queue:
            return
        self._queue.append(repo_id)
        self.download_queued.emit(repo_id)
        if not self._draining:
            self._draining = True
            self._drain()

    def download_pair(self, pair: RecommendedPair) -> None:
        """Both models of a recommended pair: the draft first, as it is the smaller."""
        self.download(pair.draft.repo_id)
        self.download(pair.target.repo_id)

    def cancel_download(self) -> None:
        """Cancel the running download (within one chunk) and drop the queued ones."""
        self._queue.clear()
        if self._active is not None:
            self._active.cancel.set()

    @asyncSlot()
    async def _drain(self) -> None:
        try:
            while self._queue:
                await self._download_one(self._queue.popleft())
        finally:
            self._draining = False

    async def _download_one(self, repo_id: str) -> None:
        active = ActiveDownload(repo_id, threading.Event())
        self._active = active
        self.download_started.emit(repo_id)
        outcome: Callable[[], None]
        try:
            result = await self._in_executor(
                download_model, repo_id, self.hub_config(),
                on_progress=self._progress_from_thread.emit, cancel=active.cancel,
                min_interval_s=self.progress_interval_s)
        except DownloadCancelled:
            outcome = functools.partial(self.download_cancelled.emit, repo_id)
        except Exception as e:  # noqa: BLE001 - shown to the user
            self._queue.clear()  # the rest of a pair is useless without this one
            message, needs_token = _describe(e), isinstance(e, HubAuthError)

            def outcome() -> None:
                self.download_failed.emit(repo_id, message)
                if needs_token:
                    self.token_needed.emit(message)
        else:
            outcome = functools.partial(self.download_finished.emit, result)
        # Views hear the outcome with the download no longer active and the library current.
        self._active = None
        self.refresh_library()
        outcome()

    @Slot(object)
    def _on_progress_from_thread(self, progress: DownloadProgress) -> None:
        """Runs on the GUI thread: the connection is queued, as the emitter is the executor."""
        if self._active is not None and progress.repo_id == self._active.repo_id:
            self.download_progressed.emit(progress)

    # -- library ---------------------------------------------------------------------------
    @property
    def library(self) -> list[LocalModel]:
        return list(self._library)

    def refresh_library(self) -> list[LocalModel]:
        """Re-read the local models (disk only, quick) and tell the views."""
        try:
            self._library = list_models(self.cache)
        except (OSError, EngineError) as e:
            self.library_failed.emit(_describe(e))
        self.library_changed.emit(list(self._library))
        return list(self._library)

    @asyncSlot(str)
    async def delete(self, name: str) -> None:
        """Delete a downloaded or imported model (the view asks for confirmation first)."""
        if name == self.active_download:
            self.library_failed.emit(f"{name} is downloading; cancel the download first.")
            return
        try:
            freed = await self._in_executor(delete_model, name, self.cache)
        except Exception as e:  # noqa: BLE001
            self.library_failed.emit(_describe(e))
            return
        finally:
            self.refresh_library()
        self.model_deleted.emit(name, int(freed))

    @asyncSlot(str, str)
    async def import_path(self, path: str, name: str = "") -> None:
        """Copy a model folder, or convert a GGUF file (on the engine thread, reporting each
        tensor through `import_progressed`), into the library, named `name` or (empty)
        after the source. A name already in the library is `import_name_taken`, so the
        window can ask for another."""
        src = Path(path)
        gguf = src.suffix.lower() == ".gguf"
        run = self._on_mlx_thread if gguf else self._in_executor
        self.import_started.emit(str(src))
        try:
            model = await run(import_model, src, name or None,
                              on_progress=self._import_progress_from_thread.emit if gguf else None)
        except ModelNameTakenError as e:
            self.import_ended.emit(False)
            self.import_name_taken.emit(str(src), e.name, e.free)
            return
        except Exception as e:  # noqa: BLE001
            self.refresh_library()
            self.library_failed.emit(_describe(e))
            self.import_ended.emit(False)
            return
        self.refresh_library()
        self.model_imported.emit(model)
        self.import_ended.emit(True)

    @Slot(int, int)
    def _on_import_progress_from_thread(self, done: int, total: int) -> None:
        """Runs on the GUI thread: the emitter is the engine thread, so this is queued."""
        self.import_progressed.emit(done, total)

    # -- token ----------------------------------------------------------------------------
    def token_status(self) -> TokenStatus:
        return self.token_store.status()

    def has_token(self) -> bool:
        return self._current_token() is not None

    def token_hint(self) -> str:
        """The token masked for display ('hf_…wxyz'), or '' when none is set."""
        return mask(self._current_token())

    def save_token(self, token: str) -> TokenStatus:
        try:
            status = self.token_store.set(token)
        except EngineError as e:
            self.token_check_failed.emit(_describe(e))
            return self.token_store.status()
        self._token = self.token_store.get()
        self.token_changed.emit(status)
        return status

    def clear_token(self) -> TokenStatus:
        try:
            status = self.token_store.clear()
        except EngineError as e:
            self.token_check_failed.emit(_describe(e))
            status = self.token_store.status()
        self._token = self.token_store.get()
        self.token_changed.emit(status)
        return status

    @asyncSlot()
    async def check_token(self) -> None:
        """Ask the hub whose token this is (the "Check" button)."""
        token = self._current_token()
        if not token:
            self.token_check_failed.emit("No Hugging Face token is set.")
            return
        try:
            from app.hub.api import whoami

            name = await self._in_executor(whoami, self.hub_config(), token)
        except Exception as e:  # noqa: BLE001
            self.token_check_failed.emit(_describe(e))
            return
        self.token_checked.emit(name)

    def shutdown(self) -> None:
        """The app is closing: stop the download (it resumes next time)."""
        self.cancel_download()

