"""A chat template's render, bounded in time and output size.

The sandbox stops a template from reaching Python's internals and from building one huge
value with `*`, but not from looping: jinja allows `range` up to 100,000 items, so two nested
loops are 10^10 iterations, which either never finish or write gigabytes. A template comes
with a downloaded model, so such a loop would hang the engine thread (the app's chat, its
server) for good. Here the output is counted as it is produced, and a render still running
after `RENDER_SECONDS` (a loop that writes nothing included) is interrupted with an
exception raised in its own thread at the next bytecode, which jinja's generated code runs
as plain Python. Both end as a `TemplateError` naming the limit.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping
from typing import Any

import jinja2

from engine.errors import TemplateError

RENDER_SECONDS = 10.0  # a real template renders a long chat in milliseconds
MAX_RENDER_CHARS = 32_000_000  # ~8M tokens: past any model's context window


class _RenderTimeout(BaseException):
    """Raised inside the rendering thread when its time is up. A BaseException, so no
    `except Exception` between the template and us can swallow it."""


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Schedule `exc` in the thread (None clears one scheduled and not yet raised)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)


def render_bounded(template: jinja2.Template, variables: Mapping[str, Any], *,
                   seconds: float | None = None, max_chars: int | None = None) -> str:
    """`template.render(**variables)`, or a `TemplateError` once it runs past `seconds` or
    writes more than `max_chars` characters (by default the module's limits)."""
    seconds = RENDER_SECONDS if seconds is None else seconds
    max_chars = MAX_RENDER_CHARS if max_chars is None else max_chars
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def interrupt() -> None:
        with lock:  # never after `done`: the exception could land outside the render
            if not state["done"]:
                state["fired"] = True
                _set_async_exc(thread_id, _RenderTimeout)

    timer = threading.Timer(seconds, interrupt)
    timer.daemon = True
    timer.start()
    try:
        try:
            text = _render(template, variables, max_chars)
        finally:
            with lock:  # from here on no interruption is scheduled
                state["done"] = True
                if state["fired"]:  # scheduled but maybe not yet raised: clear it
                    _set_async_exc(thread_id, None)
        if state["fired"]:
            raise _RenderTimeout
        return text
    except _RenderTimeout:
        raise TemplateError(
            f"chat template was stopped: it ran for more than {seconds:g} s "
            "(a loop that does not end)") from None
    finally:
        timer.cancel()


def _render(template: jinja2.Template, variables: Mapping[str, Any], max_chars: int) -> str:
    parts: list[str] = []
    n_chars = 0
    for piece in template.generate(**variables):
        n_chars += len(piece)
        if n_chars > max_chars:
            raise TemplateError(
                f"chat template was stopped: its output passed {max_chars:,} characters")
        parts.append(piece)
    return "".join(parts)
