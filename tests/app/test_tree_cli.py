"""`--tree auto|off` on the CLI: both give plain decoding's text; a bad value is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli.main import build_parser, main
from tests.fixtures.tiny_models import write_tiny_model

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("treecli") / "tiny")


def reply(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["text"]


def test_tree_flag_keeps_the_text(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ("--model", str(tiny), "--prompt", PROMPT, "--max-tokens", "24",
              "--temperature", "0.8", "--seed", "4")
    plain = reply(capsys, *common)
    for tree in ("auto", "off"):
        assert reply(capsys, *common, "--drafter", "ngram", "--tree", tree) == plain


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_tree_flag_on_every_decoding_command(command: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args([command]).tree == "auto"
    assert parser.parse_args([command, "--tree", "off"]).tree == "off"
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--tree", "wide"])
    assert "invalid choice: 'wide'" in capsys.readouterr().err
