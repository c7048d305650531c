"""Collecting MLX into a bundle without its three known traps.

1. libmlx finds its Metal kernels through `dladdr`: it loads `mlx.metallib` from the folder
   of the libmlx it was loaded from, or from `Resources/` below that folder, and otherwise
   fails with "Failed to load the default metallib". So the metallib is collected beside
   libmlx (`mlx/lib/`), and after the build every path libmlx can be loaded by is checked
   (and, where PyInstaller moved the data elsewhere, given a relative symlink).
2. `mlx.core` imports `mlx._reprlib_fix` from C++, where PyInstaller's import analysis
   cannot see it: every `mlx` submodule is collected explicitly.
3. PyInstaller's binary-dependency analysis finds libmlx again through `mlx.core`'s rpath
   and may collect a second copy at the top level; two copies mean two MLX runtimes in one
   process (two Metal devices, two allocators). Only `mlx/lib/libmlx.*` is kept.

Everything here works on paths and PyInstaller-style tuples, so tests run it against a fake
wheel and a fake bundle on any platform.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MLX_LIB_DEST = "mlx/lib"
METALLIB = "mlx.metallib"
LIBMLX = re.compile(r"^libmlx\.(so|dylib)(\.\d+)*$")
# Not needed at run time: the C++-extension build helper (pulls in setuptools), the
# `python -m mlx` CLI, and the multi-machine launcher.
EXCLUDED_SUBMODULES = ("mlx.extension", "mlx.__main__", "mlx._distributed_utils")
_SKIP_DIRS = {"include", "share", "lib", "__pycache__"}
_EXTENSION = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\..*(\.so|\.pyd)$")


class MlxLayoutError(RuntimeError):
    """The installed MLX or the built bundle does not have the layout MLX needs."""


def mlx_package_dir() -> Path:
    """The installed `mlx` folder, found without importing MLX."""
    spec = importlib.util.find_spec("mlx")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise MlxLayoutError("mlx is not installed in this environment")
    return Path(locations[0])


def _excluded(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in EXCLUDED_SUBMODULES)


def mlx_submodules(pkg_dir: Path, package: str = "mlx") -> list[str]:
    """Every importable submodule under `pkg_dir` (Python files and extensions), by walking
    the folder rather than importing it, minus `EXCLUDED_SUBMODULES`."""
    names: set[str] = set()
    for folder, dirs, files in os.walk(pkg_dir):
        rel = Path(folder).relative_to(pkg_dir)
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and d.isidentifier())
        prefix = ".".join((package, *rel.parts))
        for f in files:
            if f.endswith(".py"):
                stem = f[:-3]
                name = prefix if stem == "__init__" else f"{prefix}.{stem}"
            elif (m := _EXTENSION.match(f)) is not None:
                name = f"{prefix}.{m.group(1)}"
            else:
                continue
            if name != package and not _excluded(name):
                names.add(name)
    return sorted(names)


def mlx_binaries(pkg_dir: Path) -> list[tuple[str, str]]:
    """(source, dest folder) for libmlx and its sibling dylibs, all kept in `mlx/lib`."""
    lib = pkg_dir / "lib"
    found = sorted(p for p in lib.glob("*") if p.is_file() and (LIBMLX.match(p.name)
                                                                  or p.suffix == ".dylib"))
    if not any(LIBMLX.match(p.name) for p in found):
        raise MlxLayoutError(f"{lib}: no libmlx.so or libmlx.dylib; is mlx installed?")
    return [(str(p), MLX_LIB_DEST) for p in found]


def mlx_datas(pkg_dir: Path, *, metal: bool) -> list[tuple[str, str]]:
    """(source, dest folder) for `mlx.metallib`, collected beside libmlx.

    Args:
        metal: the target runs MLX on Metal (macOS), where a missing metallib is an error.
    """
    metallib = pkg_dir / "lib" / METALLIB
    if metallib.is_file():
        return [(str(metallib), MLX_LIB_DEST)]
    if metal:
        raise MlxLayoutError(f"{metallib}: missing; MLX on Metal cannot run without it "
                             "(is the mlx-metal wheel installed?)")
    return []


def dedupe_libmlx(toc: Iterable[tuple]) -> tuple[list[tuple], list[tuple]]:
    """Drop every libmlx entry of a PyInstaller binaries list but the one in `mlx/lib/`.

    Entries are PyInstaller's (dest name, source, typecode) tuples. Returns (kept, dropped).
    Raises MlxLayoutError when no entry puts libmlx in `mlx/lib/` (it would then have
    nowhere to find its metallib).
    """
    kept: list[tuple] = []
    dropped: list[tuple] = []
    canonical = False
    for entry in toc:
        dest = Path(entry[0])
        if not LIBMLX.match(dest.name) or entry[2:3] == ("SYMLINK",):  # a link is no copy
            kept.append(entry)
        elif dest.parent.as_posix() == MLX_LIB_DEST and not canonical:
            kept.append(entry)
            canonical = True
        else:
            dropped.append(entry)
    if not canonical:
        raise MlxLayoutError(f"no libmlx entry destined for {MLX_LIB_DEST}/ among the binaries")
    return kept, dropped


@dataclass(frozen=True)
class MetallibPlacement:
    """Where one loadable path of libmlx finds its metallib, and whether we linked it."""

    libmlx: Path
    metallib: Path
    linked: bool


def _libmlx_paths(bundle: Path) -> list[Path]:
    return sorted(p for p in bundle.rglob("*") if LIBMLX.match(p.name)
                  and (p.is_symlink() or p.is_file()))


def libmlx_copies(bundle: Path) -> list[Path]:
    """The real (non-symlink) libmlx files in a built bundle; exactly one is right."""
    return [p for p in _libmlx_paths(bundle) if not p.is_symlink()]


def _reachable_metallib(folder: Path) -> Path | None:
    for candidate in (folder / METALLIB, folder / "Resources" / METALLIB):
        if candidate.is_file():  # follows symlinks: a dangling link does not count
            return candidate
    return None


def place_metallib(bundle: Path) -> list[MetallibPlacement]:
    """Make `mlx.metallib` reachable beside every path libmlx can be loaded by.

    A macOS build moves data into `Contents/Resources` and links it back; if the link is
    missing (or libmlx is also reachable through a symlink elsewhere), a relative symlink
    to the bundle's one metallib is added. Raises MlxLayoutError for a bundle with no
    libmlx, two real copies of it, or no metallib at all.
    """
    copies = libmlx_copies(bundle)
    if not copies:
        raise MlxLayoutError(f"{bundle}: no libmlx in the bundle")
    if len(copies) > 1:
        listed = ", ".join(str(p.relative_to(bundle)) for p in copies)
        raise MlxLayoutError(f"{bundle}: libmlx is copied {len(copies)} times ({listed})")
    sources = sorted(p for p in bundle.rglob(METALLIB) if p.is_file() and not p.is_symlink())
    if not sources:
        raise MlxLayoutError(f"{bundle}: no {METALLIB} in the bundle")
    placements = []
    for lib in _libmlx_paths(bundle):
        found = _reachable_metallib(lib.parent)
        linked = False
        if found is None:
            link = lib.parent / METALLIB
            if link.is_symlink():  # dangling
                link.unlink()
            link.symlink_to(os.path.relpath(sources[0], lib.parent))
            found, linked = link, True
        placements.append(MetallibPlacement(lib, found, linked))
    return placements
