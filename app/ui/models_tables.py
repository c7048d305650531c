"""Table models behind the Models panel: hub search hits, the local library, pairs.

They know no widgets (views attach to them); each row is one frozen dataclass from
`app.hub.api`, `app.hub.library` or `app.hub.catalog`, returned whole under `ItemRole`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt
from PySide6.QtGui import QColor

from app.hub.api import RepoSummary, format_bytes, format_params
from app.hub.catalog import RecommendedPair
from app.hub.download import DownloadProgress
from app.hub.library import LocalModel
from app.ui.theme import is_dark

Index = QModelIndex | QPersistentModelIndex
ItemRole = Qt.ItemDataRole.UserRole + 1

def good_bad() -> tuple[str, str]:
    """Green and red readable on the current palette (light or dark)."""
    return ("#81c784", "#ef9a9a") if is_dark() else ("#2e7d32", "#b3261e")


def _color(ok: bool | None) -> QColor | None:
    return None if ok is None else QColor(good_bad()[0 if ok else 1])

RIGHT = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
PROGRESS_STEPS = 1000  # bar range; byte counts overflow a Qt int past 2 GB


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "–:––"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def speed_text(p: DownloadProgress) -> str:
    """'12.3 MB/s · ETA 0:42' (the ETA from the recent speed, not the average)."""
    return f"{format_bytes(p.bytes_per_s)}/s · ETA {format_eta(p.eta_s)}"


class _RowsModel(QAbstractTableModel):
    """A read-only table over a list of frozen dataclasses; subclasses say how to show them."""

    COLUMNS: tuple[str, ...] = ()

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._rows: list[Any] = []

    def set_rows(self, rows: Sequence[Any]) -> None:
        self.beginResetModel()
        self._rows = list(rows)
        self.endResetModel()

    def row_item(self, row: int) -> Any:
        return self._rows[row] if 0 <= row < len(self._rows) else None

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: N802, B008 - Qt override
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: N802, B008
        return 0 if parent.isValid() else len(self.COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation,  # noqa: N802
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return self.COLUMNS[section]
        return None

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        item = self.row_item(index.row()) if index.isValid() else None
        if item is None:
            return None
        if role == ItemRole:
            return item
        return self.cell(item, self.COLUMNS[index.column()], role)

    def cell(self, item: Any, column: str, role: int) -> Any:
        raise NotImplementedError


class HubResultsModel(_RowsModel):
    """Search hits: what the listing says about each repo, without per-repo requests."""

    COLUMNS = ("Repo", "Downloads", "Size", "Bits", "Params", "Supported")

    def cell(self, hit: RepoSummary, column: str, role: int) -> Any:
        if role == Qt.ItemDataRole.DisplayRole:
            return {
                "Repo": hit.repo_id + ("  (gated)" if hit.gated else ""),
                "Downloads": f"{hit.downloads:,}",
                "Size": format_bytes(hit.size_bytes),
                "Bits": str(hit.bits) if hit.bits else "–",
                "Params": format_params(hit.n_params),
                "Supported": {True: "✓", False: "✗", None: "?"}[_verdict(hit)],
            }[column]
        if role == Qt.ItemDataRole.ToolTipRole:
            if column == "Supported":
                return support_tooltip(hit)
            if column == "Repo" and hit.gated:
                return f"{hit.repo_id} is gated: it needs a Hugging Face token with access"
            if column == "Size":
                return "Weights only, from the hub's listing; the exact download is in the details"
        if role == Qt.ItemDataRole.ForegroundRole and column == "Supported":
            return _color(_verdict(hit))
        if role == Qt.ItemDataRole.TextAlignmentRole and column not in ("Repo", "Supported"):
            return RIGHT
        if role == Qt.ItemDataRole.TextAlignmentRole and column == "Supported":
            return Qt.AlignmentFlag.AlignCenter
        return None


def _verdict(hit: RepoSummary) -> bool | None:
    """✓ runnable, ✗ not, ? the listing cannot tell."""
    return None if hit.supported is None else hit.loadable


def support_tooltip(hit: RepoSummary) -> str:
    from engine.models import SUPPORTED_MODEL_TYPES

    if hit.supported is None:
        return "The listing does not name the architecture; select the row for details"
    if hit.loadable:
        return f"Understudy runs {hit.model_type} models"
    if hit.supported:
        return ("No safetensors weights in this repo; a GGUF file can be added with "
                "File ▸ Import GGUF…")
    return (f"model_type {hit.model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")


class LibraryTableModel(_RowsModel):
    """Models on this computer: the demo, downloads (complete or not), imports."""

    COLUMNS = ("Name", "Kind", "Size", "Status")
    KINDS = {"demo": "Built-in", "hub": "Download", "imported": "Imported"}

    def cell(self, m: LocalModel, column: str, role: int) -> Any:
        if role == Qt.ItemDataRole.DisplayRole:
            return {
                "Name": m.name,
                "Kind": self.KINDS.get(m.kind, m.kind),
                "Size": format_bytes(m.size_bytes),
                "Status": "✓ Ready" if m.ready else f"✗ {m.problem}",
            }[column]
        if role == Qt.ItemDataRole.ToolTipRole:
            return str(m.path) if column == "Name" and m.path else (m.problem or None)
        if role == Qt.ItemDataRole.ForegroundRole and column == "Status":
            return _color(m.ready)
        if role == Qt.ItemDataRole.TextAlignmentRole and column == "Size":
            return RIGHT
        return None

    def row_of(self, name: str) -> int:
        return next((i for i, m in enumerate(self._rows) if m.name == name), -1)

    def names(self) -> list[str]:
        return [m.name for m in self._rows]


class PairsTableModel(_RowsModel):
    """Recommended target + draft pairs, with what is already on disk."""

    COLUMNS = ("Pair", "Target", "Draft", "Download", "On disk")

    def __init__(self, pairs: Sequence[RecommendedPair], parent: Any = None) -> None:
        super().__init__(parent)
        self._ready: set[str] = set()
        self._present: set[str] = set()
        self.set_rows(pairs)

    def set_library(self, library: Sequence[LocalModel]) -> None:
        self._ready = {m.name for m in library if m.ready}
        self._present = {m.name for m in library}
        if self._rows:
            self.dataChanged.emit(self.index(0, 0), self.index(len(self._rows) - 1,
                                                                len(self.COLUMNS) - 1))

    def status(self, pair: RecommendedPair) -> str:
        t, d = pair.target.repo_id, pair.draft.repo_id
        if t in self._ready and d in self._ready:
            return "✓ Both ready"
        if t in self._ready or d in self._ready:
            return "Target ready" if t in self._ready else "Draft ready"
        return "Partly downloaded" if {t, d} & self._present else "–"

    def cell(self, p: RecommendedPair, column: str, role: int) -> Any:
        if role == Qt.ItemDataRole.DisplayRole:
            return {
                "Pair": p.title,
                "Target": f"{p.target.repo_id.split('/')[-1]} ({p.target.params})",
                "Draft": f"{p.draft.repo_id.split('/')[-1]} ({p.draft.params})",
                "Download": "≈ " + format_bytes(p.target.approx_bytes + p.draft.approx_bytes),
                "On disk": self.status(p),
            }[column]
        if role == Qt.ItemDataRole.ToolTipRole:
            return {"Target": p.target.repo_id, "Draft": p.draft.repo_id}.get(column, p.why)
        if role == Qt.ItemDataRole.TextAlignmentRole and column == "Download":
            return RIGHT
        return None
