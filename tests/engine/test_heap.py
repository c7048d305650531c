"""Freed heap pages go back to the OS between training steps (`engine.training.heap`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import sys
from pathlib import Path

import pytest

from engine.training.heap import release_freed_heap

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="glibc's malloc_trim and /proc are Linux's")

BLOCK = 100 * 1024  # below glibc's default mmap threshold: these come from the heap
BLOCKS = 2000  # ~200 MB


def _rss_anon_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"RssAnon:\s+(\d+)", status).group(1)) / 1024


def _fragmented_heap(libc) -> list[int]:
    """~200 MB of touched heap blocks with every other one freed: ~100 MB of free pages
    between live blocks, which glibc keeps resident (only a heap's free top is trimmed)."""
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    for b in blocks:
        ctypes.memset(b, 1, BLOCK)
    for b in blocks[::2]:
        libc.free(b)
    return blocks[1::2]


def test_freed_pages_between_live_blocks_go_back_to_the_os() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    before = _rss_anon_mb()
    live = _fragmented_heap(libc)
    try:
        kept = _rss_anon_mb() - before
        # negative control: freeing alone kept the freed half resident
        assert kept > 150
        release_freed_heap()
        after = _rss_anon_mb() - before
        assert after < kept - 70  # ~100 MB of free pages returned
        assert after > 70  # the live half stays
    finally:
        for b in live:
            libc.free(b)
        release_freed_heap()
