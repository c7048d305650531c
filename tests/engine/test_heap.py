"""A training step keeps no freed memory resident (`engine.training.heap`): glibc's free
heap pages go back to the OS, and MLX's buffer cache is off while the step runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from engine.training.heap import lean_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="glibc's malloc_trim and /proc are Linux's")

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: a test process that already freed much (the rest of the
# suite) serves new blocks from pages it still holds, and its RSS says nothing.
PROBE = """
import ctypes, ctypes.util, json, re
from pathlib import Path
from engine.training.heap import release_freed_heap

BLOCK = 100 * 1024  # below glibc's default mmap threshold: these come from the heap
BLOCKS = 2000  # ~200 MB

def rss_anon_mb():
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"RssAnon:\\s+(\\d+)", status).group(1)) / 1024

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = rss_anon_mb()
blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
for b in blocks:
    ctypes.memset(b, 1, BLOCK)
for b in blocks[::2]:  # every other block: free pages between live ones
    libc.free(b)
kept = rss_anon_mb() - before
release_freed_heap()
print(json.dumps({"kept": kept, "after": rss_anon_mb() - before}))
"""


def test_freed_pages_between_live_blocks_go_back_to_the_os() -> None:
    """~200 MB of touched heap blocks, every other one freed: glibc keeps the freed half
    resident (only a heap's free top is trimmed on its own); `release_freed_heap` returns
    it and leaves the live half."""
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got["kept"] > 150  # negative control: freeing alone returned nothing
    assert got["after"] < got["kept"] - 70  # ~100 MB of free pages returned
    assert got["after"] > 70  # the live half stays


def _cache_limit() -> int:
    previous = mx.set_cache_limit(0)
    mx.set_cache_limit(previous)
    return previous


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu,
                    reason="the buffer cache is switched off on the CPU only")
def test_lean_memory_caches_no_freed_buffer_and_restores_the_limit() -> None:
    limit = _cache_limit()
    mx.clear_cache()
    a = mx.ones((1024, 1024))
    mx.eval(a)
    del a
    assert mx.get_cache_memory() >= 4 * 1024 * 1024  # control: outside, a freed buffer is kept
    mx.clear_cache()
    with lean_memory():
        b = mx.ones((1024, 1024))
        mx.eval(b)
        del b
        assert mx.get_cache_memory() == 0
    assert _cache_limit() == limit
    with pytest.raises(RuntimeError), lean_memory():
        raise RuntimeError("a step that fails")
    assert _cache_limit() == limit  # restored on the way out of a failed step too
