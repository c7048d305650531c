"""The app icon: the SVG in resources/ rendered by the app's own renderer into an ICNS file
(written by our small writer, read back here) and the Linux PNG sizes."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from appbuild.icons import (
    ICNS_TYPES,
    LINUX_SIZES,
    IcnsError,
    build_icons,
    png_size,
    read_icns,
    write_icns,
)
from appbuild.project import ICON_SVG
from PySide6.QtGui import QImage


@pytest.fixture(scope="module")
def icons(tmp_path_factory: pytest.TempPathFactory):
    return build_icons(ICON_SVG, tmp_path_factory.mktemp("icons"))


def test_icns_holds_every_size_as_png(icons) -> None:
    elements = read_icns(icons.icns.read_bytes())
    assert list(elements) == [kind for kind, _ in ICNS_TYPES]
    for kind, size in ICNS_TYPES:
        assert png_size(elements[kind]) == (size, size), kind


def test_linux_pngs_have_their_sizes_and_show_the_icon(icons) -> None:
    assert sorted(icons.pngs) == sorted(LINUX_SIZES)
    for size, path in icons.pngs.items():
        assert png_size(path.read_bytes()) == (size, size)
    image = QImage(str(icons.pngs[256]))
    assert image.pixelColor(2, 2).alpha() == 0  # transparent corner, outside the rounded square
    assert image.pixelColor(128, 40).alpha() == 255  # the opaque tile
    bubble = image.pixelColor(128, 100)  # the light chat bubble over the dark tile
    assert bubble.lightness() > 200


def test_icns_writer_refuses_missing_sizes_and_non_png(tmp_path: Path) -> None:
    with pytest.raises(IcnsError, match="missing for sizes"):
        write_icns({16: b"\x89PNG\r\n\x1a\n"}, tmp_path / "x.icns")
    with pytest.raises(IcnsError, match="not PNG data"):
        write_icns({size: b"GIF89a" for _, size in ICNS_TYPES}, tmp_path / "x.icns")


def test_icns_reader_refuses_bad_containers(icons) -> None:
    data = icons.icns.read_bytes()
    with pytest.raises(IcnsError, match="no 'icns' magic"):
        read_icns(b"ICNS" + data[4:])
    with pytest.raises(IcnsError, match="header says"):
        read_icns(data[:-1])
    broken = data[:12] + struct.pack(">I", 4) + data[16:]  # first element's length < 8
    with pytest.raises(IcnsError, match="bad length"):
        read_icns(broken)
