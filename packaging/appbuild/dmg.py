"""The disk image users download: the app beside a link to /Applications, so installing is
a drag. Built with `hdiutil`, which ships with macOS (no dmgbuild dependency)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path


def hdiutil_command(folder: Path, dmg: Path, volume: str) -> list[str]:
    """`hdiutil create` for a compressed, read-only image (UDZO) of `folder`."""
    return ["hdiutil", "create", "-volname", volume, "-srcfolder", str(folder),
            "-fs", "HFS+", "-format", "UDZO", "-ov", str(dmg)]


def stage(app: Path, folder: Path) -> Path:
    """Lay out the image's contents in `folder`: a copy of `app` and the Applications link.

    `ditto` copies bundles as macOS expects (symlinks, extended attributes, signatures).
    """
    subprocess.run(["ditto", str(app), str(folder / app.name)], check=True)
    (folder / "Applications").symlink_to("/Applications")
    return folder


def build_dmg(app: Path, dmg: Path, volume: str) -> Path:
    """Write `dmg` holding `app` (already signed) and a link to /Applications."""
    with tempfile.TemporaryDirectory(prefix="understudy-dmg-") as tmp:
        subprocess.run(hdiutil_command(stage(app, Path(tmp)), dmg, volume), check=True)
    return dmg
