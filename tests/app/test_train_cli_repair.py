"""`train-drafter` and `--drafter head` after damage (a truncated checkpoint, a bad
current.json, a damaged online segment) and after short runs: each is repaired or said in
one line, and repeated short runs make progress."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from app.cli import main
from engine.drafters.head_io import current_checkpoint, head_root, read_record
from tests.app.test_train_cli import numbered_prompts
from tests.fixtures.tiny_models import write_tiny_model


@pytest.fixture
def tiny4(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "tiny4", num_hidden_layers=4, seed=1)


def _train(tiny4: Path, prompts: Path, *extra: str, minutes: str = "5") -> int:
    return main(["train-drafter", "--model", str(tiny4), "--minutes", minutes, "--data",
                 str(prompts), *extra])


def _generate(tiny4: Path) -> int:
    return main(["generate", "--model", str(tiny4), "--drafter", "head", "--k", "2",
                 "--prompt", "Hello world", "--max-tokens", "8", "--json"])


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def test_a_truncated_newest_checkpoint_is_set_aside_and_training_resumes_before_it(
        tiny4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path / "data"))
    prompts = numbered_prompts(tmp_path, 6)
    assert _train(tiny4, prompts, "--max-steps", "2") == 0
    assert _train(tiny4, prompts, "--max-steps", "4") == 0
    root = head_root(tiny4)
    assert current_checkpoint(root).name == "ckpt-0000004"
    os.truncate(root / "ckpt-0000004" / "model.safetensors", 1000)
    capsys.readouterr()

    # generate uses the earlier complete head, says so once, and renames nothing
    assert _generate(tiny4) == 0
    err = capsys.readouterr().err
    assert len(_warnings(err)) == 1, err
    assert "ckpt-0000004 is damaged" in err and "using the earlier ckpt-0000002" in err
    assert (root / "ckpt-0000004").is_dir()

    assert _train(tiny4, prompts, "--max-steps", "5") == 0
    captured = capsys.readouterr()
    lines = _warnings(captured.err)
    assert len(lines) == 1, captured.err
    assert "ckpt-0000004" in lines[0] and "set aside as ckpt-0000004.damaged" in lines[0]
    assert (root / "ckpt-0000004.damaged").is_dir()
    # resumed from step 2: three more steps, a new checkpoint at 5
    assert "head saved:" in captured.out and "ckpt-0000005" in captured.out
    assert read_record(current_checkpoint(root))["history"][0]["step"] == 2
    assert read_record(current_checkpoint(root))["steps"] == 5
    assert (root / "ckpt-0000004.damaged").is_dir()  # publishing does not drop it

    # a second damaged checkpoint replaces the first: one is enough to look at, and each
    # is a head with its optimizer state
    os.truncate(root / "ckpt-0000005" / "model.safetensors", 1000)
    assert _train(tiny4, prompts, "--max-steps", "6") == 0
    assert "set aside as ckpt-0000005.damaged" in capsys.readouterr().err
    assert sorted(p.name for p in root.glob("*.damaged*")) == ["ckpt-0000005.damaged"]


def test_the_only_checkpoint_damaged_generate_says_what_to_do_and_training_starts_afresh(
        tiny4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path / "data"))
    prompts = numbered_prompts(tmp_path, 6)
    assert _train(tiny4, prompts, "--max-steps", "2") == 0
    root = head_root(tiny4)
    os.truncate(root / "ckpt-0000002" / "model.safetensors", 1000)
    capsys.readouterr()
    assert _generate(tiny4) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert "does not fit in the file (1000 bytes)" in err
    assert "understudy train-drafter --model" in err and "sets the damaged checkpoint aside" in err

    assert _train(tiny4, prompts, "--max-steps", "1") == 0
    captured = capsys.readouterr()
    lines = _warnings(captured.err)
    assert len(lines) == 2, captured.err
    assert "set aside as ckpt-0000002.damaged" in lines[0]
    assert "starting a fresh head" in lines[1]
    assert current_checkpoint(root).name == "ckpt-0000001"
    assert _generate(tiny4) == 0


@pytest.mark.parametrize("damage", ["unreadable", "missing", "points nowhere"])
def test_a_bad_current_json_falls_back_to_the_newest_checkpoint(
        damage: str, tiny4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path / "data"))
    prompts = numbered_prompts(tmp_path, 6)
    assert _train(tiny4, prompts, "--max-steps", "2") == 0
    root = head_root(tiny4)
    pointer = root / "current.json"

    def spoil() -> None:
        if damage == "unreadable":
            pointer.write_text("{bad\n")
        elif damage == "missing":
            pointer.unlink()
        else:
            pointer.write_text(json.dumps({"checkpoint": "ckpt-0000099"}))

    spoil()
    capsys.readouterr()
    assert _generate(tiny4) == 0
    err = capsys.readouterr().err
    lines = _warnings(err)
    assert len(lines) == 1 and str(pointer) in lines[0] and "ckpt-0000002" in lines[0], err
    assert json.loads(pointer.read_text()) == {"checkpoint": "ckpt-0000002"}  # rewritten

    spoil()
    assert _train(tiny4, prompts, "--max-steps", "3") == 0
    captured = capsys.readouterr()
    lines = _warnings(captured.err)
    assert len(lines) == 1 and str(pointer) in lines[0], captured.err
    assert "ckpt-0000003" in captured.out
    assert read_record(current_checkpoint(root))["history"][0]["step"] == 2  # resumed


def test_short_runs_with_data_on_hand_train_instead_of_making_more(
        tiny4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path / "data"))
    prompts = numbered_prompts(tmp_path, 40)  # 160 replies to make: data stays pending
    # a first run too short for anything but one batch of replies: no head yet
    assert _train(tiny4, prompts, minutes="0.000001") == 0
    assert "no head yet" in capsys.readouterr().err
    root = head_root(tiny4)
    shards = sorted((root / "data").glob("shard-*[0-9]"))
    assert len(shards) == 1
    measured = json.loads((root / "data" / "batch_time.json").read_text())["seconds"]
    assert measured > 0
    # a machine where a batch of replies takes longer than a short run's data share
    (root / "data" / "batch_time.json").write_text(json.dumps({"seconds": 1000.0}))
    assert _train(tiny4, prompts, "--max-steps", "2", minutes="0.5") == 0
    captured = capsys.readouterr()
    assert "ckpt-0000002" in captured.out
    assert sorted((root / "data").glob("shard-*[0-9]")) == shards  # no batch made

    # a run whose time is gone before a step: no fake loss, the head in use is named,
    # and nothing is announced as saved
    assert _train(tiny4, prompts, minutes="0.000001") == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "loss" not in captured.err and "done" not in captured.err
    assert "no training steps ran this time" in captured.err
    assert "the head in use stays" in captured.err and "ckpt-0000002" in captured.err


def test_history_says_one_line_per_damaged_online_segment(
        tiny4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(data))
    turns = "".join(f"Tell me about {i}\n" for i in range(8))
    monkeypatch.setattr("sys.stdin", io.StringIO(turns + "\n"))
    assert main(["chat", "--model", str(tiny4), "--max-tokens", "12", "--learn"]) == 0
    segments = sorted(data.glob("heads/*/online/layers-*/seg-*"))
    assert len(segments) == 8
    for seg in segments[:2]:
        (seg / "meta.json").write_text("{not json")
    capsys.readouterr()
    assert main(["train-drafter", "--model", str(tiny4), "--data", "history", "--minutes",
                 "5", "--max-steps", "1"]) == 0
    err = capsys.readouterr().err
    lines = _warnings(err)
    assert len(lines) == 2, err
    for seg, line in zip(segments[:2], lines, strict=True):
        assert seg.name in line and "set aside" in line
        assert seg.with_name(seg.name + ".damaged").is_dir()
