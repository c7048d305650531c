"""Where Understudy keeps its own files.

Everything lives under the platform app-data directory (platformdirs). The environment
variable UNDERSTUDY_DATA_DIR overrides it, so tests and portable installs stay isolated.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path

import platformdirs

from engine.errors import AppDataError, AppWarning

APP_NAME = "Understudy"


class AppDataWarning(AppWarning):
    """A file in the data folder was damaged or could not be written; the run goes on."""


def _warn(message: str) -> None:
    warnings.warn(message, AppDataWarning, stacklevel=3)


def _not_a_folder(path: Path) -> AppDataError:
    return AppDataError(f"{path} is a file where Understudy keeps a folder; move it aside "
                        "(or remove it) and try again")


def set_aside(path: Path) -> Path:
    """Rename a damaged app-owned file or folder to `<name>.damaged-<time>` (nothing a user
    may want to look at is deleted) and return the new name."""
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while aside.exists() or aside.is_symlink():
        aside = aside.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        n += 1
    path.rename(aside)
    return aside


def ensure_folder(path: Path, *, repair: bool) -> Path:
    """`path` as a folder, created if missing. A file in its place is set aside with one
    warning where `repair` (a cache or folder the app rebuilds on its own), and otherwise
    an AppDataError that names it, since it may be something the user put there."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except (FileExistsError, NotADirectoryError):
        if not path.parent.is_dir():  # a file higher up: the user's to move
            raise _not_a_folder(next(p for p in path.parents if p.exists())) from None
        if not repair:
            raise _not_a_folder(path) from None
    aside = set_aside(path)
    _warn(f"{path} was a file where Understudy keeps a folder; moved it to {aside.name}")
    path.mkdir()
    return path


def write_cache_file(path: Path, text: str) -> bool:
    """Replace the cache file `path` with `text` atomically, or warn once and return False:
    a cache only saves time, so a read-only or damaged cache folder never fails a run.
    The temporary file carries the pid (two apps may save at once) and is never left."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        return True
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        _warn(f"{path}: cannot write this cache ({e.strerror or e}); going on without it")
        return False


def app_data_dir() -> Path:
    """The root of Understudy's data (created on first use)."""
    override = os.environ.get("UNDERSTUDY_DATA_DIR")
    root = Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME, False))
    return ensure_folder(root, repair=False)


def _subdir(name: str, *, repair: bool = False) -> Path:
    return ensure_folder(app_data_dir() / name, repair=repair)


def models_dir() -> Path:
    """Imported models (GGUF conversions, the demo model) live here as HF-style folders."""
    return _subdir("models")


def cache_dir() -> Path:
    """Small derived files (calibration results) that can be rebuilt at any time."""
    return _subdir("cache", repair=True)


def log_dir() -> Path:
    """Where the app writes its log: the platform log dir (~/Library/Logs/Understudy on
    macOS, ~/.local/state/Understudy/log on Linux), or `logs/` under UNDERSTUDY_DATA_DIR
    when that is set, so tests and portable installs keep their logs with their data."""
    override = os.environ.get("UNDERSTUDY_DATA_DIR")
    d = Path(override) / "logs" if override else Path(platformdirs.user_log_dir(APP_NAME, False))
    return ensure_folder(d, repair=True)


def heads_dir() -> Path:
    """Trained drafter heads, one folder per target, keyed by a hash of its weights."""
    return _subdir("heads")
