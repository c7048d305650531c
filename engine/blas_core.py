"""Which OpenBLAS kernels serve MLX's CPU matmuls, and a better choice where OpenBLAS guesses.

OpenBLAS built with DYNAMIC_ARCH picks its kernels from the CPU's model number. A release
older than the CPU does not know it and falls back to "Prescott" (SSE3 kernels), even on a
CPU with AVX-512: Debian 12's 0.3.21 does so on this project's cloud Xeons, where it runs a
16-row float32 product at ~30 GFLOP/s against ~70 with the SkylakeX kernels, and a
256-row one at ~40 against ~190. The variable OPENBLAS_CORETYPE overrides the choice and
is read once, when the library loads, so the launcher sets it before it re-executes with
OpenBLAS preloaded (`app/cli/launcher.py`), and `make test` the same way.

We only ever replace the fallback, chosen from the instruction sets the CPU itself reports;
a core OpenBLAS recognised, or a value the user set, is left alone. No MLX import: the
launcher runs this before MLX loads.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from pathlib import Path

ENV = "OPENBLAS_CORETYPE"
# what DYNAMIC_ARCH settles on for an x86-64 CPU it does not recognise
FALLBACK_CORES = frozenset({"Prescott"})
# the best kernels a CPU's instruction sets allow, best first (names OpenBLAS accepts)
CORE_BY_FLAGS: tuple[tuple[frozenset[str], str], ...] = (
    (frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}), "SkylakeX"),
    (frozenset({"avx2", "fma"}), "Haswell"),
    (frozenset({"avx"}), "Sandybridge"),
)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The instruction-set flags the (first) CPU reports; empty where unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _symbols(lib: Path | None) -> ctypes.CDLL | None:
    """`lib` once loaded, or without `lib` this process's own symbols (where a preloaded
    OpenBLAS serves MLX); None where it cannot be opened."""
    try:
        return ctypes.CDLL(str(lib) if lib is not None else None)
    except OSError:
        return None


def corename(lib: Path | None = None) -> str | None:
    """The kernels OpenBLAS chose (`openblas_get_corename`): those of `lib` once loaded, or,
    without `lib`, of the OpenBLAS already in this process (preloaded for MLX). None where
    there is no OpenBLAS to ask (macOS, MLX's bundled reference BLAS)."""
    get = getattr(_symbols(lib), "openblas_get_corename", None)
    if get is None:
        return None
    get.restype = ctypes.c_char_p
    name = get()
    return name.decode(errors="replace").strip() if name else None


def threads_api() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """Get and set the thread count of the OpenBLAS in this process, or None where there is
    none (`engine.blas_threads` adapts it to the machine's load)."""
    symbols = _symbols(None)
    get = getattr(symbols, "openblas_get_num_threads", None)
    set_ = getattr(symbols, "openblas_set_num_threads", None)
    if get is None or set_ is None:
        return None
    get.restype = ctypes.c_int
    set_.argtypes = [ctypes.c_int]
    return get, set_


def better_core(reported: str | None, flags: frozenset[str]) -> str | None:
    """The core type to force where OpenBLAS fell back; None to keep its own choice."""
    if reported not in FALLBACK_CORES:
        return None
    return next((core for needs, core in CORE_BY_FLAGS if needs <= flags), None)


def coretype_env(lib: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """{OPENBLAS_CORETYPE: core} to add to a process that will preload `lib`, or {}.

    Loads `lib` into this process to ask it, so call it only from a process that is about
    to exec (the launcher) or has nothing else to do (`python -m engine.blas_core`)."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV):
        return {}
    core = better_core(corename(lib), cpu_flags())
    return {ENV: core} if core else {}


def main(argv: list[str]) -> int:
    """`python -m engine.blas_core LIB`: print `OPENBLAS_CORETYPE=<core>` when the library
    would fall back, nothing otherwise (for `env $(…)` in the Makefile)."""
    if len(argv) != 1:
        print("usage: python -m engine.blas_core /path/to/libopenblas.so", file=sys.stderr)
        return 2
    lib = Path(argv[0])
    if not lib.exists():
        return 0
    print(" ".join(f"{k}={v}" for k, v in coretype_env(lib).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
