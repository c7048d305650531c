"""Keep a training job's resident memory to what its steps hold.

Two things kept freed memory resident between and within training steps on Linux.

On Linux, MLX's CPU buffers come from glibc malloc. After the first large buffer is freed,
glibc raises its mmap threshold, so later buffers up to 32 MB come from the heap, and the
pages of the ones freed stay resident: over a long job the process's RSS grows by the
freed-but-kept pages of whichever steps fragmented the heap most. `malloc_trim(0)` returns
every whole free page (any arena, not only the heap's top). It is cheap next to a training
step (milliseconds against seconds) and leaves the allocator's speed alone, where a fixed
mmap threshold costs every step its page faults. Elsewhere (macOS's libc has no
malloc_trim; Metal buffers are not malloc's) it does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache

import mlx.core as mx


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """libc's malloc_trim among the symbols this process has loaded (as `blas_core` finds
    OpenBLAS's); None where libc has none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_heap() -> None:
    """Return glibc's free heap pages to the OS (a no-op where there is no malloc_trim)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@contextmanager
def lean_memory() -> Iterator[None]:
    """Run one training step or data batch with MLX's buffer cache off (on the CPU), then
    restore the cache limit and return freed heap pages. Scoped to the work itself, so a
    chat reply that runs between two training slices keeps the usual cache."""
    cpu = mx.default_device().type == mx.DeviceType.cpu
    previous = mx.set_cache_limit(0) if cpu else None
    try:
        yield
    finally:
        if previous is not None:
            mx.set_cache_limit(previous)
        release_freed_heap()
