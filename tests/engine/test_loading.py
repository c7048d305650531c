"""Loading: bad input becomes a clear EngineError, memory is checked first, paths resolve.

Every case starts from a real tiny model folder and breaks one thing in it.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.errors import (
    EngineError,
    InsufficientMemoryError,
    ModelFormatError,
    UnsupportedModelError,
)
from engine.loading import inspect_weights, load_weights, resolve_model_path, weight_stats
from engine.weights import read_safetensors_header
from tests.fixtures.tiny_models import (
    tokenizer_json,
    write_fake_hf_cache,
    write_tiny_model,
    write_tiny_pair,
)

TOKENS = mx.array([[3, 40, 7, 120]])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pristine")
    return {
        "plain": write_tiny_model(root / "plain"),
        "q4": write_tiny_model(root / "q4", quantize=(32, 4), tie=False),
        "sharded": write_tiny_model(root / "sharded", sharded=True),
    }


@pytest.fixture
def model_dir(pristine: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the plain model, free to break."""
    return Path(shutil.copytree(pristine["plain"], tmp_path / "m"))


def edit_config(folder: Path, **changes: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def rewrite_header(path: Path, edit) -> None:
    """Apply `edit` to the parsed header and write the file back with the same data."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def resave_without(path: Path, *names: str) -> None:
    weights = mx.load(str(path))
    for n in names:
        del weights[n]
    mx.save_safetensors(str(path), weights)


# ------------------------------------------------------------------------- config.json


def test_missing_config(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelFormatError, match=r"config\.json: not found"):
        load_weights(model_dir, backend="cpu")


def test_corrupt_config(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelFormatError, match=r"config\.json: invalid JSON at line 1"):
        load_weights(model_dir, backend="cpu")


def test_unknown_model_type(model_dir: Path) -> None:
    edit_config(model_dir, model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"config\.json: model_type 'gpt2'") as e:
        load_weights(model_dir, backend="cpu")
    assert str(model_dir) in str(e.value)


def test_missing_config_field(model_dir: Path) -> None:
    edit_config(model_dir, hidden_size=None)
    with pytest.raises(ModelFormatError, match=r"config\.json: missing field\(s\) hidden_size"):
        load_weights(model_dir, backend="cpu")


def test_foreign_quantization_config_refused(model_dir: Path) -> None:
    edit_config(model_dir, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(UnsupportedModelError, match=r"quantization_config\.quant_method 'gptq'"):
        load_weights(model_dir, backend="cpu")


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"hidden_size": "64"}, "hidden_size must be an integer, got '64'"),
     ({"num_hidden_layers": -1}, "num_hidden_layers must be at least 1, got -1"),
     ({"vocab_size": True}, "vocab_size must be an integer, got True"),
     ({"num_key_value_heads": 2.5}, "num_key_value_heads must be an integer, got 2.5"),
     ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a positive number, got '1e-5'"),
     ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false, got 'yes'")],
)
def test_config_fields_of_the_wrong_kind_are_named(model_dir: Path, changes: dict,
                                                   message: str) -> None:
    """A hand-edited config.json: the field and its value are named, with the file's
    folder, instead of an arithmetic TypeError ("unsupported operand type(s) for //")
    or, for a negative layer count, a model with no layers at all."""
    edit_config(model_dir, **changes)
    with pytest.raises(ModelFormatError) as e:
        load_weights(model_dir, backend="cpu")
    assert str(e.value) == f"{model_dir}/config.json: {message}"


def test_unknown_rope_scaling_names_the_folder(model_dir: Path) -> None:
    edit_config(model_dir, rope_scaling={"rope_type": "bogus", "factor": 2.0})
    with pytest.raises(UnsupportedModelError) as e:
        load_weights(model_dir, backend="cpu")
    assert str(e.value).startswith(f"{model_dir}/config.json: rope_scaling type 'bogus' is "
                                   "not supported")


# ------------------------------------------------------------------------ safetensors


def test_truncated_safetensors(model_dir: Path) -> None:
    f = model_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: tensor .* truncated"):
        load_weights(model_dir, backend="cpu")


def test_safetensors_shorter_than_its_header(model_dir: Path) -> None:
    f = model_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:50])
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: header length \d+ does not"):
        load_weights(model_dir, backend="cpu")


def test_tiny_file_is_not_safetensors(model_dir: Path) -> None:
    (model_dir / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: not a safetensors file"):
        load_weights(model_dir, backend="cpu")


def test_corrupt_header_json(model_dir: Path) -> None:
    f = model_dir / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:20] = b"\xff" * 12
    f.write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: corrupt safetensors header"):
        load_weights(model_dir, backend="cpu")


def test_trailing_garbage(model_dir: Path) -> None:
    f = model_dir / "model.safetensors"
    f.write_bytes(f.read_bytes() + b"\0" * 16)
    with pytest.raises(ModelFormatError, match=r"header accounts for"):
        load_weights(model_dir, backend="cpu")


def test_unknown_dtype(model_dir: Path) -> None:
    def edit(h: dict) -> None:
        h["model.norm.weight"]["dtype"] = "Q4"
    rewrite_header(model_dir / "model.safetensors", edit)
    with pytest.raises(ModelFormatError, match=r"tensor 'model\.norm\.weight': unknown dtype 'Q4'"):
        load_weights(model_dir, backend="cpu")


def test_dtype_mlx_cannot_hold(model_dir: Path) -> None:
    def edit(h: dict) -> None:
        h["model.norm.weight"]["dtype"] = "F8_E4M3"
        h["model.norm.weight"]["shape"] = [h["model.norm.weight"]["shape"][0] * 4]
    rewrite_header(model_dir / "model.safetensors", edit)
    with pytest.raises(UnsupportedModelError, match=r"dtype F8_E4M3 is not supported by MLX"):
        load_weights(model_dir, backend="cpu")


def test_offsets_disagree_with_shape(model_dir: Path) -> None:
    def edit(h: dict) -> None:
        h["model.norm.weight"]["shape"] = [32]
    rewrite_header(model_dir / "model.safetensors", edit)
    with pytest.raises(ModelFormatError, match=r"'model\.norm\.weight': data_offsets .* shape \[32\]"):
        load_weights(model_dir, backend="cpu")


def test_missing_shard(pristine: dict[str, Path], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(pristine["sharded"], tmp_path / "s"))
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelFormatError,
                       match=r"index\.json: shard\(s\) model-00002-of-00002\.safetensors"):
        load_weights(folder, backend="cpu")


def test_index_names_tensor_its_shard_lacks(pristine: dict[str, Path], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(pristine["sharded"], tmp_path / "s"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match=r"'model\.ghost\.weight' is listed in model-00001"):
        load_weights(folder, backend="cpu")


def test_no_weights_at_all(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    (model_dir / "tiny.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelFormatError, match=r"no model\.safetensors .*import-gguf"):
        load_weights(model_dir, backend="cpu")


# ---------------------------------------------------------------- weights vs the model


def test_shape_mismatch_names_key_file_and_shapes(model_dir: Path) -> None:
    edit_config(model_dir, intermediate_size=96)
    with pytest.raises(ModelFormatError) as e:
        load_weights(model_dir, backend="cpu")
    msg = str(e.value)
    assert "model.safetensors" in msg and "'model.layers.0.mlp.gate_proj.weight'" in msg
    assert "has shape [128, 64] but the model expects [96, 64]" in msg


def test_missing_weights_are_named(model_dir: Path) -> None:
    resave_without(model_dir / "model.safetensors", "model.norm.weight",
                   "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ModelFormatError,
                       match=r"missing from the checkpoint: model\.layers\.1\.mlp\.up_proj\.weight, "
                             r"model\.norm\.weight"):
        load_weights(model_dir, backend="cpu")


def test_untied_config_without_lm_head(model_dir: Path) -> None:
    edit_config(model_dir, tie_word_embeddings=False)
    with pytest.raises(ModelFormatError, match=r"missing from the checkpoint: lm_head\.weight"):
        load_weights(model_dir, backend="cpu")


def test_absent_tie_flag_and_absent_lm_head_means_tied(model_dir: Path) -> None:
    edit_config(model_dir, tie_word_embeddings=None)
    model, config = load_weights(model_dir, backend="cpu")
    assert config["tie_word_embeddings"] is True and "lm_head" not in model


def test_quantized_weights_without_quantization_block(
    pristine: dict[str, Path], tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(pristine["q4"], tmp_path / "q"))
    edit_config(folder, quantization=None, quantization_config=None)
    with pytest.raises(ModelFormatError, match=r"has no 'quantization' block"):
        load_weights(folder, backend="cpu")


def test_wrong_bits_in_override_is_a_shape_error(pristine: dict[str, Path], tmp_path: Path) -> None:
    folder = Path(shutil.copytree(pristine["q4"], tmp_path / "q"))
    edit_config(folder, quantization={"group_size": 32, "bits": 4,
                                      "lm_head": {"group_size": 32, "bits": 8}})
    with pytest.raises(ModelFormatError, match=r"'lm_head\.weight' has shape .* \(quantized 8-bit"):
        load_weights(folder, backend="cpu")


def test_hidden_size_that_does_not_match_quantized_weights(
        pristine: dict[str, Path], tmp_path: Path) -> None:
    """hidden_size 56 for 64-wide 4-bit weights: before, the stored scales implied a group
    size of 28, and MLX's quantize raised a ValueError (a traceback from the CLI)."""
    folder = Path(shutil.copytree(pristine["q4"], tmp_path / "q"))
    edit_config(folder, hidden_size=56)
    with pytest.raises(ModelFormatError) as e:
        inspect_weights(folder, backend="metal")
    assert str(e.value) == (f"{folder}/config.json: hidden_size is 56 but the weights have 64 "
                            "(model.safetensors: model.norm.weight [64]); config.json does "
                            "not match the weights")


def test_head_dim_that_does_not_match_quantized_weights(
        pristine: dict[str, Path], tmp_path: Path) -> None:
    """head_dim 14 (for 16): the attention output layer takes 56 inputs where 64 are
    stored; named by tensor and shapes, not a ValueError from MLX's quantize."""
    folder = Path(shutil.copytree(pristine["q4"], tmp_path / "q"))
    edit_config(folder, head_dim=14)
    with pytest.raises(ModelFormatError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' "
                       r"has shape \[64, 8\] but the model expects \[56, 8\] \(quantized "
                       r"4-bit, group 32\); config\.json does not match"):
        load_weights(folder, backend="cpu")


@pytest.mark.parametrize("layers", [1, 3])
def test_layer_count_that_does_not_match_the_weights(
        pristine: dict[str, Path], tmp_path: Path, layers: int) -> None:
    """Before: too few layers listed the last layer's tensors as unexpected and asked
    whether config.json lacked a 'quantization' block, though it has one."""
    folder = Path(shutil.copytree(pristine["q4"], tmp_path / "q"))
    edit_config(folder, num_hidden_layers=layers)
    with pytest.raises(ModelFormatError) as e:
        load_weights(folder, backend="cpu")
    assert str(e.value) == (f"{folder}/config.json: num_hidden_layers is {layers} but the "
                            "weights hold 2 layers; config.json does not match the weights")


def test_quantization_config_key_alone_is_accepted(
    pristine: dict[str, Path], tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(pristine["q4"], tmp_path / "q"))
    config = json.loads((folder / "config.json").read_text())
    edit_config(folder, quantization=None, quantization_config=config["quantization"])
    reference, _ = load_weights(pristine["q4"], backend="cpu")
    model, _ = load_weights(folder, backend="metal")
    assert mx.allclose(model(TOKENS), reference(TOKENS), rtol=1e-4, atol=1e-4).item()


# ----------------------------------------------------------------------------- memory


def test_memory_check_counts_cpu_dequantization(pristine: dict[str, Path]) -> None:
    """4-bit weights fit a budget as stored but not once dequantized to float32."""
    folder = pristine["q4"]
    _, stored_bytes = weight_stats(load_weights(folder, backend="metal")[0])
    _, cpu_bytes = weight_stats(load_weights(folder, backend="cpu")[0])
    assert cpu_bytes > 4 * stored_bytes
    # the pre-load estimate from headers equals what loading then holds
    assert inspect_weights(folder, backend="metal").bytes_needed == stored_bytes
    cpu_plan = inspect_weights(folder, backend="cpu")
    assert cpu_plan.bytes_needed == cpu_bytes and cpu_plan.dequantize
    budget = (stored_bytes + cpu_bytes) // 2
    load_weights(folder, backend="metal", memory_budget=budget)
    with pytest.raises(InsufficientMemoryError) as e:
        load_weights(folder, backend="cpu", memory_budget=budget)
    msg = str(e.value)
    assert f"need {cpu_bytes / 1e9:.3g} GB" in msg
    assert f"only {budget / 1e9:.3g} GB" in msg and "float32" in msg


def test_memory_check_runs_before_reading(model_dir: Path) -> None:
    with pytest.raises(InsufficientMemoryError, match=r"need .* GB .* only 1e-06 GB"):
        load_weights(model_dir, backend="cpu", memory_budget=1000)


# ------------------------------------------------------------------------- resolution


def test_resolve_folder_and_home(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(model_dir.parent))
    assert resolve_model_path(str(model_dir)) == model_dir
    assert resolve_model_path("~/m") == model_dir


def test_resolve_repo_id_from_hf_cache(
    pristine: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"
    snapshot = write_fake_hf_cache(cache, "tiny-org/tiny-model", pristine["plain"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # both loads hold their matrices in one layout: chosen by timing, two loads on a busy
    # machine may pick differently, and the products then differ in the last bit
    monkeypatch.setenv("UNDERSTUDY_WEIGHT_LAYOUT", "row")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("tiny-org/tiny-model") == snapshot
    # the cache's repo folder itself resolves to its snapshot too
    assert resolve_model_path(str(cache / "models--tiny-org--tiny-model")) == snapshot
    model, _ = load_weights(snapshot, backend="cpu")  # loads through the blob symlinks
    reference, _ = load_weights(pristine["plain"], backend="cpu")
    assert mx.array_equal(model(TOKENS), reference(TOKENS)).item()

    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub is the cache
    assert resolve_model_path("tiny-org/tiny-model") == snapshot
    # without refs/main the snapshot may be a partial download: it is never picked
    (cache / "models--tiny-org--tiny-model" / "refs" / "main").unlink()
    with pytest.raises(ModelFormatError, match="not in the Hugging Face cache"):
        resolve_model_path("tiny-org/tiny-model")


def test_unknown_repo_id_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelFormatError) as e:
        resolve_model_path("someone/missing-model")
    msg = str(e.value)
    assert "someone/missing-model" in msg and str(tmp_path / "empty") in msg
    assert "understudy models download someone/missing-model" in msg


def test_resolve_name_in_models_dir(
    pristine: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    imported = Path(shutil.copytree(pristine["plain"], tmp_path / "data" / "models" / "mine"))
    assert resolve_model_path("mine") == imported
    with pytest.raises(EngineError, match=r"model 'nothing-here' not found"):
        resolve_model_path("nothing-here")


@pytest.mark.parametrize("name", ["x.gguf", "X.GGUF"])
def test_gguf_file_points_to_import(tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    f.write_bytes(b"GGUF")
    with pytest.raises(ModelFormatError, match=r"understudy import-gguf"):
        resolve_model_path(str(f))


# --------------------------------------------------------------- load_model / fixtures


def test_load_model_with_tokenizer(
    pristine: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("engine.tokenizer")
    from engine.loading import load_model

    cache = tmp_path / "hub"
    write_fake_hf_cache(cache, "tiny-org/tiny-model", pristine["q4"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    loaded = load_model("tiny-org/tiny-model", backend="cpu")
    assert loaded.name == "tiny-org/tiny-model" and loaded.backend == "cpu"
    assert loaded.quantization == {"group_size": 32, "bits": 4}
    per_layer = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128 + 2 * 64  # attn, mlp, norms
    assert loaded.n_params == 2 * 300 * 64 + 2 * per_layer + 64  # + embed, lm_head, norm
    assert loaded.weight_bytes == loaded.n_params * 4
    ids = loaded.tokenizer.encode("hello world")
    assert loaded.tokenizer.decode(ids) == "hello world"
    assert loaded.model(mx.array([ids])).shape == (1, len(ids), 300)


def test_draft_pair_shares_tokenizer(tmp_path: Path) -> None:
    target, draft = write_tiny_pair(tmp_path)
    assert (target / "tokenizer.json").read_text() == (draft / "tokenizer.json").read_text()
    m_tgt, _ = load_weights(target, backend="cpu")
    m_dft, _ = load_weights(draft, backend="cpu")
    assert m_dft.args.hidden_size == 32 and m_dft.n_layers == 1
    assert m_tgt(TOKENS).shape == m_dft(TOKENS).shape


def test_fixture_tokenizer_round_trips_chatml() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json())
    text = "<|im_start|>user\nHéllo, wörld! 😀<|im_end|>\n"
    enc = tok.encode(text)
    assert enc.tokens[0] == "<|im_start|>" and "<|im_end|>" in enc.tokens
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert max(enc.ids) < tok.get_vocab_size() == 300


def test_header_reader_on_fixture(pristine: dict[str, Path]) -> None:
    infos = read_safetensors_header(pristine["q4"] / "model.safetensors")
    assert infos["model.layers.0.self_attn.q_proj.weight"].dtype == "U32"
    assert infos["model.layers.0.self_attn.q_proj.weight"].shape == (64, 8)
    assert infos["model.layers.0.self_attn.q_proj.scales"].shape == (64, 2)


# ------------------------------------------------------------------------- progress


@pytest.mark.parametrize(("name", "backend"), [("plain", "cpu"), ("sharded", "cpu"),
                                               ("q4", "cpu"), ("q4", "metal")])
def test_progress_counts_every_weight_byte_as_it_is_read(
        pristine: dict[str, Path], name: str, backend: str) -> None:
    """A loading bar gets a true fraction: one report per tensor, rising to the bytes the
    model holds (float32 after the CPU policy's dequantizing, packed under Metal's)."""
    reports: list[tuple[int, int]] = []
    model, _ = load_weights(pristine[name], backend=backend,
                            on_progress=lambda done, total: reports.append((done, total)))
    n_bytes = weight_stats(model)[1]
    totals = {total for _, total in reports}
    done = [d for d, _ in reports]
    assert totals == {n_bytes}
    assert done == sorted(done) and 0 < done[0] < n_bytes and done[-1] == n_bytes
    assert len(reports) == len(tree_flatten(model.parameters()))  # one per tensor
