"""Room for the open files of the training data's shards.

A loaded shard keeps its three per-position files open (`DiskRows` reads rows on
demand, and an open descriptor keeps a segment the online buffer drops readable). The
builtin data of a long job is 75 shards and the online buffer holds one reply per
segment, up to thousands of them; macOS starts a process with a soft limit of 256 descriptors (Linux: 1024). Past the
limit every further shard failed to open, and the online buffer took that failure for
damage and set good segments aside. Any process may raise its soft limit up to its hard
one, as other apps that hold many files do; macOS refuses more than `OPEN_MAX` there.
"""

from __future__ import annotations

import errno
from functools import cache

WANTED = 10_240  # macOS's OPEN_MAX: the most it accepts when the hard limit is unlimited
EXHAUSTED = (errno.EMFILE, errno.ENFILE)


@cache
def allow_open_files() -> int | None:
    """Raise the soft limit on open files toward `WANTED` (never past the hard limit, never
    lower), once per process; the soft limit now in force, None where there is none."""
    try:
        import resource
    except ImportError:  # no such limit on this platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = WANTED if hard == resource.RLIM_INFINITY else min(WANTED, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def too_many_open(path: object, error: OSError) -> str | None:
    """The one line for a shard that could not be opened for want of descriptors (the data
    is fine: nothing to delete), or None when `error` is something else."""
    if error.errno not in EXHAUSTED:
        return None
    limit = allow_open_files()
    allowed = f" (this process may hold {limit})" if limit is not None else ""
    return (f"{path}: too many open files to read the training data{allowed}; the data is "
            "intact. Raise the limit (`ulimit -n`) or remove older data, and run again")
