"""Advisory locks on files, shared between processes.

Two uses: the online buffer's folder lock, which writers wait for in turn (the app and
`chat --learn` may record into one buffer), and a training job's lock on its head folder,
which a second job is refused (two jobs made the same shard numbers, and the second ended
with a write error that blamed the disk). `flock` locks belong to an open file, so two
jobs in one process exclude each other as two processes do, and the kernel drops a lock
whose holder dies: a crashed job never leaves the folder locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from engine.errors import EngineError


class BusyError(EngineError):
    """Another job holds the lock (its process id, when it wrote one, is in the message)."""


@contextlib.contextmanager
def exclusive(path: Path, *, wait: bool = True, busy: str = "") -> Iterator[None]:
    """Hold the exclusive lock on `path` (created with its folder). With `wait` off, a
    lock held elsewhere is a `BusyError`: `busy` names what holds it, then its process id;
    the holder writes its id into the file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+b")  # noqa: SIM115 - closed below, after the unlock
    except OSError as e:
        raise EngineError(f"{path}: cannot open the lock file ({e.strerror or e})") from None
    with handle:
        try:
            took = _take(handle, wait)
        except OSError as e:  # a file system without locks (some network shares)
            raise EngineError(f"{path}: cannot lock it ({e.strerror or e})") from None
        if not took:
            handle.seek(0)
            owner = handle.read(32).decode(errors="replace").strip()
            raise BusyError(f"{busy} (process {owner or 'unknown'}, holding {path}); wait "
                            "for it to end or stop it, then try again")
        try:
            if not wait:
                handle.truncate(0)
                handle.write(f"{os.getpid()}\n".encode())
                handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def held_elsewhere(path: Path) -> bool:
    """Whether another open file (another job, here or in another process) holds the lock
    on `path` now; False when there is no such file or it cannot be checked."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError:
        return False
    with handle:
        try:
            took = _take(handle, wait=False)
        except OSError:
            return False
        if took:
            fcntl.flock(handle, fcntl.LOCK_UN)
        return not took


def _take(handle, wait: bool) -> bool:
    """flock an open file exclusively; False when another holds it and `wait` is off
    (OSError where the file system cannot lock)."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
