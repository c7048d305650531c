"""`understudy models …` end to end against the loopback hub."""

from __future__ import annotations

import argparse
import io
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cli import models as models_cli
from app.hub.token_store import SERVICE, USERNAME
from tests.app.test_token_store import MemoryKeyring
from tests.fixtures.hub_server import FakeRepo, HubServer, closed_port_endpoint, isolate_hub_env
from tests.fixtures.tiny_models import write_tiny_model

REPO = "mlx-community/tiny-llama-4bit"
SECRET = "hf_LoginSecret0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2]


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


def test_search_covers_every_author_loadable_first_and_author_narrows(hub, tiny_folder):
    smol = "HuggingFaceTB/SmolLM2-135M-Instruct"
    hub.state.add(FakeRepo.from_folder(smol, tiny_folder, downloads=900))
    hub.state.add(FakeRepo.from_folder("mlx-community/SmolLM2-135M-Instruct-4bit", tiny_folder,
                                       downloads=40))
    hub.state.add(FakeRepo("bartowski/SmolLM2-135M-Instruct-GGUF",
                           {"config.json": b'{"model_type": "llama"}', "m.Q4_0.gguf": b"GGUF"},
                           config={"model_type": "llama"}, downloads=5000))
    code, out, err = _run("models", "search", "smollm2")
    assert code == 0, err
    rows = out.splitlines()[1:]
    assert [r.split()[0] for r in rows] == [smol, "mlx-community/SmolLM2-135M-Instruct-4bit",
                                            "bartowski/SmolLM2-135M-Instruct-GGUF"]
    assert rows[0].endswith("yes") and rows[2].endswith("no (no safetensors)")

    code, out, _ = _run("models", "search", "smollm2", "--author", "mlx-community")
    assert code == 0 and [r.split()[0] for r in out.splitlines()[1:]] == [
        "mlx-community/SmolLM2-135M-Instruct-4bit"]
    code, out, err = _run("models", "search", "smollm2", "--author", "nobody")
    assert code == 0 and out == "" and err == "no models match 'smollm2' by nobody\n"


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


def test_import_refuses_a_truncated_folder_in_one_line(hub, tiny_folder, tmp_path):
    """Before: "imported …" and a `try: understudy generate …` that then failed."""
    src = tmp_path / "truncated"
    shutil.copytree(tiny_folder, src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code, out, err = _run("models", "import", str(src))
    assert code == 1 and out == ""
    assert err.startswith(f"error: {weights}: tensor ") and err.count("\n") == 1
    assert "the file is truncated" in err
    assert "truncated" not in _run("models", "list")[1]


def test_pairs_lists_the_catalog(hub):
    code, out, _ = _run("models", "pairs")
    assert code == 0 and "mlx-community/Qwen3-0.6B-4bit" in out


@pytest.fixture
def keychain():
    import keyring

    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


def test_login_checks_a_piped_token_keeps_it_in_the_keychain_and_logout_clears_it(
        hub, keychain, monkeypatch):
    hub.state.tokens[SECRET] = "alice"
    monkeypatch.setattr(sys, "stdin", io.StringIO(SECRET + "\n"))
    code, out, err = _run("models", "login")
    assert code == 0, err
    assert out == "Logged in as alice; the token is stored in the system keychain.\n"
    assert keychain.store == {(SERVICE, USERNAME): SECRET}
    assert SECRET not in out + err
    assert any(path == "/api/whoami-v2" for _, path in hub.state.requests)

    code, out, _ = _run("models", "logout")
    assert code == 0 and "removed" in out and keychain.store == {}
    code, out, _ = _run("models", "logout")
    assert code == 0 and out == "No Hugging Face token was stored.\n"


def test_login_refuses_a_rejected_token_and_stores_nothing(hub, keychain, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(SECRET + "\n"))
    code, out, err = _run("models", "login")
    assert code == 1 and out == "" and err.startswith("error: The hub rejected this token")
    assert err.count("\n") == 1 and SECRET not in err and keychain.store == {}
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    code, _, err = _run("models", "login")
    assert code == 1 and "No token given" in err


def test_login_stores_an_unchecked_token_when_offline(hub, keychain, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(SECRET + "\n"))
    code, out, err = _run("models", "--offline", "login")
    assert code == 0 and "note: the token was not checked (Offline mode" in err
    assert out.startswith("Logged in;") and keychain.store == {(SERVICE, USERNAME): SECRET}
    assert hub.n_requests == 0


def test_login_at_a_terminal_never_echoes_the_token(hub, tmp_path):
    """`understudy models login` in a real pseudo-terminal: the typed token is not shown."""
    hub.state.tokens[SECRET] = "alice"
    store = tmp_path / "keyring.json"
    env = {**os.environ, "PYTHON_KEYRING_BACKEND": "tests.fixtures.file_keyring.FileKeyring",
           "UNDERSTUDY_TEST_KEYRING": str(store), "PYTHONPATH": str(ROOT)}
    master, slave = pty.openpty()
    child = subprocess.Popen([sys.executable, "-m", "app.cli", "models", "login"], cwd=ROOT,
                             env=env, stdin=slave, stdout=slave, stderr=slave,
                             start_new_session=True)
    os.close(slave)
    screen = b""
    sent = False
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                screen += chunk
            if not sent and b"Token: " in screen:
                os.write(master, SECRET.encode() + b"\n")
                sent = True
        assert child.wait(timeout=30) == 0, screen.decode(errors="replace")
    finally:
        os.close(master)
        if child.poll() is None:
            child.kill()
    text = screen.decode(errors="replace")
    assert sent and "Logged in as alice" in text
    assert SECRET not in text
    assert json.loads(store.read_text()) == {f"{SERVICE}/{USERNAME}": SECRET}
