"""The macOS-only steps as functions over a fake .app: Info.plist keys, inside-out signing
order and commands, data kept out of Contents/MacOS, the DMG command."""

from __future__ import annotations

import plistlib
import tomllib
from pathlib import Path

import pytest
from appbuild import plist, signing
from appbuild.dmg import hdiutil_command
from appbuild.project import ROOT, project_version

MACHO = bytes.fromhex("cffaedfe") + b"\0" * 60  # 64-bit little-endian Mach-O header start


def touch(path: Path, data: bytes = b"data") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_version_comes_from_pyproject(tmp_path: Path) -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        assert project_version() == tomllib.load(f)["project"]["version"]
    bad = touch(tmp_path / "pyproject.toml", b"[project]\nname = 'x'\n")
    with pytest.raises(ValueError, match="no \\[project\\] version"):
        project_version(bad)


@pytest.fixture
def fake_app(tmp_path: Path) -> Path:
    """An .app as PyInstaller builds it, with a Qt framework, links and data."""
    app = tmp_path / "Understudy.app"
    c = app / "Contents"
    touch(c / "MacOS" / "Understudy", MACHO)
    touch(c / "Frameworks" / "libpython3.11.dylib", MACHO)
    touch(c / "Frameworks" / "mlx" / "lib" / "libmlx.dylib", MACHO)
    touch(c / "Frameworks" / "mlx" / "core.cpython-311-darwin.so", MACHO)
    fw = c / "Frameworks" / "PySide6" / "Qt" / "lib" / "QtCore.framework"
    touch(fw / "Versions" / "A" / "QtCore", MACHO)
    touch(fw / "Versions" / "A" / "Resources" / "Info.plist", b"<plist/>")
    (fw / "Versions" / "Current").symlink_to("A")
    (fw / "QtCore").symlink_to("Versions/Current/QtCore")
    (fw / "Resources").symlink_to("Versions/Current/Resources")
    touch(c / "Resources" / "resources" / "app.qss")
    touch(c / "Resources" / "Understudy.icns", b"icns")
    (c / "Frameworks" / "resources").symlink_to("../Resources/resources")
    info = {"CFBundleExecutable": "Understudy", **plist.info_plist(project_version())}
    touch(c / "Info.plist", plistlib.dumps(info))
    return app


def test_info_plist_keys(fake_app: Path) -> None:
    keys = plist.info_plist("1.2.3")
    assert keys["CFBundleIdentifier"] == "org.understudy.Understudy"
    assert keys["CFBundleShortVersionString"] == keys["CFBundleVersion"] == "1.2.3"
    assert keys["LSMinimumSystemVersion"] == "14.0"
    assert keys["NSHighResolutionCapable"] is True
    assert keys["NSRequiresAquaSystemAppearance"] is False  # follows dark mode
    assert keys["CFBundleIconFile"] == "Understudy.icns"
    assert plist.check_info_plist(fake_app, plist.info_plist(project_version())) == []


def test_info_plist_check_names_each_problem(fake_app: Path) -> None:
    problems = plist.check_info_plist(fake_app, plist.info_plist("9.9.9"))
    assert len(problems) == 2 and all("expected '9.9.9'" in p for p in problems)
    (fake_app / "Contents" / "Resources" / "Understudy.icns").unlink()
    assert any("icon named by CFBundleIconFile is missing" in p
               for p in plist.check_info_plist(fake_app, {}))
    (fake_app / "Contents" / "Info.plist").write_bytes(b"not a plist")
    assert "not a property list" in plist.check_info_plist(fake_app, {})[0]


def test_signing_order_is_inside_out(fake_app: Path) -> None:
    order = signing.signing_order(fake_app)
    rel = [p.relative_to(fake_app.parent).as_posix() for p in order]
    assert rel[-1] == "Understudy.app"
    fw = "Understudy.app/Contents/Frameworks/PySide6/Qt/lib/QtCore.framework"
    assert set(rel) == {
        "Understudy.app", "Understudy.app/Contents/MacOS/Understudy",
        "Understudy.app/Contents/Frameworks/libpython3.11.dylib",
        "Understudy.app/Contents/Frameworks/mlx/lib/libmlx.dylib",
        "Understudy.app/Contents/Frameworks/mlx/core.cpython-311-darwin.so",
        f"{fw}/Versions/A/QtCore", fw,
    }  # no data files, no symlinks
    for i, item in enumerate(order):  # nothing is signed after the bundle that holds it
        assert not any(item in later.parents for later in order[i + 1:]), item
    assert rel.index(f"{fw}/Versions/A/QtCore") < rel.index(fw)


def test_codesign_commands_never_deep() -> None:
    adhoc = signing.codesign_command(Path("/x/U.app"))
    assert adhoc == ["codesign", "--force", "--sign", "-", "--timestamp=none", "/x/U.app"]
    dev = signing.codesign_command(Path("/x/U.app"), "Developer ID Application: A (T)",
                                   entitlements=Path("/e.plist"))
    assert dev[:4] == ["codesign", "--force", "--sign", "Developer ID Application: A (T)"]
    assert "--timestamp" in dev and dev[dev.index("--options") + 1] == "runtime"
    assert dev[dev.index("--entitlements") + 1] == "/e.plist"
    assert "--deep" not in adhoc + dev


def test_data_in_contents_macos_is_reported(fake_app: Path) -> None:
    assert signing.misplaced_in_macos_dir(fake_app) == []
    stray = touch(fake_app / "Contents" / "MacOS" / "resources" / "catalog.json")
    assert signing.misplaced_in_macos_dir(fake_app) == [stray]
    with pytest.raises(RuntimeError, match="data files in Contents/MacOS"):
        signing.sign_app(fake_app)


def test_dmg_command() -> None:
    cmd = hdiutil_command(Path("/stage"), Path("/dist/Understudy-0.1.0.dmg"), "Understudy")
    assert cmd[:2] == ["hdiutil", "create"]
    assert cmd[cmd.index("-srcfolder") + 1] == "/stage"
    assert cmd[cmd.index("-format") + 1] == "UDZO" and cmd[-1] == "/dist/Understudy-0.1.0.dmg"
