"""Ending the process once its work is done, in bounded time.

After a command has returned (or the window has closed), all that is left is the
interpreter's shutdown and then the native libraries' exit handlers: OpenBLAS joins its
thread pool (`gotoblas_quit`), MLX and Qt tear down theirs, `concurrent.futures` joins its
workers. None of that can be interrupted from Python, and one deadlock there keeps a
finished command alive for ever. Issue 16 was one: a reply left its last pass running on
MLX's stream thread, OpenBLAS's pool missed its shutdown wake-up while that pass was inside
a matmul, and `understudy generate` printed its answer and never exited.

The root is fixed where the work is queued (the decode driver waits for its last pass, so
a reply leaves no MLX work in flight). This module is the second layer, for whatever a
library or a thread we do not own still holds: flush what the user must see, close the
log, and end the process with `os._exit`, which runs none of those handlers. Nothing in
Understudy needs them: commands close the store and finish their files before returning.
Only process entry points call it — never code that tests call in-process.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush stdout, stderr and the log, then end the process with `code` at once."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a reader that went away (`| head`), a closed stream
            pass
    logging.shutdown()
    os._exit(code)


def exit_code(exc: SystemExit) -> int:
    """The status Python would exit with for `exc` (printing a message code as it would)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1
