"""Which models the settings panel offers, and which drafts can pair with the target.

Reads folders only (config.json, tokenizer.json): no MLX. A draft must share the target's
tokenizer exactly, since draft token ids are checked by the target as its own ids;
`engine.compat` decides, and a pairing that fails says why, for the hover text. Listing
models and `draft_pairing` are cheap enough for the GUI thread; `check_pairing` parses
both tokenizer.json files (a 150k-token vocabulary's is 10+ MB, long enough to freeze a
window), so the app runs it on a worker thread (`app.ui.draft_check`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Pairing:
    """A target/draft pair as the tokenizer comparison sees it: resolved folders and the
    modification times of the files it reads, so an edited file is compared again."""

    target: Path
    target_stamp: tuple[float, ...]
    draft: Path
    draft_stamp: tuple[float, ...]


def draft_pairing(target: Path | None, draft: ModelChoice) -> Pairing | str:
    """The tokenizer comparison that decides whether `draft` can draft for `target`, or
    why it cannot from the folders alone. Cheap (a few `stat`s): the GUI thread calls it.
    """
    if draft.path is None:
        return "not imported yet: load it once as the target first"
    if target is None:
        return "load a target model first"
    if draft.path.resolve() == target.resolve():
        return "this is the target model itself: a draft must be a smaller, faster model"
    t, d = target.resolve(), draft.path.resolve()
    return Pairing(t, _stamp(t), d, _stamp(d))


# verdicts by pairing, oldest first; the picker asks again on every refresh, and parsing a
# large tokenizer.json takes seconds
_verdicts: OrderedDict[Pairing, Compatibility] = OrderedDict()
_verdicts_lock = threading.Lock()
MAX_VERDICTS = 256


def known_verdict(pairing: Pairing) -> Compatibility | None:
    """The verdict already made for `pairing`, or None: never reads a tokenizer."""
    with _verdicts_lock:
        return _verdicts.get(pairing)


def check_pairing(pairing: Pairing) -> Compatibility:
    """Compare the two tokenizers (`engine.compat.check_draft_compatible`) and keep the
    verdict. Reads both tokenizer.json files, so it belongs off the GUI thread."""
    known = known_verdict(pairing)
    if known is not None:
        return known
    verdict = check_draft_compatible(pairing.target, pairing.draft)
    with _verdicts_lock:
        _verdicts[pairing] = verdict
        while len(_verdicts) > MAX_VERDICTS:
            _verdicts.popitem(last=False)
    return verdict


def incompatibility(verdict: Compatibility) -> str | None:
    """A verdict as the picker's hover text: the reasons, or None when the pair can draft."""
    return None if verdict.ok else "; ".join(verdict.reasons)
