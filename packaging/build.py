"""`make app`: build the packaged app for this machine from `packaging/understudy.spec`.

macOS: `dist/Understudy.app`, its metallib placement and Info.plist checked, signed
inside-out (ad-hoc unless --identity names a Developer ID), then `dist/Understudy-<version>.dmg`.
Linux: `dist/Understudy/`, whose `Understudy` executable is the GUI and the whole CLI.
Prints the bundle's size and the build time.

    python packaging/build.py [--dist DIR] [--work DIR] [--identity ID] [--no-dmg]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from appbuild import mlx_layout  # noqa: E402
from appbuild.project import APP_NAME, ROOT, project_version  # noqa: E402

SPEC = ROOT / "packaging" / "understudy.spec"
ENTITLEMENTS = ROOT / "packaging" / "entitlements.plist"


def tree_size(path: Path) -> int:
    """Bytes in the files under `path` (symlinks not followed, so nothing counts twice)."""
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def run_pyinstaller(dist: Path, work: Path) -> None:
    env = dict(os.environ, UNDERSTUDY_BUILD_DIR=str(work))
    # PyInstaller finds dependencies with ldd, which lists a preloaded library as a
    # dependency of everything: the system OpenBLAS would be bundled for nothing (35 MB)
    env.pop("LD_PRELOAD", None)
    subprocess.run([sys.executable, "-m", "PyInstaller", "--noconfirm", "--clean",
                    "--log-level", "WARN", "--distpath", str(dist),
                    "--workpath", str(work / "pyinstaller"), str(SPEC)],
                   check=True, cwd=ROOT, env=env)


def finish_macos(dist: Path, identity: str, dmg: bool) -> Path:
    from appbuild import plist, signing
    from appbuild.dmg import build_dmg

    app = dist / f"{APP_NAME}.app"
    for placed in mlx_layout.place_metallib(app / "Contents"):
        how = "linked" if placed.linked else "found"
        print(f"metallib {how} for {placed.libmlx.relative_to(app)}: "
              f"{placed.metallib.relative_to(app)}")
    problems = plist.check_info_plist(app, plist.info_plist(project_version()))
    if problems:
        raise SystemExit("\n".join(problems))
    entitlements = ENTITLEMENTS if identity != "-" else None
    signed = signing.sign_app(app, identity, entitlements=entitlements)
    print(f"signed {signed} items inside-out ({'ad-hoc' if identity == '-' else identity})")
    if dmg:
        image = build_dmg(app, dist / f"{APP_NAME}-{project_version()}.dmg", APP_NAME)
        print(f"disk image: {image} ({image.stat().st_size / 1e6:.0f} MB)")
    return app


def finish_linux(dist: Path) -> Path:
    bundle = dist / APP_NAME
    copies = mlx_layout.libmlx_copies(bundle)
    if len(copies) != 1:
        raise SystemExit(f"{bundle}: expected one libmlx, found {[str(p) for p in copies]}")
    return bundle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", type=Path, default=ROOT / "dist")
    parser.add_argument("--work", type=Path, default=ROOT / "build")
    parser.add_argument("--identity", default="-",
                        help="codesign identity (macOS): '-' is ad-hoc, or a Developer ID")
    parser.add_argument("--no-dmg", action="store_true", help="skip the disk image (macOS)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    run_pyinstaller(args.dist, args.work)
    if sys.platform == "darwin":
        built = finish_macos(args.dist, args.identity, not args.no_dmg)
    else:
        built = finish_linux(args.dist)
    print(f"built {built} in {time.monotonic() - started:.0f} s: "
          f"{tree_size(built) / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
