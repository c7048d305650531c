"""MLX's bundling traps, against a fake mlx wheel and fake bundles laid out as PyInstaller
lays out a macOS .app: metallib beside libmlx, every submodule, one libmlx."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from appbuild import mlx_layout
from appbuild.mlx_layout import MlxLayoutError


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def link(path: Path, target: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


@pytest.fixture
def fake_wheel(tmp_path: Path) -> Path:
    """An `mlx` folder shaped like the macOS mlx + mlx-metal wheels."""
    mlx = tmp_path / "site-packages" / "mlx"
    for rel in ("core.cpython-311-darwin.so", "_reprlib_fix.py", "utils.py", "extension.py",
                "__main__.py", "nn/__init__.py", "nn/layers/__init__.py",
                "nn/layers/linear.py", "optimizers/__init__.py",
                "_distributed_utils/launch.py", "include/mlx/array.h",
                "share/cmake/MLX/MLXConfig.cmake", "lib/libmlx.dylib", "lib/mlx.metallib",
                "nn/__pycache__/utils.cpython-311.pyc"):
        touch(mlx / rel)
    return mlx


def test_submodules_include_the_ones_only_cpp_imports(fake_wheel: Path) -> None:
    names = mlx_layout.mlx_submodules(fake_wheel)
    assert names == ["mlx._reprlib_fix", "mlx.core", "mlx.nn", "mlx.nn.layers",
                     "mlx.nn.layers.linear", "mlx.optimizers", "mlx.utils"]


def test_submodules_of_the_installed_mlx() -> None:
    names = mlx_layout.mlx_submodules(mlx_layout.mlx_package_dir())
    assert {"mlx._reprlib_fix", "mlx.core", "mlx.nn", "mlx.nn.layers.base"} <= set(names)
    assert not any(n.startswith(("mlx.extension", "mlx._distributed_utils")) for n in names)


def test_binaries_and_metallib_go_to_mlx_lib(fake_wheel: Path) -> None:
    assert mlx_layout.mlx_binaries(fake_wheel) == [
        (str(fake_wheel / "lib" / "libmlx.dylib"), "mlx/lib")]
    assert mlx_layout.mlx_datas(fake_wheel, metal=True) == [
        (str(fake_wheel / "lib" / "mlx.metallib"), "mlx/lib")]


def test_missing_metallib_is_an_error_only_on_metal(fake_wheel: Path) -> None:
    (fake_wheel / "lib" / "mlx.metallib").unlink()
    with pytest.raises(MlxLayoutError, match="mlx.metallib: missing"):
        mlx_layout.mlx_datas(fake_wheel, metal=True)
    assert mlx_layout.mlx_datas(fake_wheel, metal=False) == []


def test_missing_libmlx_is_an_error(fake_wheel: Path) -> None:
    (fake_wheel / "lib" / "libmlx.dylib").unlink()
    with pytest.raises(MlxLayoutError, match="no libmlx"):
        mlx_layout.mlx_binaries(fake_wheel)


def test_dedupe_keeps_only_the_copy_in_mlx_lib() -> None:
    toc = [
        ("libmlx.dylib", "/sp/mlx/lib/libmlx.dylib", "BINARY"),  # found via core's rpath
        ("mlx/lib/libmlx.dylib", "/sp/mlx/lib/libmlx.dylib", "BINARY"),
        ("mlx/core.cpython-311-darwin.so", "/sp/mlx/core.cpython-311-darwin.so", "EXTENSION"),
        ("PySide6/Qt/lib/QtCore.framework/Versions/A/QtCore", "/sp/QtCore", "BINARY"),
    ]
    kept, dropped = mlx_layout.dedupe_libmlx(toc)
    assert dropped == [toc[0]]
    assert kept == toc[1:]
    alias = ("libmlx.dylib", "mlx/lib/libmlx.dylib", "SYMLINK")  # PyInstaller's own link
    assert mlx_layout.dedupe_libmlx([*toc[1:], alias]) == ([*toc[1:], alias], [])
    with pytest.raises(MlxLayoutError, match="no libmlx entry destined for mlx/lib"):
        mlx_layout.dedupe_libmlx([toc[0], toc[2]])


@pytest.fixture
def fake_app(tmp_path: Path) -> Path:
    """`Contents/` of an .app as PyInstaller 6 builds it: code in Frameworks, data moved to
    Resources and linked back, a top-level link to libmlx from dependency analysis."""
    contents = tmp_path / "Understudy.app" / "Contents"
    touch(contents / "Frameworks" / "mlx" / "lib" / "libmlx.dylib")
    touch(contents / "Resources" / "mlx" / "lib" / "mlx.metallib")
    link(contents / "Frameworks" / "mlx" / "lib" / "mlx.metallib",
         "../../../Resources/mlx/lib/mlx.metallib")
    link(contents / "Frameworks" / "libmlx.dylib", "mlx/lib/libmlx.dylib")
    return contents


def test_metallib_found_beside_libmlx_and_linked_beside_its_alias(fake_app: Path) -> None:
    placements = {p.libmlx.relative_to(fake_app).as_posix(): p
                  for p in mlx_layout.place_metallib(fake_app)}
    canonical = placements["Frameworks/mlx/lib/libmlx.dylib"]
    assert not canonical.linked
    alias = placements["Frameworks/libmlx.dylib"]  # a path dladdr may report, too
    assert alias.linked
    link_path = fake_app / "Frameworks" / "mlx.metallib"
    assert link_path.is_symlink() and os.readlink(link_path) == "../Resources/mlx/lib/mlx.metallib"
    assert link_path.resolve() == (fake_app / "Resources/mlx/lib/mlx.metallib").resolve()
    # idempotent: a second pass finds everything in place
    assert not any(p.linked for p in mlx_layout.place_metallib(fake_app))


def test_missing_link_is_added_and_dangling_link_replaced(fake_app: Path) -> None:
    beside = fake_app / "Frameworks" / "mlx" / "lib" / "mlx.metallib"
    beside.unlink()
    beside.symlink_to("../../../Resources/nowhere.metallib")  # dangling
    placed = {p.libmlx.name + str(p.linked) for p in mlx_layout.place_metallib(fake_app)}
    assert "libmlx.dylibTrue" in placed
    assert beside.is_file()  # now resolves to the real metallib


def test_resources_folder_below_libmlx_counts(tmp_path: Path) -> None:
    touch(tmp_path / "lib" / "libmlx.dylib")
    touch(tmp_path / "lib" / "Resources" / "mlx.metallib")
    [placed] = mlx_layout.place_metallib(tmp_path)
    assert placed.metallib == tmp_path / "lib" / "Resources" / "mlx.metallib" and not placed.linked


def test_two_copies_of_libmlx_are_refused(fake_app: Path) -> None:
    alias = fake_app / "Frameworks" / "libmlx.dylib"
    alias.unlink()
    touch(alias)  # a real second copy instead of a link
    with pytest.raises(MlxLayoutError, match="copied 2 times"):
        mlx_layout.place_metallib(fake_app)


def test_bundle_without_metallib_is_refused(fake_app: Path) -> None:
    (fake_app / "Resources" / "mlx" / "lib" / "mlx.metallib").unlink()
    with pytest.raises(MlxLayoutError, match="no mlx.metallib"):
        mlx_layout.place_metallib(fake_app)
