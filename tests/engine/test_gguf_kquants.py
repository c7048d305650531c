"""K-quant and other GGML types `mx.load` cannot read: decoded by `gguf`, held per backend."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.errors import InsufficientMemoryError, ModelFormatError
from engine.gguf import import_gguf
from engine.gguf_reading import mlx_bits
from engine.loading import holds_quantized, load_weights
from tests.engine.test_gguf import hf_row_order, read_json, vocabulary
from tests.fixtures.gguf_files import K_QUANTS, kquant_blocks

# K-quant super-blocks hold 256 values, so every matrix row here is a multiple of 256.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 256, 4, 2, 64, 512

# A Q4_K_M-like mix: every K-quant, a 32-block type mx.load cannot read (Q5_0), the types it
# can (Q8_0, Q4_0, F16, BF16), and F32 norms.
MIXED = {"token_embd.weight": Q.Q6_K, "output.weight": Q.Q8_0,
         "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q5_K,
         "blk.0.attn_v.weight": Q.Q6_K, "blk.0.attn_output.weight": Q.Q3_K,
         "blk.0.ffn_gate.weight": Q.Q2_K, "blk.0.ffn_up.weight": Q.Q5_0,
         "blk.0.ffn_down.weight": Q.Q4_0,
         "blk.1.attn_q.weight": Q.F16, "blk.1.attn_k.weight": Q.Q4_K,
         "blk.1.attn_v.weight": Q.BF16, "blk.1.attn_output.weight": Q.Q4_K,
         "blk.1.ffn_gate.weight": Q.Q4_K, "blk.1.ffn_up.weight": Q.Q4_K,
         "blk.1.ffn_down.weight": Q.Q6_K}
HF_NAMES = {"token_embd": "model.embed_tokens", "output": "lm_head",
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_module(gguf_name: str) -> str:
    parts = gguf_name.removesuffix(".weight").split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}"
    return HF_NAMES[parts[0]]


def write_kquant_gguf(path: Path, types: dict[str, Q], seed: int = 0) -> None:
    """A 2-layer llama GGUF whose matrices are stored as `types` say (raw K-quant blocks)."""
    rng = np.random.default_rng(seed)
    tokens, token_types = vocabulary()
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output.weight": (len(tokens), HIDDEN)}
    for i in range(2):
        shapes |= {f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
                   f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
                   f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                   f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_eos_token_id(0)
    for name, shape in shapes.items():
        kind = types.get(name, Q.F32)
        if kind in K_QUANTS:
            w.add_tensor(name, kquant_blocks(rng, kind, *shape), raw_dtype=kind)
        else:
            x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
            if kind in (Q.F32, Q.F16):  # BF16 goes through quantize(), as llama.cpp's writer
                w.add_tensor(name, x.astype(np.float16) if kind == Q.F16 else x)
            else:
                w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)
    for name in ["output_norm.weight", *(f"blk.{i}.{n}_norm.weight" for i in range(2)
                                         for n in ("attn", "ffn"))]:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference(src: Path) -> dict[str, np.ndarray]:
    """Each matrix exactly as `gguf.quants.dequantize` decodes it, q/k rows in HF order."""
    out = {}
    for t in gguf.GGUFReader(src).tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.shape[::-1].tolist())
        if ".attn_q." in t.name:
            x = x[hf_row_order(HEADS, HEAD_DIM)]
        elif ".attn_k." in t.name:
            x = x[hf_row_order(KV_HEADS, HEAD_DIM)]
        out[t.name] = x.astype(np.float32)
    return out


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kq") / "tiny.Q4_K_M.gguf"
    write_kquant_gguf(path, MIXED)
    return path


def test_cpu_import_is_exactly_what_gguf_dequantize_gives(mixed_gguf: Path, tmp_path: Path
                                                          ) -> None:
    out = import_gguf(mixed_gguf, tmp_path / "out", backend="cpu")
    weights = mx.load(str(out / "model.safetensors"))
    assert "quantization" not in read_json(out, "config.json")  # nothing left packed
    ref = reference(mixed_gguf)
    for name, kind in MIXED.items():
        got = weights[f"{hf_module(name)}.weight"]
        if kind in (Q.F16, Q.BF16):
            assert got.dtype == (mx.float16 if kind == Q.F16 else mx.bfloat16)  # as stored
        else:
            assert got.dtype == mx.float32, name
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), ref[name], err_msg=name)
    assert np.abs(ref["blk.0.ffn_gate.weight"]).max() > 0  # the blocks decode to real values


def test_mixed_file_loads_and_runs(mixed_gguf: Path, tmp_path: Path) -> None:
    out = import_gguf(mixed_gguf, tmp_path / "out", backend="cpu")
    model, config = load_weights(out, backend="cpu")
    assert config["tie_word_embeddings"] is False
    logits = model(mx.array([[5, 9, 200, 17]]))
    assert logits.shape == (1, 4, len(vocabulary()[0]))
    assert bool(mx.all(mx.isfinite(logits)))


@pytest.mark.parametrize(("kind", "bits"), [
    (Q.Q8_0, 8), (Q.Q6_K, 8), (Q.Q5_K, 8), (Q.Q5_0, 8),
    (Q.Q4_0, 4), (Q.Q4_1, 4), (Q.Q4_K, 4), (Q.Q3_K, 4), (Q.Q2_K, 4), (Q.IQ4_XS, 4),
    (Q.F16, None), (Q.F32, None), (Q.BF16, None)])
def test_requantization_bits_follow_the_source_type(kind: Q, bits: int | None) -> None:
    assert mlx_bits(kind.name) == bits


def test_backend_policy() -> None:
    assert not holds_quantized("cpu")
    assert holds_quantized("metal") and holds_quantized("cuda")
    with pytest.raises(ValueError, match="backend"):
        holds_quantized("tpu")


def test_quantizing_backend_gets_mlx_affine_weights(mixed_gguf: Path, tmp_path: Path) -> None:
    """What Metal gets (mx.quantize runs on the CPU too): 8 or 4 bits by source, group 64."""
    out = import_gguf(mixed_gguf, tmp_path / "out", backend="metal")
    weights = mx.load(str(out / "model.safetensors"))
    quantization = read_json(out, "config.json")["quantization"]
    assert quantization["group_size"] == 64 and quantization["bits"] == 4  # most are Q4_K
    ref = reference(mixed_gguf)
    for name, kind in MIXED.items():
        module = hf_module(name)
        if kind in (Q.F16, Q.BF16):
            assert f"{module}.scales" not in weights
            continue
        bits = 8 if kind in (Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q5_0) else 4
        spec = quantization.get(module, {"group_size": 64, "bits": 4})
        assert spec == {"group_size": 64, "bits": bits}, name
        w = weights[f"{module}.weight"]
        assert w.dtype == mx.uint32 and w.shape[-1] * 32 // bits == ref[name].shape[-1]
        got = np.array(mx.dequantize(w, weights[f"{module}.scales"].astype(mx.float32),
                                     weights[f"{module}.biases"].astype(mx.float32),
                                     group_size=64, bits=bits))
        # about one step of each group's grid (MLX aligns its grid to zero, and rounds the
        # input, scales and biases to float16); the wrong width or row order is far outside
        steps = np.ptp(ref[name].reshape(-1, 64), axis=1) / (2**bits - 1)
        err = np.abs(got - ref[name]).reshape(-1, 64).max(axis=1)
        assert (err <= 1.25 * steps).all(), (name, float((err / steps).max()))
    # the folder loads under both policies, to the same model
    tokens = mx.array([[1, 2, 3, 200]])
    dequantized, _ = load_weights(out, backend="cpu")
    packed, _ = load_weights(out, backend="metal")  # QuantizedLinear layers, run here on CPU
    assert type(packed.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
    want = dequantized(tokens)
    assert bool(mx.all(mx.isfinite(want)))
    np.testing.assert_allclose(np.array(packed(tokens).astype(mx.float32)), np.array(want),
                               atol=1e-2 * float(mx.abs(want).max()))  # bf16 layer


def test_cpu_import_checks_memory_first(mixed_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(InsufficientMemoryError, match=r"tiny\.Q4_K_M\.gguf: the weights need"):
        import_gguf(mixed_gguf, tmp_path / "out", backend="cpu", memory_budget=100_000)
    assert not (tmp_path / "out").exists()


def test_truncated_kquant_tensor_is_named(mixed_gguf: Path, tmp_path: Path) -> None:
    t = next(t for t in gguf.GGUFReader(mixed_gguf).tensors if t.name == "blk.1.ffn_down.weight")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(mixed_gguf.read_bytes()[: t.data_offset + t.n_bytes // 2])
    with pytest.raises(ModelFormatError) as e:
        import_gguf(cut, tmp_path / "out", backend="cpu")
    message = str(e.value)
    assert message.startswith(f"{cut}: truncated or corrupt GGUF file: tensor "
                              "'blk.1.ffn_down.weight' (Q6_K) ends at byte")
    assert "\n" not in message
    assert not (tmp_path / "out").exists()


def test_corrupt_kquant_scales_are_named(tmp_path: Path) -> None:
    """A super-block scale of NaN (bytes 0x7e00 of a float16) decodes to NaN weights."""
    src = tmp_path / "nan.gguf"
    write_kquant_gguf(src, MIXED)
    t = next(t for t in gguf.GGUFReader(src).tensors if t.name == "blk.0.attn_q.weight")
    data = bytearray(src.read_bytes())
    data[t.data_offset:t.data_offset + 2] = np.float16(np.nan).tobytes()  # Q4_K: d comes first
    src.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=r"nan\.gguf: tensor 'blk\.0\.attn_q\.weight' "
                                               r"\(Q4_K\) decodes to NaN"):
        import_gguf(src, tmp_path / "out", backend="cpu")


def test_rows_that_do_not_fill_blocks_are_refused(tmp_path: Path) -> None:
    """A Q4_K tensor whose rows hold 320 values (not a multiple of 256): a corrupt header."""
    src = tmp_path / "odd.gguf"
    write_kquant_gguf(src, MIXED)
    reader = gguf.GGUFReader(src)
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    dims = t.field.parts[3]  # the tensor info's dims, as stored in the header
    data = bytearray(src.read_bytes())
    start = int(t.field.offset) + sum(p.nbytes for p in t.field.parts[:3])
    data[start:start + 8] = np.uint64(320).tobytes()
    assert int(dims[0]) == HIDDEN
    src.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=r"tensor 'blk\.1\.ffn_up\.weight': rows of 320 "
                                               r"values do not divide into Q4_K blocks of 256"):
        import_gguf(src, tmp_path / "out", backend="cpu")


@pytest.mark.slow
def test_demo_reencoded_in_a_type_mx_load_cannot_read_still_answers(
        demo_gguf_path: Path, tmp_path: Path) -> None:
    """The real model through the gguf-reader path: SmolLM2's layer matrices re-encoded as
    Q5_0 (which mx.load refuses) import, q/k rows un-permuted, and still say " Paris".

    (The first answer token, "The", leads "L" by 0.09 logits in the Q4_1 file; re-encoding
    noise may flip it, so only the clear " Paris", 4.6 logits ahead, is asserted.)"""
    from engine.loading import load_model

    src = tmp_path / "SmolLM2-135M-Instruct.Q5_0.gguf"
    reader = gguf.GGUFReader(demo_gguf_path)
    w = gguf.GGUFWriter(str(src), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.shape[::-1].tolist())
            w.add_tensor(t.name, gguf.quants.quantize(x, Q.Q5_0), raw_dtype=Q.Q5_0)
        elif t.tensor_type == Q.F32:
            w.add_tensor(t.name, np.asarray(t.data))
        else:  # the Q8_0 embedding as stored
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    loaded = load_model(import_gguf(src, tmp_path / "q5", backend="cpu"), backend="cpu")
    tok = loaded.tokenizer
    prompt_ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answer_ids = tok.encode("The capital of France is")
    logits = loaded.model(mx.array([prompt_ids + answer_ids]))[0, -1]
    assert tok.decode([int(mx.argmax(logits).item())]) == " Paris"
