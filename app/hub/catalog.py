"""Recommended target/draft pairs (`resources/catalog.json`) and the draft picker's filter.

The catalog is a starting point; the truth is `engine.compat`, which every draft candidate
passes through before the picker offers it, catalog entry or not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from app.hub.library import LocalModel
from engine.compat import Compatibility, check_draft_compatible
from engine.errors import EngineError
from resources import resource_path


@dataclass(frozen=True)
class CatalogModel:
    repo_id: str
    params: str
    approx_bytes: int


@dataclass(frozen=True)
class RecommendedPair:
    id: str
    title: str
    target: CatalogModel
    draft: CatalogModel
    why: str


def _model(entry: dict) -> CatalogModel:
    return CatalogModel(str(entry["repo"]), str(entry.get("params", "?")),
                        int(entry.get("approx_bytes", 0)))


def load_catalog(text: str | None = None) -> tuple[RecommendedPair, ...]:
    """The bundled pairs (or those in `text`, for tests)."""
    if text is None:
        text = resource_path("catalog.json").read_text(encoding="utf-8")
    try:
        data = json.loads(text)
        return tuple(
            RecommendedPair(str(p["id"]), str(p["title"]), _model(p["target"]),
                            _model(p["draft"]), str(p["why"]))
            for p in data["pairs"])
    except (ValueError, KeyError, TypeError) as e:
        raise EngineError(f"resources/catalog.json is malformed ({type(e).__name__}: {e})") from None


def recommended_drafts(target_repo: str) -> list[str]:
    """Catalog drafts for `target_repo` (empty when the catalog has no pair for it)."""
    return [p.draft.repo_id for p in load_catalog() if p.target.repo_id == target_repo]


def compatible_drafts(target: LocalModel, candidates: Iterable[LocalModel]
                      ) -> list[tuple[LocalModel, Compatibility]]:
    """Ready candidates (other than the target) whose tokenizer matches the target's."""
    if target.path is None:
        return []
    out = []
    for cand in candidates:
        if cand.name == target.name or not cand.ready or cand.path is None:
            continue
        verdict = check_draft_compatible(Path(target.path), Path(cand.path))
        if verdict.ok:
            out.append((cand, verdict))
    return out
