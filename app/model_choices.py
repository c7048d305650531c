"""Which models the settings panel offers, and which drafts can pair with the target.

Reads folders only (config.json, tokenizer.json): no MLX, so the GUI thread may call it.
A draft must share the target's tokenizer exactly, since draft token ids are checked by
the target as its own ids; a pairing that fails says why, for the hover text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

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
    """(repo id, snapshot folder) for cached model repos that have a config.json."""
    try:
        from engine.loading import hf_hub_cache

        cache = hf_hub_cache()
    except Exception:  # noqa: BLE001 - no cache is simply no models
        return []
    out = []
    if not cache.is_dir():
        return out
    for repo_dir in sorted(cache.glob("models--*")):
        snaps = [s for s in (repo_dir / "snapshots").glob("*") if _has_config(s)]
        if snaps:
            repo_id = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
            out.append((repo_id, max(snaps, key=lambda s: s.stat().st_mtime)))
    return out


@lru_cache(maxsize=64)
def _vocab(folder: Path, mtime: float) -> tuple[frozenset[tuple[str, int]], int] | None:
    path = folder / "tokenizer.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    vocab = dict(data.get("model", {}).get("vocab", {}) or {})
    for added in data.get("added_tokens", []) or []:
        vocab[added["content"]] = added["id"]
    return frozenset(vocab.items()), len(vocab)


def _vocab_of(folder: Path):
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    return _vocab(folder, path.stat().st_mtime)


def draft_incompatibility(target: Path | None, draft: ModelChoice) -> str | None:
    """Why `draft` cannot draft for the model in `target`, or None when it can."""
    if draft.path is None:
        return "not imported yet: load it once as the target first"
    if target is None:
        return "load a target model first"
    if draft.path.resolve() == target.resolve():
        return "this is the target model itself: a draft must be a smaller, faster model"
    v_tgt, v_dft = _vocab_of(target), _vocab_of(draft.path)
    if v_dft is None:
        return f"no readable tokenizer.json in {draft.path}"
    if v_tgt is None:
        return f"no readable tokenizer.json in the target folder {target}"
    if v_tgt[0] != v_dft[0]:
        if v_tgt[1] != v_dft[1]:
            return (f"its tokenizer differs from the target's ({v_dft[1]} tokens vs "
                    f"{v_tgt[1]}): draft tokens would mean different text")
        return "its tokenizer has the same size as the target's but different tokens"
    return None
