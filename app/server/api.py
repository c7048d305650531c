"""The Starlette app: OpenAI-compatible endpoints over one `EngineBackend`.

Everything a request says is checked here (schema, model, prompt length against the
context window, queue room) before a `Job` reaches the engine thread. Engine events come
back through an asyncio queue fed with `call_soon_threadsafe`; a client that disconnects
sets the job's cancel flag, which the engine reads between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.server.jobs import (
    EngineBackend,
    Job,
    JobEvent,
    JobFailed,
    JobQueue,
    ModelCard,
    QueueFull,
    RequestRecord,
)
from app.server.schema import (
    ApiError,
    GenerationRequest,
    parse_chat,
    parse_completion,
    parse_json,
)
from app.server.wire import (
    chat_response,
    chunk,
    completion_response,
    final_extension,
    finish_reason,
    model_object,
    models_list,
    step_extension,
    usage,
)
from engine.errors import EngineError
from engine.events import CUT_MARK, Finished, Step, without_cut_mark
from engine.prediction import PredictionUse, prediction_use


@dataclass(frozen=True)
class ServerConfig:
    """Policy for one server: who may call it, how much it takes, what it drafts with."""

    api_key: str | None = None
    default_drafter: str = "auto"
    max_body_bytes: int = 4 * 1024 * 1024
    max_waiting: int = 16  # jobs queued behind the one running; more get 429
    retry_after_s: int = 2
    # web pages (origins) whose scripts may call this server from a browser; none by
    # default, since any page the user opens could otherwise use the model ("*": any)
    allow_origins: tuple[str, ...] = ()


_ids = itertools.count(1)
log = logging.getLogger(__name__)


def create_app(backend: EngineBackend, config: ServerConfig | None = None,
               on_record: Callable[[RequestRecord], None] | None = None,
               on_rejected: Callable[[RequestRecord], None] | None = None) -> Starlette:
    """The ASGI app; `app.state.jobs` is its JobQueue (request log in `.records`).

    `on_record` hears of every request the engine ran; `on_rejected` (the app's request
    log, where someone debugging a client looks) of those refused before it, with their
    status and message."""
    config = config or ServerConfig()
    jobs = JobQueue(backend, config.max_waiting, on_record)
    api = _Api(backend, config, jobs)
    middleware = [Middleware(
        CORSMiddleware, allow_origins=list(config.allow_origins), allow_methods=["GET", "POST"],
        allow_headers=["Authorization", "Content-Type"], expose_headers=["Retry-After"],
    )] if config.allow_origins else []
    app = Starlette(
        middleware=middleware,
        # `:path`: a model id may be a Hugging Face repo id, slash included
        routes=[Route("/v1/models", api.list_models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", api.retrieve_model, methods=["GET"]),
                Route("/v1/chat/completions", api.chat, methods=["POST"]),
                Route("/v1/completions", api.completions, methods=["POST"])],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                            Exception: _internal_error},
    )
    app.state.jobs = jobs
    app.state.api = api
    app.state.on_rejected = on_rejected
    return app


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    _report_rejected(request, exc.status, exc.message)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


# what a client may call, for the errors of one that called something else
_ROUTES = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/models": "GET"}


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err = ApiError(exc.status_code, _routing_message(request, exc), code="not_found"
                   if exc.status_code == 404 else None)
    _report_rejected(request, err.status, err.message)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug: the client still gets an error object it can show (not Starlette's plain
    "Internal Server Error"); the traceback goes to the server's log, where uvicorn puts it."""
    err = ApiError(500, f"internal error ({type(exc).__name__}): {exc}", code="internal_error")
    _report_rejected(request, err.status, err.message)
    return JSONResponse(err.body(), status_code=500)


def _routing_message(request: Request, exc: HTTPException) -> str:
    """Starlette says only "Not Found" or "Method Not Allowed", which an SDK shows as all
    there is to know; the usual cause is a base URL without `/v1`, so that is said."""
    path, method = request.url.path, request.method
    if exc.status_code == 405 and path in _ROUTES:
        return f"{path} takes {_ROUTES[path]} requests, not {method}"
    if exc.status_code != 404:
        return str(exc.detail)
    served = ", ".join(f"{m} {p}" for p, m in _ROUTES.items())
    message = f"there is no {path} here; this server answers {served}"
    if "/v1" + path.rstrip("/") in _ROUTES:
        base = f"{request.url.scheme}://{request.url.netloc}/v1"
        message += f": is the client's base URL missing /v1? It should be {base}"
    return message


_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


def _report_rejected(request: Request, status: int, message: str) -> None:
    hook = request.app.state.on_rejected
    if hook is None:
        return
    path = request.url.path
    endpoint = _ENDPOINTS.get(path, "models" if path.startswith("/v1/models") else path)
    record = RequestRecord(time.time(), endpoint, "", 0, 0, 0, 0.0, 0.0, "",
                           f"error: {message}", status)
    try:
        hook(record)
    except Exception:  # noqa: BLE001 - a log viewer must not break serving
        log.exception("request log callback failed")


def close_requests(app: Starlette) -> None:
    """The server is stopping: every request in hand ends now with a 503 saying so, and any
    new one is refused. Call it before telling uvicorn to exit (any thread): uvicorn alone
    would wait for the streams to end, then cut them, and a client would take the text it
    had as a whole reply, since a cut stream looks like a finished one to the SDK."""
    api = getattr(app.state, "api", None)
    if isinstance(api, _Api):
        api.close()


SHUTTING_DOWN = "the server is shutting down"


class _Api:
    def __init__(self, backend: EngineBackend, config: ServerConfig, jobs: JobQueue) -> None:
        self.backend = backend
        self.config = config
        self.jobs = jobs
        self.closing = threading.Event()
        self._live: set[Job] = set()  # jobs whose client still waits for their end
        self._live_lock = threading.Lock()

    def close(self) -> None:
        self.closing.set()
        with self._live_lock:
            live = list(self._live)
        for job in live:
            job.cancel.set()

    # -- endpoints -----------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(models_list(self.backend.models()))

    async def retrieve_model(self, request: Request) -> Response:
        self._authorize(request)
        if not (model_id := request.path_params["model_id"]):  # "/v1/models/": the list
            return JSONResponse(models_list(self.backend.models()))
        return JSONResponse(model_object(self._card(model_id)))

    async def chat(self, request: Request) -> Response:
        self._authorize(request)
        return await self._generate(request, parse_chat(parse_json(await self._body(request))))

    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        return await self._generate(request,
                                    parse_completion(parse_json(await self._body(request))))

    # -- checks --------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        ok = hmac.compare_digest(token.strip().encode(), key.encode())
        if scheme.lower() != "bearer" or not ok:
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = ApiError(413, f"the request body is over the limit of {limit} bytes",
                           code="request_too_large")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        parts: list[bytes] = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_big
            parts.append(part)
        return b"".join(parts)

    def _card(self, model: str) -> ModelCard:
        cards = self.backend.models()
        for card in cards:
            if card.id == model:
                return card
        served = ", ".join(repr(c.id) for c in cards) or "none (no model is loaded)"
        raise ApiError(404, f"model {model!r} is not served here; this server has {served}",
                       param="model", code="model_not_found")

    def _options(self, req: GenerationRequest, card: ModelCard, n_prompt: int):
        from engine.decode import GenerateOptions
        from engine.sampling import SamplingParams

        window = card.context_window
        if n_prompt + 1 > window:
            raise ApiError(400, f"the prompt is {n_prompt} tokens long, but this model's "
                           f"context window is {window} tokens", param="messages"
                           if req.endpoint == "chat" else "prompt",
                           code="context_length_exceeded")
        if req.max_tokens is not None and req.max_tokens > window:
            raise ApiError(400, f"max_tokens is {req.max_tokens}, more than this model's "
                           f"context window of {window} tokens", param="max_tokens",
                           code="context_length_exceeded")
        drafter = req.drafter or self.config.default_drafter
        if drafter not in ("none", "auto", *card.drafters):
            why = {"head": f": no drafter head is trained for it (`understudy train-drafter "
                           f"--model {card.id}`, then start the server again)",
                   "model": ": the server was started without a draft model (--draft)",
                   }.get(drafter, "")
            raise ApiError(400, f"drafter {drafter!r} is not available for this model{why} "
                           f"(available: none, auto, {', '.join(card.drafters)})",
                           param="drafter")
        try:
            sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p,
                                      top_k=req.top_k, min_p=req.min_p,
                                      repetition_penalty=req.repetition_penalty,
                                      seed=req.seed)
            return GenerateOptions(max_tokens=req.max_tokens or window - n_prompt,
                                   sampling=sampling, stop=req.stop, drafter=drafter,
                                   k=req.draft_k, reference=req.prediction)
        except EngineError as e:
            raise ApiError(422, str(e), code="invalid_value") from None

    # -- generation ----------------------------------------------------------------------
    async def _generate(self, request: Request, req: GenerationRequest) -> Response:
        if self.closing.is_set():
            raise _shutting_down()
        card = self._card(req.model)
        try:
            prompt_ids = await run_in_threadpool(_encode, card, req)
            predicted = (await run_in_threadpool(card.tokenizer.encode, req.prediction)
                         if req.prediction else None)
        except EngineError as e:
            raise ApiError(400, str(e), param="messages" if req.endpoint == "chat"
                           else "prompt") from None
        options = self._options(req, card, len(prompt_ids))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[JobEvent] = asyncio.Queue()

        def emit(event: JobEvent) -> None:  # called on the engine thread
            # RuntimeError: the server's loop is gone, so nobody is listening
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(events.put_nowait, event)

        prefix = "chatcmpl" if req.endpoint == "chat" else "cmpl"
        job = Job(f"{prefix}-{next(_ids)}-{int(time.time() * 1000)}", req.endpoint, card.id,
                  tuple(prompt_ids), options, emit)
        try:
            self.jobs.submit(job)
        except QueueFull:
            raise ApiError(429, "the server is busy: too many requests are waiting; retry "
                           "shortly", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        with self._live_lock:
            self._live.add(job)
        reply = _Reply(job, req, events, int(time.time()), self.closing,
                       lambda: self._forget(job), predicted)
        if req.stream:
            # the grace period: sse-starlette cancels a stream once it notices uvicorn's
            # exit; by then `close_requests` has stopped the job, whose stream is left the
            # moment it needs to say why (less than uvicorn's own 3 s)
            return EventSourceResponse(reply.stream(), ping=15, shutdown_grace_period=2,
                                       client_close_handler_callable=reply.client_closed)
        return await reply.collect(request)

    def _forget(self, job: Job) -> None:
        with self._live_lock:
            self._live.discard(job)


def _shutting_down(detail: str = "") -> ApiError:
    return ApiError(503, f"{SHUTTING_DOWN}{detail}; retry once it is back",
                    code="server_shutting_down")


def _encode(card: ModelCard, req: GenerationRequest) -> list[int]:
    """Prompt ids (off the event loop: templates and tokenizers take a while on long files)."""
    from engine.errors import PromptError

    tok = card.tokenizer
    if req.messages is not None:
        if not any(m["content"].strip() for m in req.messages):
            raise PromptError("messages: every message is empty")
        return tok.encode_chat(list(req.messages), add_generation_prompt=True,
                               continue_final=req.continue_final)
    assert req.prompt is not None
    if isinstance(req.prompt, tuple):  # the client's own tokens, no BOS added (as vLLM)
        ids = list(req.prompt)
        vocab = tok.vocab_size
        if (bad := next((i for i in ids if not 0 <= i < vocab), None)) is not None:
            raise PromptError(f"prompt: token id {bad} is not in this model's vocabulary "
                              f"(0-{vocab - 1})")
    else:
        ids = tok.encode(req.prompt, add_special_tokens=True)
    if not ids:
        raise PromptError("prompt: the prompt is empty")
    return ids


class _Reply:
    """One request's events turned into a response, streamed or whole."""

    def __init__(self, job: Job, req: GenerationRequest, events: asyncio.Queue[JobEvent],
                 created: int, closing: threading.Event, done: Callable[[], None],
                 predicted: list[int] | None = None) -> None:
        self.job = job
        self.predicted = predicted  # the request's prediction, encoded (None: none given)
        self.req = req
        self.events = events
        self.created = created
        self.closing = closing  # set: a cancelled job was stopped by the server's shutdown
        self.done = done
        self.steps_by_drafter: Counter[str] = Counter()

    def _cut_by_shutdown(self, event: JobEvent) -> ApiError | None:
        """The error a job ended by the server's shutdown answers instead of its reply."""
        if not self.closing.is_set():
            return None
        if isinstance(event, JobFailed) and event.status == 499:  # never started
            return _shutting_down()
        if isinstance(event, Finished) and event.stats.finish_reason == "cancelled":
            n = event.stats.generated_tokens
            return _shutting_down(f": the reply was cut short after {n} token"
                                  f"{'' if n == 1 else 's'}" if n else
                                  ": it stopped before the reply began")
        return None

    async def _prediction_use(self, finished: Finished) -> PredictionUse | None:
        """How much of the prediction the reply wrote; a diff of a long prediction takes a
        while, so it runs off the event loop, as the prompt's encoding does."""
        if self.predicted is None:
            return None
        return await run_in_threadpool(prediction_use, self.predicted, finished.token_ids)

    def _extension(self, finished: Finished) -> dict[str, Any]:
        return final_extension(finished, self.job.options.drafter, self.steps_by_drafter)

    async def client_closed(self, _message: Any) -> None:
        self.job.cancel.set()

    async def collect(self, request: Request) -> Response:
        """Wait for the whole reply; a client that hangs up meanwhile cancels it."""
        watcher = asyncio.create_task(self._watch_disconnect(request))
        try:
            while True:
                event = await self.events.get()
                if (cut := self._cut_by_shutdown(event)) is not None:
                    return JSONResponse(cut.body(), status_code=cut.status)
                if isinstance(event, Step):
                    self.steps_by_drafter[event.drafter] += 1
                elif isinstance(event, Finished):
                    build = chat_response if self.req.endpoint == "chat" else completion_response
                    shown = replace(event, text=without_cut_mark(event.text))
                    return JSONResponse(build(self.job.job_id, self.created, self.job.model,
                                              shown, self._extension(event),
                                              await self._prediction_use(event)))
                elif isinstance(event, JobFailed):  # logged by the JobQueue already
                    err = ApiError(event.status if event.status < 499 else 500, event.message)
                    return JSONResponse(err.body(), status_code=err.status)
        finally:
            watcher.cancel()
            self.job.cancel.set()  # no-op after Finished; stops the engine otherwise
            self.done()

    async def _watch_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.job.cancel.set()

    async def stream(self) -> AsyncIterator[dict[str, str]]:
        """SSE `data:` chunks: role, one per target pass, the finish, usage, `[DONE]`.

        A step whose text ends in CUT_MARK waits for the next event: if that is the finish,
        the reply was cut mid-character and the step goes out without the mark (as the
        whole reply's text does), so no client shows half a character as U+FFFD.
        """
        job, req = self.job, self.req
        held: Step | None = None

        def data(obj: dict[str, Any]) -> dict[str, str]:
            return {"data": json.dumps(obj, ensure_ascii=False)}

        def make(text: str | None, **kw: Any) -> dict[str, str]:
            return data(chunk(req.endpoint, job.job_id, self.created, job.model, text, **kw))

        try:
            yield make("", first=True)
            while True:
                event = await self.events.get()
                if (cut := self._cut_by_shutdown(event)) is not None:
                    # the SDK raises this (an `error` in a chunk) rather than taking the
                    # text so far for the whole reply
                    yield data(cut.body())
                    break
                if isinstance(event, Step):
                    self.steps_by_drafter[event.drafter] += 1
                    if held is not None:
                        yield make(held.text, extension=step_extension(held))
                        held = None
                    if event.text.endswith(CUT_MARK):
                        held = event
                    else:
                        yield make(event.text, extension=step_extension(event))
                elif isinstance(event, Finished):
                    if held is not None:
                        cut = held.without_cut_mark()
                        yield make(cut.text, extension=step_extension(cut))
                    # Usage goes out once: on its own chunk when the client asked for it
                    # (OpenAI's shape), else on the finish chunk, so every stream reports
                    # it. Both would count it twice in clients that add up the usage of
                    # every chunk (LangChain's streamed usage_metadata does).
                    total = usage(event.stats, await self._prediction_use(event))
                    yield make(None if req.endpoint == "chat" else "",
                               finish=finish_reason(event.stats),
                               usage_=None if req.include_usage else total,
                               extension=self._extension(event))
                    if req.include_usage:
                        yield make(None, usage_=total, no_choices=True)
                    break
                elif isinstance(event, JobFailed):
                    err = ApiError(event.status if event.status < 499 else 500, event.message)
                    yield data(err.body())
                    break
            yield {"data": "[DONE]"}
        finally:
            job.cancel.set()  # a client gone mid-stream stops the engine at its next step
            self.done()
