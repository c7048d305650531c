"""Data files the app reads (style sheet, catalog, bench prompts, app icon).

`resource_path` is the one way to find them, the same in a checkout, an installed wheel and
the PyInstaller bundle (where they sit under `sys._MEIPASS`, which `Path(__file__)`
arithmetic elsewhere in the code would not know about).
"""

from __future__ import annotations

import sys
from importlib import resources as _resources
from pathlib import Path


def bundle_dir() -> Path | None:
    """The unpacked bundle's root when running as the packaged app, else None."""
    meipass = getattr(sys, "_MEIPASS", None)
    if getattr(sys, "frozen", False) and meipass:
        return Path(meipass)
    return None


def resource_path(*parts: str) -> Path:
    """The path of `resources/<parts...>` (it may not exist: callers say what is missing)."""
    root = bundle_dir()
    base = root / __name__ if root is not None else Path(str(_resources.files(__name__)))
    return base.joinpath(*parts)
