"""Facts about the app that several build steps share: names, ids, version, paths."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APP_NAME = "Understudy"
BUNDLE_ID = "org.understudy.Understudy"
# MLX's Metal wheels are built for macOS 14 (Sonoma) and later on Apple silicon.
MIN_MACOS = "14.0"
ICON_SVG = ROOT / "resources" / "icons" / "understudy.svg"


def project_version(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """`[project] version` from pyproject.toml: the one place the version is written."""
    with pyproject.open("rb") as f:
        data = tomllib.load(f)
    try:
        version = data["project"]["version"]
    except KeyError:
        raise ValueError(f"{pyproject}: no [project] version") from None
    if not isinstance(version, str) or not version.strip():
        raise ValueError(f"{pyproject}: [project] version must be a non-empty string")
    return version
