"""Download a model repo into huggingface_hub's standard cache, with progress and cancel.

Files go through `hf_hub_download` pinned to the repo's commit, one by one, small files
first, into `models--org--name/{blobs,snapshots}` exactly as `snapshot_download` lays
them out, so `engine.loading.resolve_model_path("org/name")` finds them. What this module
adds, and why:

* Progress: a tqdm-compatible hook (huggingface_hub calls `update(n)` per chunk) feeds one
  throttled `DownloadProgress` callback with per-file and total bytes, speed and ETA.
* Cancel: a `threading.Event` checked in that hook and between files. Setting it raises
  `DownloadCancelled` inside huggingface_hub's read loop; it deletes its temporary
  `.incomplete` file on the way out. Finished files stay.
* Resume: a dropped connection mid-file is resumed by huggingface_hub itself (it retries
  with `Range: bytes=N-`). Across calls it keeps no partial file (measured in 2.4: each
  attempt writes a uniquely named temporary file and deletes it on failure), so after a
  cancel, an error or a killed app the next call skips every finished file (their snapshot
  links exist, no request is made) and refetches only the unfinished one. Temporary files
  a killed process left behind are swept at the next download of that repo.
* Readiness: `refs/{revision}` is written only when every file is present with the size
  the hub announced, and a manifest of expected sizes is kept in Understudy's data folder,
  so a partial download is never "ready" (and, without a ref, never resolved) — offline too.
* Plain HTTP, not Xet: huggingface_hub would use `hf_xet` for Xet-backed repos, whose
  progress, cancel and resume semantics differ and are not testable here; the hub's
  resolve endpoint serves the same files over HTTP with Range support.
"""

from __future__ import annotations

import functools
import json
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.hub.api import (
    INDEX_FILE,
    LIBRARY_NAME,
    DownloadIntegrityError,
    HubConfig,
    HubError,
    HubOfflineError,
    format_bytes,
    repo_details,
    translate_error,
)
from engine.paths import app_data_dir

STALE_PARTIAL_S = 120.0  # a temporary file untouched this long belongs to a dead process
SPEED_WINDOW_S = 5.0
CHUNK_BYTES = 1024 * 1024


class DownloadCancelled(Exception):  # noqa: N818 - a request, not an error
    """The user cancelled: finished files stay, the partial file was discarded."""


@dataclass(frozen=True)
class DownloadProgress:
    """A snapshot of one download, emitted at most every `min_interval_s` (and per file end)."""

    repo_id: str
    file: str
    file_done: int
    file_total: int | None
    done_bytes: int
    total_bytes: int
    bytes_per_s: float
    eta_s: float | None


@dataclass(frozen=True)
class DownloadResult:
    repo_id: str
    revision: str
    sha: str
    path: Path  # the snapshot folder: what a loader reads
    fetched_bytes: int  # bytes that came over the network in this call
    reused_files: tuple[str, ...]  # files already complete before this call


@dataclass(frozen=True)
class SnapshotStatus:
    """What the cache holds for one repo revision."""

    repo_id: str
    sha: str | None
    path: Path | None
    ready: bool
    problem: str | None


ProgressCallback = Callable[[DownloadProgress], None]


# ---- cache layout ---------------------------------------------------------------------------
def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def manifest_path(repo_id: str) -> Path:
    d = app_data_dir() / "downloads"
    d.mkdir(parents=True, exist_ok=True)
    return d / ("models--" + repo_id.replace("/", "--") + ".json")


def read_manifest(repo_id: str) -> dict[str, Any] | None:
    try:
        data = json.loads(manifest_path(repo_id).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
    tmp.replace(path)


def snapshot_status(repo_id: str, cache: Path, revision: str = "main") -> SnapshotStatus:
    """Is `repo_id` at `revision` fully downloaded? Never touches the network.

    With Understudy's manifest for that commit, every listed file must exist with its
    recorded size. Without one (a repo another tool downloaded) the snapshot must hold
    config.json, tokenizer.json and all weights its index names.
    """
    folder = repo_folder(cache, repo_id)
    ref = folder / "refs" / revision
    sha = ref.read_text(encoding="utf-8").strip() if ref.is_file() else None
    if sha is None and (folder / "snapshots" / revision).is_dir():
        sha = revision  # a commit hash was asked for
    if sha is None:
        return SnapshotStatus(repo_id, None, None, False, "not downloaded completely")
    snap = folder / "snapshots" / sha
    manifest = read_manifest(repo_id)
    if manifest and manifest.get("sha") == sha and isinstance(manifest.get("files"), dict):
        for name, size in manifest["files"].items():
            problem = _file_problem(snap / name, size)
            if problem:
                return SnapshotStatus(repo_id, sha, snap, False, problem)
        if not manifest.get("complete"):
            return SnapshotStatus(repo_id, sha, snap, False, "download not finished")
        return SnapshotStatus(repo_id, sha, snap, True, None)
    needed = ["config.json", "tokenizer.json"]
    index = snap / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            needed += sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return SnapshotStatus(repo_id, sha, snap, False, f"{INDEX_FILE} is unreadable")
    elif not any(p.name.endswith(".safetensors") and p.exists() for p in _iterdir(snap)):
        return SnapshotStatus(repo_id, sha, snap, False, "no safetensors weights")
    for name in needed:
        problem = _file_problem(snap / name, None)
        if problem:
            return SnapshotStatus(repo_id, sha, snap, False, problem)
    return SnapshotStatus(repo_id, sha, snap, True, None)


def _iterdir(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def _file_problem(path: Path, size: int | None) -> str | None:
    if not path.exists():  # follows the snapshot symlink to its blob
        return f"{path.name} is missing"
    if size is not None and path.stat().st_size != size:
        return f"{path.name} has {path.stat().st_size} bytes, expected {size}"
    return None


def sweep_stale_partials(cache: Path, repo_id: str, older_than_s: float = STALE_PARTIAL_S) -> int:
    """Delete temporary files a killed download left in the repo's blobs; returns bytes freed."""
    freed = 0
    now = time.time()
    for p in _iterdir(repo_folder(cache, repo_id) / "blobs"):
        if p.name.endswith(".incomplete"):
            try:
                st = p.stat()
                if now - st.st_mtime > older_than_s:
                    p.unlink()
                    freed += st.st_size
            except OSError:
                pass
    return freed


# ---- progress -------------------------------------------------------------------------------
class _Tracker:
    """Byte accounting for one repo download; raises `DownloadCancelled` when asked to."""

    def __init__(self, repo_id: str, total: int, callback: ProgressCallback | None,
                 cancel: threading.Event | None, min_interval_s: float) -> None:
        self.repo_id, self.total = repo_id, total
        self.callback, self.cancel, self.min_interval_s = callback, cancel, min_interval_s
        self.finished_bytes = 0  # files completed (or already present)
        self.fetched = 0  # bytes received over the network in this call
        self.file, self.file_done, self.file_total = "", 0, None
        self._in_file = False
        self._samples: deque[tuple[float, int]] = deque()
        self._last_emit = 0.0

    def check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise DownloadCancelled(f"download of {self.repo_id} cancelled")

    def start_file(self, name: str, size: int | None) -> None:
        self.check_cancel()
        self.file, self.file_done, self.file_total = name, 0, size
        self._in_file = True
        self.emit(force=True)

    def add(self, n: int) -> None:
        self.file_done += n  # n < 0 when the server ignored a Range request (restart)
        self.fetched += n
        self.check_cancel()
        self.emit()

    def finish_file(self, size: int) -> None:
        self.finished_bytes += size
        self.file_done, self._in_file = size, False
        self.emit(force=True)

    def speed(self, now: float) -> float:
        self._samples.append((now, self.fetched))
        while len(self._samples) > 2 and now - self._samples[0][0] > SPEED_WINDOW_S:
            self._samples.popleft()
        t0, b0 = self._samples[0]
        return (self.fetched - b0) / (now - t0) if now > t0 else 0.0

    def emit(self, force: bool = False) -> None:
        now = time.monotonic()
        bps = self.speed(now)
        if self.callback is None or (not force and now - self._last_emit < self.min_interval_s):
            return
        self._last_emit = now
        in_file = max(self.file_done, 0)
        if self.file_total is not None:
            in_file = min(in_file, self.file_total)
        done = min(self.finished_bytes + (in_file if self._in_file else 0), self.total)
        eta = (self.total - done) / bps if bps > 0 else None
        self.callback(DownloadProgress(self.repo_id, self.file, max(self.file_done, 0),
                                       self.file_total, done, self.total, bps, eta))


class _ProgressBar:
    """Just enough of tqdm's interface for huggingface_hub's `tqdm_class` hook."""

    def __init__(self, tracker: _Tracker, *args: Any, total: int | None = None, initial: int = 0,
                 **kwargs: Any) -> None:
        self.tracker, self.total, self.n = tracker, total, initial

    def update(self, n: int | float | None = 1) -> None:
        step = int(n or 0)
        self.n += step
        self.tracker.add(step)

    def close(self) -> None:
        pass

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- download -------------------------------------------------------------------------------
def _plain_http_only() -> None:
    """Route downloads through the HTTP path (see module docstring: cancel/resume/progress).

    Also read in 1 MiB chunks instead of huggingface_hub's 10 MiB: the hook runs once per
    chunk, so this bounds progress staleness, cancel latency and what a dropped connection
    loses (the retry resumes from the last whole chunk) to 1 MiB.
    """
    from huggingface_hub import constants

    constants.HF_HUB_DISABLE_XET = True
    constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, CHUNK_BYTES)


def _discard(pointer: Path) -> None:
    """Remove a snapshot link and its blob so the next attempt fetches the file again."""
    try:
        blob = pointer.resolve()
        pointer.unlink(missing_ok=True)
        if blob != pointer:
            blob.unlink(missing_ok=True)
    except OSError:
        pass


def download_model(
    repo_id: str,
    config: HubConfig,
    *,
    revision: str | None = None,
    on_progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    min_interval_s: float = 0.1,
    allow_unsupported: bool = False,
) -> DownloadResult:
    """Fetch what `repo_id` needs to run (see `app.hub.api.select_files`) into the HF cache.

    Raises:
        DownloadCancelled: `cancel` was set; call again to continue.
        HubError: offline without a complete local copy, unreachable hub, gated repo,
            unsafe file names, unsupported architecture, or a file of the wrong size.
    """
    rev = revision or "main"
    cache = config.cache
    if config.is_offline:
        status = snapshot_status(repo_id, cache, rev)
        if status.ready and status.path is not None:
            return DownloadResult(repo_id, rev, status.sha or rev, status.path, 0, ())
        raise HubOfflineError(
            f"Offline mode is on and {repo_id} is not fully downloaded; turn offline mode off "
            "to download it.")
    details = repo_details(repo_id, config, revision)
    if not details.supported and not allow_unsupported:
        raise HubError(f"{repo_id} cannot run in Understudy: {details.unsupported_reason}.")
    from huggingface_hub import hf_hub_download

    _plain_http_only()
    sweep_stale_partials(cache, repo_id)
    expected = {f.name: f.size for f in details.files}
    manifest = {"repo_id": repo_id, "revision": rev, "sha": details.sha,
                "files": expected, "complete": False}
    _write_json_atomically(manifest_path(repo_id), manifest)

    snap = repo_folder(cache, repo_id) / "snapshots" / details.sha
    present = {n for n, s in expected.items() if _file_problem(snap / n, s) is None}
    missing_bytes = sum(s or 0 for n, s in expected.items() if n not in present)
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if missing_bytes > free:
        raise HubError(f"{repo_id} needs {format_bytes(missing_bytes)} more disk space in {cache}; "
                       f"only {format_bytes(free)} is free.")

    tracker = _Tracker(repo_id, details.total_bytes, on_progress, cancel, min_interval_s)
    tracker.finished_bytes = sum(expected[n] or 0 for n in present)
    bar = functools.partial(_ProgressBar, tracker)
    for name, size in expected.items():
        if name in present:
            continue
        tracker.start_file(name, size)
        try:
            path = Path(str(hf_hub_download(
                repo_id, name, revision=details.sha, cache_dir=cache, endpoint=config.base_url,
                token=config.token_arg, etag_timeout=config.timeout_s, tqdm_class=bar,  # type: ignore[arg-type]
                library_name=LIBRARY_NAME)))
        except (DownloadCancelled, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001
            raise translate_error(e, config, repo_id, f"downloading {name}") from None
        actual = path.stat().st_size
        if size is not None and actual != size:
            _discard(path)
            raise DownloadIntegrityError(
                f"{repo_id}: {name} arrived with {actual} bytes but the hub lists {size}; it was "
                "discarded and the model is not ready. Try again; if it persists the repo is "
                "inconsistent on the hub.")
        tracker.finish_file(actual)

    if rev != details.sha:
        ref = repo_folder(cache, repo_id) / "refs" / rev
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(ref.name + ".tmp")
        tmp.write_text(details.sha, encoding="utf-8")
        tmp.replace(ref)
    manifest["complete"] = True
    _write_json_atomically(manifest_path(repo_id), manifest)
    tracker.emit(force=True)
    return DownloadResult(repo_id, rev, details.sha, snap, tracker.fetched, tuple(sorted(present)))
