"""Downloads against a real loopback hub: progress, cancel/resume, drops, sizes, gating."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from app.hub.api import (
    DownloadIntegrityError,
    HubAuthError,
    HubConfig,
    HubError,
    HubOfflineError,
    UnsafeRepoFileError,
)
from app.hub.download import (
    DownloadCancelled,
    DownloadProgress,
    download_model,
    repo_folder,
    snapshot_status,
    sweep_stale_partials,
)
from tests.fixtures.hub_server import FakeRepo, HubServer, isolate_hub_env
from tests.fixtures.tiny_models import write_tiny_model

REPO = "mlx-community/tiny-llama"
WEIGHTS = "model.safetensors"
SMALL = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "llama")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return isolate_hub_env(monkeypatch, tmp_path)


@pytest.fixture
def hub(tiny_folder: Path, cache: Path):
    with HubServer() as server:
        server.state.add(FakeRepo.from_folder(REPO, tiny_folder))
        yield server


def _config(hub: HubServer, **kw) -> HubConfig:
    return HubConfig(endpoint=hub.endpoint, timeout_s=5.0, **kw)


def test_full_download_lands_in_the_hf_cache_and_loads(hub, cache, tiny_folder):
    seen: list[DownloadProgress] = []
    result = download_model(REPO, _config(hub), on_progress=seen.append, min_interval_s=0)

    snap = repo_folder(cache, REPO) / "snapshots" / result.sha
    assert result.path == snap
    assert sorted(p.name for p in snap.iterdir()) == sorted((*SMALL, WEIGHTS))
    for name in (*SMALL, WEIGHTS):
        assert (snap / name).read_bytes() == (tiny_folder / name).read_bytes()
    assert (repo_folder(cache, REPO) / "refs" / "main").read_text() == result.sha
    assert snapshot_status(REPO, cache).ready
    assert all(hub.gets(n) == 1 for n in (*SMALL, WEIGHTS))

    total = sum((tiny_folder / n).stat().st_size for n in (*SMALL, WEIGHTS))
    assert {p.total_bytes for p in seen} == {total}
    done = [p.done_bytes for p in seen]
    assert done == sorted(done) and done[-1] == total
    weights = [p for p in seen if p.file == WEIGHTS]
    assert len(weights) > 5  # 16 KiB chunks over ~375 KB
    assert weights[-1].file_done == weights[-1].file_total == (tiny_folder / WEIGHTS).stat().st_size
    assert any(p.bytes_per_s > 0 and p.eta_s is not None for p in weights)

    from engine.loading import resolve_model_path

    assert resolve_model_path(REPO) == snap


def test_download_then_generate_by_repo_id(hub, cache, capsys):
    cli = pytest.importorskip("app.cli")
    download_model(REPO, _config(hub))
    code = cli.main(["generate", "--model", REPO, "--prompt", "Hello", "--max-tokens", "4"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert hub.n_requests > 0


def test_cancel_discards_the_partial_file_and_resume_skips_finished_files(hub, cache):
    cancel = threading.Event()

    def on_progress(p: DownloadProgress) -> None:
        if p.file == WEIGHTS and p.file_done > 0:
            cancel.set()

    with pytest.raises(DownloadCancelled):
        download_model(REPO, _config(hub), on_progress=on_progress, cancel=cancel,
                       min_interval_s=0)
    folder = repo_folder(cache, REPO)
    assert not list((folder / "blobs").glob("*.incomplete"))
    snap_files = {p.name for p in next((folder / "snapshots").iterdir()).iterdir()}
    assert snap_files == set(SMALL)
    assert not (folder / "refs" / "main").exists()
    status = snapshot_status(REPO, cache)
    assert not status.ready

    result = download_model(REPO, _config(hub))
    assert set(result.reused_files) == set(SMALL)
    assert all(hub.gets(n) == 1 for n in SMALL)  # finished files are not fetched twice
    assert hub.gets(WEIGHTS) == 2
    assert snapshot_status(REPO, cache).ready


def test_dropped_connection_resumes_with_a_range_request(hub, cache, tiny_folder):
    hub.state.drop_once.add(WEIGHTS)
    result = download_model(REPO, _config(hub))
    assert (result.path / WEIGHTS).read_bytes() == (tiny_folder / WEIGHTS).read_bytes()
    assert hub.gets(WEIGHTS) == 2
    [(name, rng)] = hub.state.range_requests
    assert name == WEIGHTS and rng.startswith("bytes=") and int(rng[6:-1]) > 0
    assert snapshot_status(REPO, cache).ready


@pytest.mark.parametrize("lie", ["api", "short"])
def test_wrong_size_is_not_ready_and_says_so(hub, cache, lie):
    hub.state.size_lies[WEIGHTS] = lie
    with pytest.raises(DownloadIntegrityError) as info:
        download_model(REPO, _config(hub))
    message = str(info.value)
    assert REPO in message and ("size" in message or "bytes" in message)
    folder = repo_folder(cache, REPO)
    assert not (folder / "refs" / "main").exists()
    assert not any(p.name == WEIGHTS for p in folder.glob("snapshots/*/*"))
    assert not snapshot_status(REPO, cache).ready


def test_gated_repo_asks_for_a_token_then_for_access(hub, cache, caplog):
    gated = hub.state.add(FakeRepo(repo_id="meta-llama/gated", files=dict(
        hub.state.repos[REPO].files), gated=True, config=hub.state.repos[REPO].config))
    with pytest.raises(HubAuthError) as info:
        download_model(gated.repo_id, _config(hub))
    assert "token" in str(info.value) and "Settings" in str(info.value)
    assert f"{hub.endpoint}/{gated.repo_id}" in str(info.value)

    secret = "hf_SeCrEtToKeN1234567890"
    hub.state.tokens[secret] = "alice"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(HubAuthError) as info:
        download_model(gated.repo_id, _config(hub, token=secret))
    assert "granted" in str(info.value)
    assert secret not in str(info.value) and secret not in repr(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__

    hub.state.granted.add(gated.repo_id)
    result = download_model(gated.repo_id, _config(hub, token=secret))
    assert (result.path / WEIGHTS).is_file()
    assert secret not in caplog.text
    assert secret not in repr(_config(hub, token=secret))


@pytest.mark.parametrize("bad", ["../escape.json", "/etc/passwd.json", "a/../../b.safetensors",
                                 "C:\\evil.json"])
def test_unsafe_file_names_are_refused_before_any_file_request(hub, cache, bad):
    hub.state.repos[REPO].extra_siblings = (bad,)
    with pytest.raises(UnsafeRepoFileError) as info:
        download_model(REPO, _config(hub))
    assert repr(bad) in str(info.value)
    assert not any("/resolve/" in path or "/cdn/" in path for _, path in hub.state.requests)
    assert not repo_folder(cache, REPO).exists()


def test_offline_mode_makes_no_request(hub, cache, monkeypatch):
    with pytest.raises(HubOfflineError):
        download_model(REPO, _config(hub, offline=True))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubOfflineError):
        download_model(REPO, _config(hub))
    assert hub.n_requests == 0

    monkeypatch.delenv("HF_HUB_OFFLINE")
    online = download_model(REPO, _config(hub))
    before = hub.n_requests
    offline = download_model(REPO, _config(hub, offline=True))
    assert offline.path == online.path and offline.fetched_bytes == 0
    assert hub.n_requests == before


def test_unsupported_architecture_is_refused_before_downloading_weights(hub, cache, tiny_folder):
    files = dict(hub.state.repos[REPO].files)
    files["config.json"] = b'{"model_type": "gpt2"}'
    hub.state.add(FakeRepo(repo_id="openai/gpt2-ish", files=files))
    with pytest.raises(HubError, match="gpt2"):
        download_model("openai/gpt2-ish", _config(hub))
    assert hub.gets(WEIGHTS) == 0


def test_stale_partials_from_a_killed_app_are_swept(hub, cache):
    blobs = repo_folder(cache, REPO) / "blobs"
    blobs.mkdir(parents=True)
    stale, fresh = blobs / "abc.1234.incomplete", blobs / "def.5678.incomplete"
    stale.write_bytes(b"x" * 100)
    fresh.write_bytes(b"y" * 10)
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert sweep_stale_partials(cache, REPO) == 100
    assert not stale.exists() and fresh.exists()


def test_revision_pins_a_commit(hub, cache):
    sha = hub.state.repos[REPO].sha
    result = download_model(REPO, _config(hub), revision=sha)
    assert result.sha == sha
    assert snapshot_status(REPO, cache, revision=sha).ready
    with pytest.raises(HubError, match="revision"):
        download_model(REPO, _config(hub), revision="no-such-branch")
