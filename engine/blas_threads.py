"""How many threads OpenBLAS may use, following how busy the other processes keep the cores.

OpenBLAS splits a product over its threads and makes them wait for each other. When other
processes keep the cores busy, a waiting thread is often descheduled, and every product
waits for it: on a 2-core VM with two other processes spinning, plain decoding of the demo
ran at 1.5 tok/s with two BLAS threads and 10.1 with one (19.7 with two on an idle machine,
13.6 with one). So the engine watches the other processes' CPU use (the machine's busy time
in /proc/stat less this process's own) and, between passes, gives OpenBLAS the cores they
leave: one fewer per core they keep busy, never fewer than one.

Linux with OpenBLAS only (elsewhere, or with OPENBLAS_NUM_THREADS set by the user, nothing
changes). Decisions are taken on the engine thread, at most once per WINDOW_S, and a change
waits for MLX's queued work first (`mx.synchronize`), so no product runs while OpenBLAS
resizes its pool.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from engine.blas_core import threads_api

log = logging.getLogger(__name__)

WINDOW_S = 1.0  # how long a measurement of the others' CPU use spans
FIRST_WINDOW_S = 0.25  # the first one is shorter: a one-off reply must not run slow a second
# a core counts as taken once the others keep it this busy (a desktop's background chatter
# stays below; a build or a second inference process does not)
TAKEN_AT = 0.7
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Sample:
    """What the machine and this process had used by `wall` (seconds)."""

    wall: float
    busy_s: float  # all CPUs' non-idle time since boot
    own_s: float  # this process's CPU time (every thread, OpenBLAS's spinning included)


def read_sample(stat: Path = Path("/proc/stat"), cpus: frozenset[int] | None = None
                ) -> Sample | None:
    """None where /proc/stat cannot be read or parsed (not Linux). Only the CPUs this
    process may run on count (`cpus`, default its affinity): in a container pinned to 2 of
    a host's 64 CPUs, the host's other work must not take our cores."""
    if cpus is None:
        cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = 0
    seen = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            cpu = int(name[3:])
            ticks = [int(v) for v in rest.split()]
        except ValueError:
            return None
        if (cpus is not None and cpu not in cpus) or len(ticks) < 5:
            continue
        busy += sum(ticks[:8]) - ticks[3] - ticks[4]  # less idle and iowait
        seen += 1
    if not seen:
        return None
    times = os.times()
    return Sample(time.monotonic(), busy / CLOCK_TICKS, times.user + times.system)


def others_busy(before: Sample, after: Sample) -> float:
    """Cores the other processes kept busy between two samples, on average."""
    wall = after.wall - before.wall
    if wall <= 0:
        return 0.0
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, others / wall)


def wanted_threads(cores: int, others: float) -> int:
    """The cores the others leave: one fewer per core they keep TAKEN_AT busy, at least 1."""
    taken = math.floor(others + (1 - TAKEN_AT))
    return max(1, cores - taken)


class BlasThreads:
    """Call `tick()` between passes on the engine thread: it costs a clock read until a
    window has passed, and only then reads /proc/stat."""

    def __init__(self, stat: Path = Path("/proc/stat")) -> None:
        self._stat = stat
        self._api = None if "OPENBLAS_NUM_THREADS" in os.environ else threads_api()
        self.cores = self._api[0]() if self._api else 1
        self.threads = self.cores
        self._cpus = (frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else None)
        self._last = read_sample(stat, self._cpus) if self._api else None
        self.enabled = self._last is not None and self.cores > 1
        self._window = FIRST_WINDOW_S

    def tick(self) -> int:
        """Adjust the thread count once a window has passed; returns the count in use."""
        if not self.enabled or time.monotonic() - self._last.wall < self._window:
            return self.threads
        now = read_sample(self._stat, self._cpus)
        if now is None:
            return self.threads
        want = wanted_threads(self.cores, others_busy(self._last, now))
        self._last, self._window = now, WINDOW_S
        if want != self.threads:
            self.set(want)
        return self.threads

    def set(self, threads: int) -> None:
        """Give OpenBLAS `threads` threads, once the queued work is done."""
        if self._api is None:
            return
        mx.synchronize()
        self._api[1](threads)
        log.info("BLAS threads: %d -> %d (other processes keep %d of %d cores busy)",
                 self.threads, threads, self.cores - threads, self.cores)
        self.threads = threads


_shared: BlasThreads | None = None


def tick() -> int:
    """The process's one `BlasThreads` (OpenBLAS's count is the process's): adjust it."""
    global _shared
    if _shared is None:
        _shared = BlasThreads()
    return _shared.tick()
