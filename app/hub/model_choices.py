"""Which models the settings panel offers, and which drafts can pair with the target.

Reads folders only (config.json, tokenizer.json): no MLX, so the GUI thread may call it.
A draft must share the target's tokenizer exactly, since draft token ids are checked by
the target as its own ids; `engine.compat` decides, and a pairing that fails says why,
for the hover text.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from engine.compat import Compatibility, check_draft_compatible
from engine.paths import models_dir

DEMO_SPEC = "demo"
DEMO_FOLDER = "demo-smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelChoice:
    spec: str  # what load_model accepts
    label: str
    path: Path | None  # None while the demo model is not imported yet


def _has_config(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def available_models(extra: tuple[str, ...] = ()) -> list[ModelChoice]:
    """The demo model, imported models, models in the Hugging Face cache, and `extra` specs."""
    demo_dir = models_dir() / DEMO_FOLDER
    out = [ModelChoice(DEMO_SPEC, "Demo: SmolLM2-135M-Instruct",
                       demo_dir if _has_config(demo_dir) else None)]
    seen = {DEMO_SPEC}
    for folder in sorted(models_dir().iterdir()):
        if folder.name != DEMO_FOLDER and folder.is_dir() and _has_config(folder):
            out.append(ModelChoice(str(folder), folder.name, folder))
            seen.add(str(folder))
    for repo_id, snapshot in _hf_cached_models():
        if repo_id not in seen:
            out.append(ModelChoice(repo_id, repo_id, snapshot))
            seen.add(repo_id)
    for spec in extra:
        if spec and spec not in seen:
            path = Path(spec).expanduser()
            out.append(ModelChoice(spec, path.name if path.is_dir() else spec,
                                   path if _has_config(path) else None))
            seen.add(spec)
    return out


def _hf_cached_models() -> list[tuple[str, Path]]:
    """(repo id, snapshot folder) for cached repos whose download is complete.

    A partial download (cancelled, killed, or only its config fetched for the details view)
    has a snapshot folder too; `snapshot_status` is the one judge of "ready", so the
    pickers never offer a model the loader would refuse.
    """
    from app.hub.api import hf_cache_dir
    from app.hub.download import snapshot_status

    try:
        cache = hf_cache_dir()
    except Exception:  # noqa: BLE001 - no cache is simply no models
        return []
    out = []
    if not cache.is_dir():
        return out
    for repo_dir in sorted(cache.glob("models--*")):
        repo_id = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        status = snapshot_status(repo_id, cache)
        if status.ready and status.path is not None and _has_config(status.path):
            out.append((repo_id, status.path))
    return out


def _stamp(folder: Path) -> tuple[float, ...]:
    """Modification times of the files a tokenizer comparison reads (cache key)."""
    out = []
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json",
                 "generation_config.json"):
        try:
            out.append((folder / name).stat().st_mtime)
        except OSError:
            out.append(-1.0)
    return tuple(out)


@lru_cache(maxsize=256)
def _compatibility(target: Path, target_stamp: tuple[float, ...], draft: Path,
                   draft_stamp: tuple[float, ...]) -> Compatibility:
    return check_draft_compatible(target, draft)


def draft_incompatibility(target: Path | None, draft: ModelChoice) -> str | None:
    """Why `draft` cannot draft for the model in `target`, or None when it can.

    The tokenizer comparison is `engine.compat.check_draft_compatible` (cached per file
    modification times, since the picker asks again on every refresh).
    """
    if draft.path is None:
        return "not imported yet: load it once as the target first"
    if target is None:
        return "load a target model first"
    if draft.path.resolve() == target.resolve():
        return "this is the target model itself: a draft must be a smaller, faster model"
    t, d = target.resolve(), draft.path.resolve()
    verdict = _compatibility(t, _stamp(t), d, _stamp(d))
    return None if verdict.ok else "; ".join(verdict.reasons)
