"""Start-up environment fixes that must happen before MLX is imported.

MLX's Linux CPU wheel bundles a slow reference BLAS. When the system OpenBLAS is present we
re-execute the process once with it preloaded: float32 matmul gets ~35x faster. Where that
OpenBLAS does not recognise the CPU and would fall back to its SSE3 kernels, the new process
also gets OPENBLAS_CORETYPE naming the best kernels the CPU's instruction sets allow
(`engine.blas_core`): 2-5x faster again on multi-row products. Ahead of OpenBLAS goes our
own product for a decoding step's few rows (`engine.few_rows`): a 1-token pass of the demo
~2x faster. The variable UNDERSTUDY_NO_REEXEC=1 turns all this off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from engine.blas_core import coretype_env
from engine.few_rows import preload

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
OPENBLAS_CANDIDATES = (
    OPENBLAS,
    Path("/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0"),
)


def openblas_path() -> Path | None:
    """The system OpenBLAS to preload on Linux, if installed."""
    if not sys.platform.startswith("linux"):
        return None
    return next((p for p in OPENBLAS_CANDIDATES if p.exists()), None)


def openblas_loaded() -> bool:
    """Whether some OpenBLAS is already mapped into this process."""
    try:
        return "libopenblas" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def ensure_openblas(argv: list[str]) -> None:
    """Re-exec this process with OpenBLAS preloaded, once, when it helps."""
    lib = openblas_path()
    if lib is None or os.environ.get("UNDERSTUDY_NO_REEXEC") or openblas_loaded():
        return
    if "mlx" in sys.modules:  # too late to help; never re-exec half-way through a run
        return
    env = dict(os.environ)
    few_rows = preload()
    env["LD_PRELOAD"] = ":".join(p for p in (str(few_rows or ""), str(lib),
                                             env.get("LD_PRELOAD", "")) if p)
    env["UNDERSTUDY_NO_REEXEC"] = "1"
    env.update(coretype_env(lib, env))
    command = reexec_command(argv)
    os.execve(command[0], command, env)


def reexec_command(argv: list[str]) -> list[str]:
    """The command line that runs `understudy <argv>` again in a fresh process.

    In the packaged app `sys.executable` is the bundle's own `Understudy` executable, which
    takes the subcommands itself and knows no `-m`; from a checkout or a pip install it is
    the Python interpreter.
    """
    if getattr(sys, "frozen", False):
        return [sys.executable, *argv]
    return [sys.executable, "-m", "app.cli", *argv]
