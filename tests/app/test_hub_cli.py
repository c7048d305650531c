"""`understudy models …` end to end against the loopback hub."""

from __future__ import annotations

import argparse
import io
import shutil
from pathlib import Path

import pytest

from app.cli import models as models_cli
from tests.fixtures.hub_server import FakeRepo, HubServer, closed_port_endpoint, isolate_hub_env
from tests.fixtures.tiny_models import write_tiny_model

REPO = "mlx-community/tiny-llama-4bit"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "llama")


@pytest.fixture
def hub(tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    isolate_hub_env(monkeypatch, tmp_path)
    with HubServer() as server:
        server.state.add(FakeRepo.from_folder(REPO, tiny_folder))
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


def _run(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="understudy")
    models_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    out, err = io.StringIO(), io.StringIO()
    return models_cli.run(args, out, err), out.getvalue(), err.getvalue()


def test_search_download_list_rm(hub):
    code, out, _ = _run("models", "search", "tiny")
    assert code == 0 and REPO in out and "yes" in out

    code, out, err = _run("models", "download", REPO)
    assert code == 0, err
    assert "is ready" in out and f"--model {REPO}" in out
    assert "model.safetensors" in err  # progress lines name the files

    code, out, _ = _run("models", "list")
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith(REPO))
    assert "ready" in row and "not ready" not in row
    assert out.splitlines()[1].startswith("demo")

    code, out, _ = _run("models", "rm", REPO, "--yes")
    assert code == 0 and "freed" in out
    assert REPO not in _run("models", "list")[1]


def test_errors_are_one_line_without_traceback(hub, monkeypatch):
    code, _, err = _run("models", "download", "mlx-community/missing")
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1
    assert "Traceback" not in err

    code, _, err = _run("models", "--offline", "search", "tiny")
    assert code == 1 and "Offline mode" in err

    monkeypatch.setenv("HF_ENDPOINT", closed_port_endpoint())
    code, _, err = _run("models", "--timeout", "1", "search", "qwen")
    assert code == 1 and "Cannot reach" in err

    code, _, err = _run("models", "rm", "nobody/nothing", "--yes")
    assert code == 1 and "No model named" in err


def test_import_folder_then_list(hub, tiny_folder, tmp_path):
    src = tmp_path / "Tiny Import"
    shutil.copytree(tiny_folder, src)
    code, out, err = _run("models", "import", str(src))
    assert code == 0, err
    assert "imported tiny-import" in out
    assert any(line.startswith("tiny-import") and "imported" in line
               for line in _run("models", "list")[1].splitlines())
    code, _, err = _run("models", "import", str(tmp_path / "nope.gguf"))
    assert code == 1 and "no such file" in err


def test_pairs_lists_the_catalog(hub):
    code, out, _ = _run("models", "pairs")
    assert code == 0 and "mlx-community/Qwen3-0.6B-4bit" in out
