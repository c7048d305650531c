"""The app icon files, drawn from `resources/icons/understudy.svg` by the app's own renderer.

macOS gets `Understudy.icns`; Linux gets PNGs at the freedesktop sizes. The ICNS container
is simple enough to write directly: the magic `icns`, the total length, then one element
per size — a four-letter type, its length (header included) and a PNG (macOS 10.7+ reads
PNG data in every type used here). All lengths are big-endian 32-bit.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

# ICNS element types holding PNG data, by pixel size (the @2x types share the pixels of the
# next size up; macOS picks per display scale).
ICNS_TYPES: tuple[tuple[bytes, int], ...] = (
    (b"icp4", 16), (b"ic11", 32),     # 16 pt @1x, @2x
    (b"icp5", 32), (b"ic12", 64),     # 32 pt
    (b"ic07", 128), (b"ic13", 256),   # 128 pt
    (b"ic08", 256), (b"ic14", 512),   # 256 pt
    (b"ic09", 512), (b"ic10", 1024),  # 512 pt
)
LINUX_SIZES = (16, 24, 32, 48, 64, 128, 256, 512)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class IcnsError(ValueError):
    """Bytes that are not a well-formed ICNS file."""


def write_icns(pngs: dict[int, bytes], out: Path) -> Path:
    """Write an ICNS file with every `ICNS_TYPES` element, from PNG data keyed by size."""
    missing = sorted({size for _, size in ICNS_TYPES} - set(pngs))
    if missing:
        raise IcnsError(f"PNG data missing for sizes {missing}")
    body = bytearray()
    for kind, size in ICNS_TYPES:
        data = pngs[size]
        if not data.startswith(PNG_MAGIC):
            raise IcnsError(f"{size}px image is not PNG data")
        body += kind + struct.pack(">I", len(data) + 8) + data
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(b"icns" + struct.pack(">I", len(body) + 8) + bytes(body))
    return out


def read_icns(data: bytes) -> dict[bytes, bytes]:
    """The elements of an ICNS file, type -> payload; raises IcnsError on a bad container."""
    if len(data) < 8 or data[:4] != b"icns":
        raise IcnsError("not an ICNS file (no 'icns' magic)")
    (total,) = struct.unpack(">I", data[4:8])
    if total != len(data):
        raise IcnsError(f"header says {total} bytes, file has {len(data)}")
    elements: dict[bytes, bytes] = {}
    pos = 8
    while pos < total:
        if pos + 8 > total:
            raise IcnsError(f"truncated element header at byte {pos}")
        kind = data[pos:pos + 4]
        (length,) = struct.unpack(">I", data[pos + 4:pos + 8])
        if length < 8 or pos + length > total:
            raise IcnsError(f"element {kind!r} at byte {pos} has a bad length {length}")
        elements[kind] = data[pos + 8:pos + length]
        pos += length
    return elements


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if not data.startswith(PNG_MAGIC) or data[12:16] != b"IHDR":
        raise IcnsError("not PNG data")
    return struct.unpack(">II", data[16:24])


@dataclass(frozen=True)
class IconSet:
    icns: Path
    pngs: dict[int, Path]  # Linux sizes -> file


def build_icons(svg: Path, out_dir: Path) -> IconSet:
    """Render `svg` to `out_dir/Understudy.icns` and `out_dir/png/understudy-<N>.png`."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # a build machine has no display
    from PySide6.QtGui import QGuiApplication

    from app.ui.app_icon import png_bytes, render_svg

    _app = QGuiApplication.instance() or QGuiApplication([])  # painting needs one
    sizes = sorted({s for _, s in ICNS_TYPES} | set(LINUX_SIZES))
    rendered = {size: png_bytes(render_svg(svg, size)) for size in sizes}
    icns = write_icns({s: rendered[s] for _, s in ICNS_TYPES}, out_dir / "Understudy.icns")
    png_dir = out_dir / "png"
    png_dir.mkdir(parents=True, exist_ok=True)
    pngs = {}
    for size in LINUX_SIZES:
        path = png_dir / f"understudy-{size}.png"
        path.write_bytes(rendered[size])
        pngs[size] = path
    return IconSet(icns, pngs)
