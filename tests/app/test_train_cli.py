"""`understudy train-drafter` and `--drafter head` from the command line."""

from __future__ import annotations

import io
import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import main
from engine.drafters.head import default_layers
from engine.drafters.head_io import current_checkpoint, head_root, load_head
from engine.loading import load_model
from tests.app.test_cli import REPO, assert_one_line_error, cli
from tests.fixtures.tiny_models import write_tiny_model


@pytest.fixture
def tiny4(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny4", num_hidden_layers=4, seed=1)


def numbered_prompts(folder: Path, n: int) -> Path:
    """A --data file of `n` short prompts."""
    path = folder / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Tell me about number {i}."})
                              for i in range(n)))
    return path


def test_head_without_training_is_a_one_line_error(tiny4: Path, tmp_path: Path) -> None:
    proc = cli("generate", "--model", str(tiny4), "--drafter", "head", "--prompt", "Hi",
               data_dir=tmp_path / "data")
    assert_one_line_error(proc, "no trained drafter head", "understudy train-drafter")


def test_train_then_generate_with_the_head(tiny4: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path / "data"))
    prompts = numbered_prompts(tmp_path, 6)
    assert main(["train-drafter", "--model", str(tiny4), "--minutes", "5", "--data",
                 str(prompts), "--max-steps", "3"]) == 0
    captured = capsys.readouterr()
    assert "ckpt-0000003" in captured.out
    assert "data" in captured.err and "done   step      3" in captured.err
    assert main(["generate", "--model", str(tiny4), "--drafter", "head", "--k", "2",
                 "--prompt", "Hello world", "--max-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["drafted"] > 0


def test_minutes_spent_on_data_say_no_head_yet(tiny4: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path / "data"))
    prompts = numbered_prompts(tmp_path, 6)
    assert main(["train-drafter", "--model", str(tiny4), "--minutes", "0.000001",
                 "--data", str(prompts)]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""  # no "head saved"
    # one batch of replies (16 of 6 prompts x 12 rounds), and no "done step 0" line
    assert "no head yet: the time went to making data (16 replies, kept)" in captured.err
    assert "step" not in captured.err
    root = head_root(tiny4)
    assert current_checkpoint(root) is None and list((root / "data").glob("shard-*"))


def test_bad_data_file_is_one_line(tiny4: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    proc = cli("train-drafter", "--model", str(tiny4), "--data", str(bad), "--minutes", "1",
               data_dir=tmp_path / "data")
    assert_one_line_error(proc, "bad.jsonl:1: not valid JSON")


def test_a_bad_data_limit_is_one_line(tiny4: Path, tmp_path: Path) -> None:
    proc = cli("train-drafter", "--model", str(tiny4), "--max-data-mb", "-5", "--minutes", "1",
               data_dir=tmp_path / "data")
    assert_one_line_error(proc, "--max-data-mb must be a positive number, got -5.0")
    assert not (tmp_path / "data").exists() or not list((tmp_path / "data").rglob("shard-*"))


def test_chat_learn_records_and_history_trains_from_it(tiny4: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(data))
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n\n"))
    assert main(["chat", "--model", str(tiny4), "--max-tokens", "12"]) == 0
    assert not list(data.glob("heads/*/online"))  # off unless asked
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\nTell me more\n\n"))
    assert main(["chat", "--model", str(tiny4), "--max-tokens", "12", "--learn"]) == 0
    assert len(list(data.glob("heads/*/online/layers-*/seg-*"))) == 2
    capsys.readouterr()
    # the app's history is empty: the buffer alone is the data
    assert main(["train-drafter", "--model", str(tiny4), "--data", "history", "--minutes",
                 "5", "--max-steps", "2"]) == 0
    err = capsys.readouterr().err
    found = re.search(r"history: (\d+) positions recorded while chatting \(online buffer\), "
                      r"0 stored replies to read", err)
    assert found and int(found.group(1)) > 0, err
    record = json.loads(next(data.glob("heads/*/ckpt-*/training.json")).read_text())
    assert record["sources"]["online_positions"] == int(found.group(1))
    assert record["sources"]["history_positions"] == 0


def _train_with_file_limit(tiny4: Path, data: Path, prompts: Path, limit: int
                           ) -> subprocess.CompletedProcess:
    """`train-drafter` in a process whose files may not grow past `limit` bytes: its writes
    fail in the kernel the way they do on a full disk (SIGXFSZ ignored, so as EFBIG)."""
    def cap() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "UNDERSTUDY_DATA_DIR": str(data)}
    return subprocess.run([sys.executable, "-m", "app.cli", "train-drafter", "--model",
                           str(tiny4), "--minutes", "5", "--data", str(prompts),
                           "--max-steps", "6"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=cap)


@pytest.mark.parametrize("failing", ["checkpoint", "data"])
def test_a_full_disk_is_one_line_and_the_last_head_stays_in_use(
        tiny4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(data))
    prompts = numbered_prompts(tmp_path, 6)
    assert main(["train-drafter", "--model", str(tiny4), "--minutes", "5", "--data",
                 str(prompts), "--max-steps", "3"]) == 0
    target = load_model(str(tiny4))
    root = head_root(Path(target.path))
    before = current_checkpoint(root)
    assert before is not None and before.name == "ckpt-0000003"
    if failing == "checkpoint":  # the data is complete: the next write is a checkpoint
        limit = (before / "model.safetensors").stat().st_size // 2
    else:  # new prompts to reply to: the next write is a data shard
        prompts = tmp_path / "more.jsonl"
        prompts.write_text("\n".join(json.dumps({"prompt": f"What about the colour {c}?"})
                                     for c in ("red", "green", "blue", "gold", "grey")))
        limit = min(p.stat().st_size for p in root.glob("data/shard-*/features.npy")) // 2

    proc = _train_with_file_limit(tiny4, data, prompts, limit)

    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    want = "a checkpoint" if failing == "checkpoint" else "training data"
    assert last.startswith(f"error: could not write {want} under {root}"), last
    assert "MB free there" in last and "run again" in last
    if failing == "checkpoint":
        assert "ckpt-0000003, stays in use" in last
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]
    assert current_checkpoint(root) == before
    head = load_head(before, target.model)  # still whole, and the model still drafts with it
    assert head.config.aux_layers == default_layers(target.model.n_layers)
    assert main(["generate", "--model", str(tiny4), "--drafter", "head", "--k", "2",
                 "--prompt", "Hello world", "--max-tokens", "8"]) == 0


def test_ctrl_c_while_training_writes_a_checkpoint_of_the_steps_so_far(
        tiny4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT once steps have run (before the first periodic checkpoint, every 100
    steps): the job finishes its slice and saves a head of every step it took. It used to
    raise inside the job, which ended it where it stood: no head, and "no head yet: the
    time went to making data"."""
    data = tmp_path / "data"
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(data))
    prompts = numbered_prompts(tmp_path, 12)
    env = {**os.environ, "UNDERSTUDY_DATA_DIR": str(data)}
    job = subprocess.Popen([sys.executable, "-m", "app.cli", "train-drafter", "--model",
                            str(tiny4), "--data", str(prompts), "--minutes", "30"],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        assert job.stderr is not None
        while True:
            line = job.stderr.readline()
            assert line, "the job ended before it trained"
            if line.split()[:2] == ["train", "step"]:
                step = int(line.split()[2])
                break
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, err
    assert "stopping after a checkpoint" in err and "no head yet" not in err
    root = head_root(Path(load_model(str(tiny4)).path))
    saved = current_checkpoint(root)
    assert saved is not None and out.strip() == f"head saved: {saved}"
    assert step <= int(saved.name.split("-")[1]) < 100


def test_a_job_killed_mid_run_leaves_no_lock_and_the_next_one_goes_on(
        tiny4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 while a job holds its head folder: the lock dies with the process (its
    `.job.lock` file, naming the dead pid, stays), so the next job runs, on the data
    the killed one saved."""
    data = tmp_path / "data"
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(data))
    prompts = numbered_prompts(tmp_path, 40)
    env = {**os.environ, "UNDERSTUDY_DATA_DIR": str(data)}
    args = ["train-drafter", "--model", str(tiny4), "--data", str(prompts)]
    job = subprocess.Popen([sys.executable, "-m", "app.cli", *args, "--minutes", "30"],
                           cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert job.stderr is not None
        while not job.stderr.readline().startswith("data"):  # a shard is on disk
            assert job.poll() is None, "the job ended before it made data"
        busy = subprocess.run([sys.executable, "-m", "app.cli", *args, "--minutes", "1"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert busy.returncode == 1
        assert f"is running (process {job.pid}," in busy.stderr.splitlines()[-1]
    finally:
        job.kill()
        job.wait(timeout=60)
    root = head_root(Path(load_model(str(tiny4)).path))
    assert (root / ".job.lock").read_text().strip() == str(job.pid)
    made = sorted(p.name for p in (root / "data").glob("shard-*[0-9]"))
    assert made and current_checkpoint(root) is None
    again = subprocess.run([sys.executable, "-m", "app.cli", *args, "--minutes", "5",
                            "--max-steps", "2"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert current_checkpoint(root).name == "ckpt-0000002"
    assert set(made) <= {p.name for p in (root / "data").glob("shard-*[0-9]")}
