"""The one-way layering: `engine/`, `kernels/`, the model-manager core (`app/hub/`), the
history store and the CLI import no Qt, directly or through anything they import.

Each module is imported in a fresh interpreter in which importing PySide6, shiboken6 or qasync
raises, so a Qt import anywhere down the chain fails the test with the module that pulled it in.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QT_FREE_PACKAGES = ("engine", "kernels", "app.hub", "app.cli", "app.server")
QT_FREE_MODULES = ("app.store", "app.store_repair", "app.about")

_BLOCK_QT = """
import importlib.abc, sys
class BlockQt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("PySide6", "shiboken6", "qasync"):
            raise ImportError(f"Qt imported: {name}")
        return None
sys.meta_path.insert(0, BlockQt())
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
"""


def _modules(package: str) -> list[str]:
    root = REPO.joinpath(*package.split("."))
    names = [package]
    for info in pkgutil.walk_packages([str(root)], prefix=f"{package}."):
        if not info.name.endswith("__main__"):
            names.append(info.name)
    return names


def _import_without_qt(names: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK_QT, *names], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_qt_free_layers_import_without_qt() -> None:
    names = [m for p in QT_FREE_PACKAGES for m in _modules(p)] + list(QT_FREE_MODULES)
    assert "app.hub.download" in names and "engine.decode" in names  # the walk found them
    proc = _import_without_qt(names)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("module", ["app.ui.theme", "app.ui.gui"])
def test_the_check_catches_a_qt_import(module: str) -> None:
    """Negative control: a module that does import Qt fails the same check."""
    proc = _import_without_qt([module])
    assert proc.returncode != 0
    assert "Qt imported" in proc.stderr
