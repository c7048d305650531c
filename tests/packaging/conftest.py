"""Tests of the build helpers in packaging/appbuild (a fake wheel and bundle layout) and of
the Linux bundle built from the real spec (slow).

`packaging/` is put on sys.path the way the spec does it: the folder's name belongs to
pypa's `packaging` library, so the helpers are the `appbuild` package inside it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # the icon renderer paints with Qt

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"
if str(PACKAGING) not in sys.path:
    sys.path.insert(0, str(PACKAGING))
