"""The few-row products of decoding, served by our own cblas_sgemm ahead of OpenBLAS.

MLX's CPU backend hands every float32 matmul to cblas_sgemm. A decoding step's products
are a few rows against weight matrices read from memory, and there OpenBLAS reads the
weights at a fraction of the memory's bandwidth: on this project's 2-core VMs a 1-row
576 x 1536 product took ~220 us where streaming the matrix once takes ~65, and a whole
1-token pass of the demo ~50 ms. `kernels/cpu/few_rows_sgemm.c` computes row-major
x @ W.T of up to 64 rows itself (AVX2 + FMA, each output summed in one fixed order, so a
row of a verify pass equals the one-token step's bit for bit) and passes every other
product on to OpenBLAS: the demo's 1-token pass took 26-32 ms with it, 4 rows ~50, 8 ~70,
16 ~94 (OpenBLAS alone: ~51, 73-76, 80, ~94).

It is preloaded ahead of OpenBLAS (the launcher; `make test` through `main`), so MLX
needs no change and a machine without it runs as before. It is built from source the
first time, with the system C compiler, into the cache dir under a name that carries the
source's digest: a changed kernel is a new library, and a new cost table
(`engine.calibration.blas_in_use` lists it). Linux on x86-64 with AVX2 and FMA only;
UNDERSTUDY_FEW_ROWS=0 turns it off.

The same library carries the attention of every inference pass (kernels/cpu/attention.c,
called by `kernels.host_attention`), run on the same helper threads: where the library is
not loaded, MLX's ops compute attention as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from engine.blas_core import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "cpu" / "few_rows_sgemm.c"
# built into the same library: an inference pass's attention (`kernels.host_attention`),
# on the same helper threads
ATTENTION_SOURCE = SOURCE.with_name("attention.c")
ENV = "UNDERSTUDY_FEW_ROWS"
CPU_FLAGS = frozenset({"avx2", "fma"})
# no contraction of the scalar tail into FMAs: every instantiation of a tile then does the
# same arithmetic (the vector FMAs are written out)
CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-shared", "-fPIC")
# where the CPU has these: 32 vector registers, so wider tiles (the products' arithmetic is
# unchanged: 256-bit vectors either way)
WIDE_TILE_FLAGS = frozenset({"avx512f", "avx512vl"})
WIDE_CFLAGS = (*CFLAGS, "-mavx512vl")
LIBS = ("-ldl", "-lpthread")
BUILD_TIMEOUT_S = 120


def unsupported(flags: frozenset[str] | None = None) -> str | None:
    """Why the kernel cannot run here, or None where it can."""
    if os.environ.get(ENV, "").strip() == "0":
        return f"turned off ({ENV}=0)"
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return "only built for Linux on x86-64"
    missing = CPU_FLAGS - (cpu_flags() if flags is None else flags)
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    return None


def compile_flags(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The compiler's flags for a CPU with these instruction-set flags (this one's)."""
    flags = cpu_flags() if flags is None else flags
    return WIDE_CFLAGS if flags >= WIDE_TILE_FLAGS else CFLAGS


def tiles_of(library: str | Path) -> str | None:
    """Which tiles the built library at this path has ("AVX-512VL" or "AVX2"), by its
    name; None for a library this source did not build."""
    name = Path(library).name
    for flags, tiles in ((CFLAGS, "AVX2"), (WIDE_CFLAGS, "AVX-512VL")):
        if name == library_path(Path("."), flags).name:
            return tiles
    return None


def library_path(cache: Path | None = None, flags: tuple[str, ...] | None = None) -> Path:
    """Where the library for this source and these compiler flags (this CPU's) is, or
    would be, built."""
    from engine.paths import cache_dir

    flags = compile_flags() if flags is None else flags
    digest = hashlib.sha256(SOURCE.read_bytes() + ATTENTION_SOURCE.read_bytes()
                            + " ".join(flags).encode()).hexdigest()[:16]
    return (cache if cache is not None else cache_dir() / "native") / \
        f"libunderstudyblas-{digest}.so"


def compiler() -> str | None:
    """The C compiler to build with: $CC, else gcc, cc or clang on the PATH (gcc first:
    clang's build ran 8- to 16-row products ~1.5x slower here)."""
    named = os.environ.get("CC")
    if named:
        return named
    return next((c for c in ("gcc", "cc", "clang") if shutil.which(c)), None)


def build(dest: Path | None = None, flags: tuple[str, ...] | None = None) -> Path | None:
    """The built library, compiling it first where it is missing; None where it cannot be
    built. Written under a temporary name and renamed, so a build cut short never leaves a
    library half-written. A failed build says why once (a warning, and the compiler's
    words in `<library>.failed`) and is not tried again for the same source: the app starts
    as fast as before, on OpenBLAS alone."""
    flags = compile_flags() if flags is None else flags
    dest = dest if dest is not None else library_path(flags=flags)
    if dest.exists():
        return dest
    failed = dest.with_suffix(".failed")
    if failed.exists():
        log.info("few-row products: the last build failed (%s); OpenBLAS serves them", failed)
        return None
    cc = compiler()
    if cc is None:
        log.info("few-row products: no C compiler (gcc, cc or clang); OpenBLAS serves them")
        return None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("few-row products: cannot create %s (%s)", dest.parent, e.strerror or e)
        return None
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run([cc, *flags, "-o", str(tmp), str(SOURCE), str(ATTENTION_SOURCE),
                               *LIBS],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode == 0:
            os.replace(tmp, dest)
            return dest
        why = f"{cc} could not build {SOURCE}:\n{done.stderr.strip()[-4000:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        why = f"building with {cc} failed ({e})"
    finally:
        tmp.unlink(missing_ok=True)
    log.warning("few-row products: %s", why)
    with contextlib.suppress(OSError):
        failed.write_text(why + "\n")
    return None


def preload() -> Path | None:
    """The library to preload ahead of OpenBLAS, built if need be; None where it does not
    apply here or cannot be built."""
    reason = unsupported() or (None if SOURCE.exists() else f"{SOURCE} is missing")
    if reason is not None:
        log.info("few-row products: %s", reason)
        return None
    try:
        flags = compile_flags()
        built = build(flags=flags)
        if built is None and flags != CFLAGS:
            # a compiler that cannot target AVX-512VL still builds the AVX2 tiles
            built = build(flags=CFLAGS)
        return built
    except Exception as e:  # noqa: BLE001 - never stop the app from starting over this
        log.warning("few-row products: %s", e)
        return None


def main(argv: list[str]) -> int:
    """`python -m engine.few_rows OPENBLAS`: print `LD_PRELOAD=<ours>:OPENBLAS` (just
    OPENBLAS where ours does not apply), for `env $(…)` in the Makefile."""
    if len(argv) != 1:
        print("usage: python -m engine.few_rows /path/to/libopenblas.so", file=sys.stderr)
        return 2
    ours = preload()
    print("LD_PRELOAD=" + ":".join([*([str(ours)] if ours else []), argv[0]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
