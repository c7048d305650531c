"""`mx.compile` only where it is safe: on the main thread.

MLX (0.32) keeps a per-thread compile cache; its thread-exit destructor takes the GIL, and a
thread that exits while the interpreter is finalizing then aborts the whole process
("terminate called without an active exception"; reproduced on Linux with a plain worker
thread). Worker threads therefore run the eager graph. Compiled and eager results are
bit-identical on CPU (checked by the engine's sampling tests), so the thread changes speed,
never tokens.

A compiled function traces again for each new input shape (unless shapeless), and a trace
may build and JIT-compile kernels: on the CPU backend a C++ compile of ~0.4 s each on a
fresh machine. `traces()` counts them, so a timed pass that traced is not taken as the
pass's cost.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

import mlx.core as mx

F = TypeVar("F", bound=Callable[..., object])

_traces = 0


def traces() -> int:
    """How many times a compiled function has been traced in this process."""
    return _traces


def compiled_on_main_thread(fn: F, shapeless: bool = False) -> F:
    """`fn` compiled when called on the main thread, plain `fn` elsewhere. `shapeless`:
    one trace for every input shape (elementwise functions of a growing array)."""
    def traced(*args: mx.array):
        global _traces
        _traces += 1  # runs only while mx.compile traces (a call that reuses a trace skips it)
        return fn(*args)

    compiled = mx.compile(traced, shapeless=shapeless)

    @functools.wraps(fn)
    def call(*args: mx.array):
        if threading.current_thread() is threading.main_thread():
            return compiled(*args)
        return fn(*args)

    return call  # type: ignore[return-value]
