"""The app's Info.plist keys, and a check that a built bundle carries them."""

from __future__ import annotations

import plistlib
from pathlib import Path
from typing import Any

from appbuild.project import APP_NAME, BUNDLE_ID, MIN_MACOS

ICON_FILE = "Understudy.icns"


def info_plist(version: str, *, bundle_id: str = BUNDLE_ID, min_macos: str = MIN_MACOS
               ) -> dict[str, Any]:
    """Keys for `Contents/Info.plist` (PyInstaller's BUNDLE merges them over its defaults).

    NSHighResolutionCapable gives Retina rendering; NSRequiresAquaSystemAppearance False lets
    the app follow the system's dark mode (Qt then switches its palette live).
    """
    return {
        "CFBundleName": APP_NAME,
        "CFBundleDisplayName": APP_NAME,
        "CFBundleIdentifier": bundle_id,
        "CFBundleShortVersionString": version,
        "CFBundleVersion": version,
        "CFBundleIconFile": ICON_FILE,
        "CFBundlePackageType": "APPL",
        "LSMinimumSystemVersion": min_macos,
        "LSApplicationCategoryType": "public.app-category.developer-tools",
        "NSHighResolutionCapable": True,
        "NSRequiresAquaSystemAppearance": False,
        "NSPrincipalClass": "NSApplication",
        "NSHumanReadableCopyright": "Apache-2.0",
    }


def check_info_plist(app: Path, expected: dict[str, Any]) -> list[str]:
    """Problems with `app/Contents/Info.plist` against `expected` (empty when it matches)."""
    path = app / "Contents" / "Info.plist"
    try:
        with path.open("rb") as f:
            actual = plistlib.load(f)
    except FileNotFoundError:
        return [f"{path}: missing"]
    except (plistlib.InvalidFileException, ValueError) as e:
        return [f"{path}: not a property list ({e})"]
    problems = [f"{path}: {key} is {actual.get(key)!r}, expected {value!r}"
                for key, value in expected.items() if actual.get(key) != value]
    icon = app / "Contents" / "Resources" / str(actual.get("CFBundleIconFile", ""))
    if not icon.is_file():
        problems.append(f"{icon}: the icon named by CFBundleIconFile is missing")
    exe = app / "Contents" / "MacOS" / str(actual.get("CFBundleExecutable", ""))
    if not exe.is_file():
        problems.append(f"{exe}: the executable named by CFBundleExecutable is missing")
    return problems
