"""A damaged or unwritable app-data dir, through real CLI runs: the caches are optional (a
failed write is one warning and the run goes on), a file where the app keeps a folder is
one line naming it (or, for what the app owns and rebuilds, set aside with one warning),
and the app's own warnings print as `warning: …`, never as Python's source location."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.test_decode import CHAIN_TEXT, write_chain_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chain_model(tmp_path_factory.mktemp("datadir") / "chain")


def cli(*argv: str, data_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "UNDERSTUDY_DATA_DIR": str(data_dir)}
    return subprocess.run([sys.executable, "-m", "app.cli", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def generate(chain: Path, data_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    return cli("generate", "--model", str(chain), "hello", *flags, data_dir=data_dir)


def warnings_of(proc: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in proc.stderr and "Warning:" not in proc.stderr, proc.stderr
    assert ".py:" not in proc.stderr, proc.stderr  # no Python source location
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: ")]


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """`folder` unwritable even to root (chattr +i), as QA made it."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(
                ["chattr", "+i", str(folder)], capture_output=True).returncode:
            pytest.skip("cannot make a folder immutable here (chattr)")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)


def test_an_unwritable_cache_is_one_warning_and_the_run_goes_on(
        chain: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    with read_only(cache):
        proc = generate(chain, tmp_path, "--drafter", "ngram")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(CHAIN_TEXT)
    (line,) = warnings_of(proc)
    assert str(cache / "calibration.json") in line and "cannot write" in line
    assert list(cache.iterdir()) == []  # no temporary file left behind


def test_an_unwritable_cache_does_not_stop_the_default_drafter(
        chain: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    with read_only(cache):
        proc = generate(chain, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list(cache.iterdir()) == []


def test_a_folder_in_place_of_the_calibration_table_is_set_aside_once(
        chain: Path, tmp_path: Path) -> None:
    table = tmp_path / "cache" / "calibration.json"
    table.mkdir(parents=True)
    (table / "note.txt").write_text("keep me")
    proc = generate(chain, tmp_path)
    assert proc.returncode == 0, proc.stderr
    (line,) = warnings_of(proc)
    assert str(table) in line and "moved it to calibration.json.damaged-" in line
    names = sorted(p.name for p in table.parent.iterdir())
    aside = [n for n in names if n.startswith("calibration.json.damaged-")]
    assert len(aside) == 1 and (table.parent / aside[0] / "note.txt").read_text() == "keep me"
    assert table.is_file() and not [n for n in names if n.endswith(".tmp")]
    again = generate(chain, tmp_path)  # the table written is read back: nothing to say
    assert again.returncode == 0 and warnings_of(again) == []


def test_undecodable_bytes_in_the_table_are_moved_aside_like_bad_json(
        chain: Path, tmp_path: Path) -> None:
    table = tmp_path / "cache" / "calibration.json"
    table.parent.mkdir()
    junk = bytes(range(128, 256)) * 3
    table.write_bytes(junk)
    proc = generate(chain, tmp_path)
    assert proc.returncode == 0, proc.stderr
    (line,) = warnings_of(proc)
    assert line == (f"warning: {table}: not a calibration table (not UTF-8 text); moved to "
                    "calibration.json.bad, calibrating again")
    assert (table.parent / "calibration.json.bad").read_bytes() == junk
    assert table.is_file() and table.read_text(encoding="utf-8").startswith("{")


def test_a_file_in_place_of_the_cache_folder_is_set_aside(chain: Path, tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("not a folder")
    proc = generate(chain, tmp_path)
    assert proc.returncode == 0, proc.stderr
    (line,) = warnings_of(proc)
    assert f"{tmp_path / 'cache'} was a file where Understudy keeps a folder" in line
    assert (tmp_path / "cache").is_dir()
    (aside,) = tmp_path.glob("cache.damaged-*")
    assert aside.read_text() == "not a folder"


@pytest.mark.parametrize("spec", ["demo", "some-imported-model"])
def test_a_file_in_place_of_the_models_folder_is_one_line_naming_it(
        tmp_path: Path, spec: str) -> None:
    """The models folder holds the user's imports: it is never moved on their behalf."""
    (tmp_path / "models").write_text("mine")
    proc = cli("generate", "--model", spec, "hello", data_dir=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr == (f"error: {tmp_path / 'models'} is a file where Understudy keeps "
                           "a folder; move it aside (or remove it) and try again\n")
    assert (tmp_path / "models").read_text() == "mine"


def test_a_file_in_place_of_the_heads_folder_leaves_the_run_going(
        chain: Path, tmp_path: Path) -> None:
    (tmp_path / "heads").write_text("mine")
    proc = generate(chain, tmp_path)
    assert proc.returncode == 0, proc.stderr
    (line,) = warnings_of(proc)
    assert f"{tmp_path / 'heads'} is a file where Understudy keeps a folder" in line
    assert (tmp_path / "heads").read_text() == "mine"


def test_a_file_in_place_of_the_data_dir_is_one_line(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.write_text("x")
    proc = cli("generate", "--model", "demo", "hello", data_dir=root)
    assert proc.returncode == 1 and "Errno" not in proc.stderr
    assert proc.stderr.startswith(f"error: {root} is a file where Understudy keeps a folder")
    assert proc.stderr.count("\n") == 1


def test_library_warnings_keep_their_own_form() -> None:
    """Only the app's own warnings are shortened: a library's still says where it came
    from, which is what its authors need."""
    code = ("import warnings, sys; from app.cli.main import _show_app_warnings; "
            "from engine.paths import AppDataWarning; _show_app_warnings(); "
            "_show_app_warnings(); "
            "warnings.warn('ours', AppDataWarning); warnings.warn('theirs', DeprecationWarning)")
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    lines = proc.stderr.splitlines()
    assert lines[0] == "warning: ours"
    assert "DeprecationWarning: theirs" in lines[1] and "<string>" in lines[1]
