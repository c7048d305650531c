"""Start-up environment fixes that must happen before MLX is imported.

MLX's Linux CPU wheel bundles a slow reference BLAS. When the system OpenBLAS is present we
re-execute the process once with it preloaded: float32 matmul gets ~35x faster. The
variable UNDERSTUDY_NO_REEXEC=1 turns this off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
    env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    env["UNDERSTUDY_NO_REEXEC"] = "1"
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
