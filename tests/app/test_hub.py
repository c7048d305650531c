"""Hub search, repo details, token check, timeouts and the file policy."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from app.hub.api import (
    HubAuthError,
    HubConfig,
    HubError,
    HubOfflineError,
    HubUnreachableError,
    UnsafeRepoFileError,
    check_safe_name,
    estimate_params,
    quantization_of,
    repo_details,
    search_models,
    select_files,
    support_verdict,
    whoami,
)
from tests.fixtures.hub_server import (
    FakeRepo,
    HubServer,
    SilentServer,
    closed_port_endpoint,
    isolate_hub_env,
)
from tests.fixtures.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "llama")


@pytest.fixture
def hub(tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    isolate_hub_env(monkeypatch, tmp_path)
    with HubServer() as server:
        server.state.add(FakeRepo.from_folder("mlx-community/tiny-llama-4bit", tiny_folder,
                                              downloads=10))
        server.state.add(FakeRepo.from_folder("mlx-community/tiny-llama-8bit", tiny_folder,
                                              downloads=50))
        server.state.add(FakeRepo.from_folder("someone/tiny-llama", tiny_folder, downloads=99))
        files = {"config.json": b'{"model_type": "bert"}', "model.safetensors": b"\0" * 64}
        server.state.add(FakeRepo("mlx-community/tiny-bert", files, config={"model_type": "bert"},
                                  downloads=1))
        yield server


def _config(hub: HubServer, **kw) -> HubConfig:
    return HubConfig(endpoint=hub.endpoint, timeout_s=5.0, **kw)


def test_search_filters_by_author_and_sorts_by_downloads(hub):
    hits = search_models("tiny", _config(hub), author="mlx-community")
    assert [h.repo_id for h in hits] == ["mlx-community/tiny-llama-8bit",
                                         "mlx-community/tiny-llama-4bit", "mlx-community/tiny-bert"]
    first = hits[0]
    assert (first.downloads, first.bits, first.model_type, first.supported) == (50, 8, "llama", True)
    assert first.size_bytes is not None and first.size_bytes > 0
    assert hits[2].supported is False
    everyone = search_models("llama", _config(hub))  # every author by default
    assert everyone[0].repo_id == "someone/tiny-llama"
    _, path = next(r for r in hub.state.requests if r[1].startswith("/api/models?"))
    assert "sort=downloads" in path and "search=tiny" in path and "author=mlx-community" in path


def test_search_ranks_loadable_repos_first_then_the_preferred_author(hub):
    gguf = {"config.json": b'{"model_type": "llama"}', "tiny-llama.Q8_0.gguf": b"GGUF" * 16}
    hub.state.add(FakeRepo("someone/tiny-llama-GGUF", gguf, config={"model_type": "llama"},
                           downloads=1000))
    hits = search_models("tiny", _config(hub))
    assert [h.repo_id for h in hits] == [
        "someone/tiny-llama", "mlx-community/tiny-llama-8bit", "mlx-community/tiny-llama-4bit",
        "someone/tiny-llama-GGUF", "mlx-community/tiny-bert"]  # downloads: 99, 50, 10 | 1000, 1
    assert hits[3].supported and not hits[3].loadable  # llama, but no safetensors to load
    preferred = search_models("tiny", _config(hub), prefer_author="mlx-community")
    assert [h.repo_id for h in preferred][:3] == [
        "mlx-community/tiny-llama-8bit", "mlx-community/tiny-llama-4bit", "someone/tiny-llama"]


def test_repo_details_reads_config_and_lists_only_needed_files(hub, tiny_folder):
    hub.state.repos["mlx-community/tiny-llama-4bit"].files["pytorch_model.bin"] = b"pickle"
    hub.state.repos["mlx-community/tiny-llama-4bit"].files["modeling_evil.py"] = b"import os"
    d = repo_details("mlx-community/tiny-llama-4bit", _config(hub))
    names = [f.name for f in d.files]
    assert names[-1] == "model.safetensors"
    assert "pytorch_model.bin" not in names and "modeling_evil.py" not in names
    assert d.total_bytes == sum((tiny_folder / n).stat().st_size for n in names)
    assert (d.model_type, d.supported, d.bits) == ("llama", True, None)
    assert d.n_params == estimate_params(json.loads((tiny_folder / "config.json").read_text()))
    assert d.sha == hub.state.repos["mlx-community/tiny-llama-4bit"].sha
    bert = repo_details("mlx-community/tiny-bert", _config(hub))
    assert not bert.supported and "bert" in (bert.unsupported_reason or "")


def test_unknown_repo_is_a_clear_error(hub):
    with pytest.raises(HubError, match="not found"):
        repo_details("mlx-community/nope", _config(hub))


def test_whoami_names_the_account_and_rejects_bad_tokens(hub):
    secret = "hf_AbCdEfGhIjKlMnOp"
    hub.state.tokens[secret] = "alice"
    assert whoami(_config(hub), secret) == "alice"
    with pytest.raises(HubAuthError) as info:
        whoami(_config(hub), "hf_wrong_token_value")
    assert "rejected" in str(info.value) and "hf_wrong_token_value" not in str(info.value)


def test_offline_mode_refuses_without_a_request(hub, monkeypatch):
    for call in (lambda c: search_models("tiny", c),
                 lambda c: repo_details("mlx-community/tiny-llama-4bit", c),
                 lambda c: whoami(c, "hf_x")):
        with pytest.raises(HubOfflineError, match="Offline mode"):
            call(_config(hub, offline=True))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubOfflineError):
        search_models("tiny", _config(hub))
    assert hub.n_requests == 0


def test_unreachable_hub_fails_fast_with_a_clear_message():
    config = HubConfig(endpoint=closed_port_endpoint(), timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(HubUnreachableError, match="Cannot reach the Hugging Face hub"):
        search_models("qwen", config)
    with pytest.raises(HubUnreachableError):
        repo_details("mlx-community/x", config)
    assert time.monotonic() - start < 5


def test_a_hub_that_never_answers_times_out():
    with SilentServer() as silent:
        config = HubConfig(endpoint=silent.endpoint, timeout_s=0.5)
        start = time.monotonic()
        with pytest.raises(HubUnreachableError, match="did not answer within 0.5 s"):
            search_models("qwen", config)
        with pytest.raises(HubUnreachableError):
            whoami(config, "hf_token")
        with pytest.raises(HubUnreachableError):
            repo_details("mlx-community/x", config)
        assert time.monotonic() - start < 5


@pytest.mark.parametrize("name", ["../x.json", "/abs.json", "a/../b", "a//b", "./c", "x\\y",
                                  "C:evil", ""])
def test_unsafe_names(name):
    with pytest.raises(UnsafeRepoFileError):
        check_safe_name(name)


def test_select_files_takes_model_files_only_and_honours_the_index():
    names = ["README.md", "config.json", "tokenizer.json", "model.safetensors.index.json",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
             "consolidated.safetensors", "pytorch_model.bin", "original/params.json",
             "tokenizer.model", "chat_template.jinja"]
    shards = ["model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"]
    assert select_files(names, shards) == [
        "chat_template.jinja", "config.json", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer.model", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert "consolidated.safetensors" in select_files(names, None)
    with pytest.raises(HubError, match="does not have"):
        select_files(names, ["model-00003-of-00003.safetensors"])


def test_model_facts():
    mlx = {"model_type": "qwen2", "quantization": {"bits": 4, "group_size": 64}}
    assert quantization_of(mlx) == (4, 64)
    assert quantization_of({"quantization_config": {"bits": 8}}) == (8, None)
    names = ["config.json", "tokenizer.json", "model.safetensors"]
    assert support_verdict(mlx, names) is None
    assert "gptq" in support_verdict(
        {"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4}}, names)
    assert "tokenizer.json" in support_verdict(mlx, ["config.json", "model.safetensors"])
    # Qwen2.5-0.5B: 494M parameters with tied embeddings
    qwen = {"hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864,
            "vocab_size": 151936, "num_attention_heads": 14, "num_key_value_heads": 2,
            "tie_word_embeddings": True}
    assert abs(estimate_params(qwen) - 494_000_000) < 5_000_000
    assert estimate_params({"model_type": "llama"}) is None
