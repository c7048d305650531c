"""Ad-hoc (or Developer ID) signing of the built app, inside-out, without `--deep`.

codesign seals a bundle over the signatures of what it contains, so every nested piece is
signed before the bundle that holds it: each Mach-O file, then each nested bundle
(frameworks), deepest first, and the app last. `--deep` would do this itself but signs
everything with one set of options and is deprecated for signing; Apple asks for
inside-out. `Contents/MacOS` must hold only code: codesign takes a data file there for
unsigned code and refuses the bundle, so data lives in `Contents/Resources`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

# 32/64-bit Mach-O in either byte order, and universal ("fat") binaries.
MACHO_MAGICS = {
    bytes.fromhex(m) for m in ("feedface", "cefaedfe", "feedfacf", "cffaedfe", "cafebabe",
                               "bebafeca")
}
BUNDLE_SUFFIXES = (".app", ".framework", ".bundle", ".appex", ".xpc")


def is_macho(path: Path) -> bool:
    """Whether `path` is a Mach-O (or universal) binary, by its first four bytes."""
    try:
        with path.open("rb") as f:
            return f.read(4) in MACHO_MAGICS
    except OSError:
        return False


def _is_bundle(path: Path) -> bool:
    """A nested bundle codesign can seal: a known suffix and an Info.plist it can read."""
    if path.suffix not in BUNDLE_SUFFIXES or not path.is_dir() or path.is_symlink():
        return False
    return any((path / p).is_file() for p in (
        "Contents/Info.plist", "Resources/Info.plist", "Versions/Current/Resources/Info.plist"))


def signing_order(app: Path) -> list[Path]:
    """Everything to sign in `app`, each item after everything it contains; `app` last.

    Symlinks are skipped (codesign signs what they point at, once), and so are data files.
    """
    items = [p for p in app.rglob("*")
             if not p.is_symlink() and ((p.is_file() and is_macho(p)) or _is_bundle(p))]
    # deeper paths first; the sort is stable, so equal depths keep a fixed (sorted) order
    items.sort(key=lambda p: str(p))
    items.sort(key=lambda p: len(p.relative_to(app).parts), reverse=True)
    return [*items, app]


def codesign_command(path: Path, identity: str = "-", *, entitlements: Path | None = None
                     ) -> list[str]:
    """The codesign call for one item. `-` is ad-hoc; a Developer ID identity also gets
    the hardened runtime and a secure timestamp, which notarization requires."""
    cmd = ["codesign", "--force", "--sign", identity]
    if identity == "-":
        cmd.append("--timestamp=none")
    else:
        cmd += ["--timestamp", "--options", "runtime"]
        if entitlements is not None:
            cmd += ["--entitlements", str(entitlements)]
    return [*cmd, str(path)]


def misplaced_in_macos_dir(app: Path) -> list[Path]:
    """Files in `Contents/MacOS` that are not code (codesign rejects the bundle for them)."""
    macos = app / "Contents" / "MacOS"
    if not macos.is_dir():
        return []
    return sorted(p for p in macos.rglob("*")
                  if p.is_file() and not p.is_symlink() and not is_macho(p))


def sign_app(app: Path, identity: str = "-", *, entitlements: Path | None = None) -> int:
    """Sign `app` inside-out and verify the result; returns how many items were signed."""
    misplaced = misplaced_in_macos_dir(app)
    if misplaced:
        raise RuntimeError("data files in Contents/MacOS (codesign refuses them): "
                           + ", ".join(str(p.relative_to(app)) for p in misplaced))
    order = signing_order(app)
    for item in order:
        subprocess.run(codesign_command(item, identity, entitlements=entitlements), check=True,
                       capture_output=True)
    subprocess.run(["codesign", "--verify", "--strict", "--verbose=2", str(app)], check=True)
    return len(order)
