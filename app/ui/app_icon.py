"""The app icon, drawn from `resources/icons/understudy.svg`.

One renderer serves both the window icon (at run time) and the packaging script that writes
the `.icns` and PNG files (`packaging/appbuild/icons.py`), so there is one drawing of the
icon and no PNGs to keep in step with it. QtSvg renders it; no image library is needed.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
from PySide6.QtGui import QIcon, QImage, QPainter, QPixmap
from PySide6.QtSvg import QSvgRenderer

from resources import resource_path

ICON_SVG = ("icons", "understudy.svg")
WINDOW_ICON_SIZES = (16, 32, 48, 64, 128, 256)


class IconError(ValueError):
    """The icon's SVG is missing or not a valid SVG."""


def render_svg(svg: Path, size: int) -> QImage:
    """`svg` drawn into a transparent `size` x `size` image."""
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise IconError(f"{svg}: not a readable SVG")
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
    renderer.render(painter)
    painter.end()
    return image


def png_bytes(image: QImage) -> bytes:
    """`image` encoded as PNG."""
    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buffer, "PNG"):
        raise IconError("could not encode the icon as PNG")
    buffer.close()
    return bytes(data.data())


def app_icon() -> QIcon:
    """The window icon at the sizes window managers and docks ask for (empty if missing)."""
    svg = resource_path(*ICON_SVG)
    icon = QIcon()
    if not svg.is_file():
        return icon
    for size in WINDOW_ICON_SIZES:
        icon.addPixmap(QPixmap.fromImage(render_svg(svg, size)))
    return icon
