"""Where Understudy keeps its own files.

Everything lives under the platform app-data directory (platformdirs). The environment
variable UNDERSTUDY_DATA_DIR overrides it, so tests and portable installs stay isolated.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "Understudy"


def app_data_dir() -> Path:
    """The root of Understudy's data (created on first use)."""
    override = os.environ.get("UNDERSTUDY_DATA_DIR")
    root = Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME, False))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _subdir(name: str) -> Path:
    d = app_data_dir() / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def models_dir() -> Path:
    """Imported models (GGUF conversions, the demo model) live here as HF-style folders."""
    return _subdir("models")


def cache_dir() -> Path:
    """Small derived files (calibration results) that can be rebuilt at any time."""
    return _subdir("cache")


def log_dir() -> Path:
    """Where the app writes its log: the platform log dir (~/Library/Logs/Understudy on
    macOS, ~/.local/state/Understudy/log on Linux), or `logs/` under UNDERSTUDY_DATA_DIR
    when that is set, so tests and portable installs keep their logs with their data."""
    override = os.environ.get("UNDERSTUDY_DATA_DIR")
    d = Path(override) / "logs" if override else Path(platformdirs.user_log_dir(APP_NAME, False))
    d.mkdir(parents=True, exist_ok=True)
    return d


def heads_dir() -> Path:
    """Trained drafter heads, one folder per target, keyed by a hash of its weights."""
    return _subdir("heads")
