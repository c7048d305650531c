"""GGUF import: synthetic tiny GGUFs for layout and errors, the demo GGUF for truth."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from engine.errors import EngineError, ModelFormatError, UnsupportedModelError
from engine.gguf import import_gguf
from tests.fixtures.gguf_files import SpmVocabulary

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 128, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
SPM_TEMPLATE = ("{% for m in messages %}{% if m.role == 'user' %}{{ bos_token }}[INST] {{ m.content }}"
                " [/INST]{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")


def vocabulary() -> tuple[list[str], list[int]]:
    """Specials, the 256 byte-level symbols, then the merged tokens."""
    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
    return tokens, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows (per head: halves -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_row_order(n_heads: int, head_dim: int) -> np.ndarray:
    """hf_row -> gguf_row, spelled out with loops: HF row (h, i, j) sits at GGUF row (h, j, i)."""
    order = []
    for h in range(n_heads):
        for i in range(2):
            for j in range(head_dim // 2):
                order.append(h * head_dim + j * 2 + i)
    return np.array(order)


def write_tiny_gguf(path: Path, *, arch: str = "llama", types: dict[str, Q] | None = None,
                    pre: str = "smollm", tokenizer_model: str = "gpt2", tie: bool = False,
                    rope_freqs: np.ndarray | None = None, seed: int = 0,
                    spm: SpmVocabulary | None = None,
                    space_prefix: bool | None = None) -> dict[str, np.ndarray]:
    """Write a 2-layer GGUF the way llama.cpp's converter lays it out.

    Returns the HF-layout float32 weights (before permuting and quantizing), keyed by GGUF name.
    `types` picks each tensor's GGUF type (default F32). With `spm`, the vocabulary is that
    SentencePiece one, stored as llama.cpp stores Llama 2's (scores, no merges, BOS added).
    """
    types = types or {}
    rng = np.random.default_rng(seed)
    tokens, token_types = (spm.tokens, spm.types) if spm else vocabulary()
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (len(tokens), HIDDEN),
                                          "output_norm.weight": (HIDDEN,)}
    if not tie:
        shapes["output.weight"] = (len(tokens), HIDDEN)
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
                   f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
                   f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                   f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
        if arch == "qwen2":
            shapes |= {f"blk.{i}.attn_q.bias": (HEADS * HEAD_DIM,),
                       f"blk.{i}.attn_k.bias": (KV_HEADS * HEAD_DIM,),
                       f"blk.{i}.attn_v.bias": (KV_HEADS * HEAD_DIM,)}
    hf = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    if spm:
        w.add_tokenizer_model("llama")
        w.add_token_scores(spm.scores)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(SPM_TEMPLATE)
        if space_prefix is not None:  # Gemma's files say False
            w.add_add_space_prefix(space_prefix)
    else:
        w.add_tokenizer_model(tokenizer_model)
        w.add_tokenizer_pre(pre)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(0)
        w.add_eot_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(TEMPLATE)
    for name, x in hf.items():
        if arch == "llama" and ".attn_q." in name:
            x = llama_cpp_permute(x, HEADS)
        elif arch == "llama" and ".attn_k." in name:
            x = llama_cpp_permute(x, KV_HEADS)
        kind = types.get(name, Q.F32)
        if kind == Q.F32:
            w.add_tensor(name, x)
        elif kind in (Q.F16, Q.F64):
            w.add_tensor(name, x.astype(np.float16 if kind == Q.F16 else np.float64))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def read_json(folder: Path, name: str) -> Any:
    return json.loads((folder / name).read_text(encoding="utf-8"))


def dequantized(weights: dict[str, mx.array], name: str, bits: int) -> np.ndarray:
    """In float32, so the comparison is not limited by float16 rounding of the output."""
    scales = weights[f"{name}.scales"].astype(mx.float32)
    biases = weights[f"{name}.biases"].astype(mx.float32)
    return np.array(mx.dequantize(weights[f"{name}.weight"], scales, biases, 32, bits))


def gguf_tensor(path: Path, name: str) -> np.ndarray:
    """A tensor exactly as stored in the GGUF, dequantized by llama.cpp's own Python package."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.shape[::-1].tolist())


MIXED = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_0, "blk.1.attn_q.weight": Q.Q8_0,
         "blk.0.attn_k.weight": Q.Q4_1, "blk.1.attn_k.weight": Q.F16,
         "blk.0.attn_v.weight": Q.Q4_0, "blk.1.attn_v.weight": Q.Q4_0,
         "blk.0.ffn_down.weight": Q.Q8_0, "output.weight": Q.F16}


def test_config_from_metadata(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", types=MIXED)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    config = read_json(out, "config.json")
    assert {k: config[k] for k in ("model_type", "hidden_size", "intermediate_size",
                                   "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "max_position_embeddings",
                                   "vocab_size", "tie_word_embeddings", "bos_token_id",
                                   "eos_token_id")} == {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "vocab_size": 262, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 0}
    assert config["rope_theta"] == 50000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-6)
    assert "head_dim" not in config  # 64 / 4 heads == 16 == rope dims
    # Most quantized modules are 4-bit; the 8-bit ones are listed one by one.
    assert config["quantization"] == {
        "group_size": 32, "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
        "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
        "model.layers.1.self_attn.q_proj": {"group_size": 32, "bits": 8}}
    assert read_json(out, "generation_config.json")["eos_token_id"] == [0, 2]
    tok_config = read_json(out, "tokenizer_config.json")
    assert tok_config["chat_template"] == TEMPLATE
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|endoftext|>")
    assert tok_config["add_bos_token"] is False


def test_weights_keep_types_and_get_hf_names(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", types=MIXED, tie=True)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    weights = mx.load(str(out / "model.safetensors"))
    assert read_json(out, "config.json")["tie_word_embeddings"] is True
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].dtype == mx.uint32  # stays quantized
    assert weights["model.layers.1.self_attn.k_proj.weight"].dtype == mx.float16
    assert "model.layers.1.self_attn.k_proj.scales" not in weights
    assert weights["model.layers.0.input_layernorm.weight"].dtype == mx.float32
    expected = {"model.norm.weight", "model.layers.1.post_attention_layernorm.weight",
                "model.layers.1.mlp.gate_proj.weight", "model.layers.1.self_attn.o_proj.weight"}
    assert expected <= set(weights)
    assert not any(k.startswith(("blk.", "token_embd", "output")) for k in weights)


def test_an_upper_case_extension_is_read_the_same_way(tmp_path: Path) -> None:
    """mx.load goes by the extension: "M.GGUF" took the slow path, its quantized weights
    decoded to float32 (float32 on the CPU, re-quantized elsewhere)."""
    write_tiny_gguf(tmp_path / "m.gguf", types=MIXED, tie=True)
    (tmp_path / "m.gguf").rename(tmp_path / "M.GGUF")
    weights = mx.load(str(import_gguf(tmp_path / "M.GGUF", tmp_path / "out") / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].dtype == mx.uint32  # stays quantized
    assert weights["model.layers.1.self_attn.k_proj.weight"].dtype == mx.float16


def test_import_reports_each_tensor(tmp_path: Path) -> None:
    """A progress bar's feed: 0..n arrays read from the file (a quantized tensor is read as
    weight, scales and biases), in order, ending at n."""
    write_tiny_gguf(tmp_path / "m.gguf", types=MIXED)
    reports: list[tuple[int, int]] = []
    import_gguf(tmp_path / "m.gguf", tmp_path / "out",
                on_progress=lambda done, total: reports.append((done, total)))
    n = reports[-1][1]
    assert n >= len(gguf.GGUFReader(tmp_path / "m.gguf").tensors) > 0
    assert reports == [(i, n) for i in range(n + 1)]


@pytest.mark.parametrize(("layer", "q_type", "k_type"),
                         [(0, Q.Q4_0, Q.Q4_1), (1, Q.Q8_0, Q.F16)])
def test_qk_rows_unpermuted_like_reference(tmp_path: Path, layer: int, q_type: Q, k_type: Q
                                           ) -> None:
    src = tmp_path / "m.gguf"
    hf = write_tiny_gguf(src, types=MIXED)
    weights = mx.load(str(import_gguf(src, tmp_path / "out") / "model.safetensors"))
    for proj, n_heads, kind in (("q", HEADS, q_type), ("k", KV_HEADS, k_type)):
        name = f"model.layers.{layer}.self_attn.{proj}_proj"
        stored = gguf_tensor(src, f"blk.{layer}.attn_{proj}.weight")  # interleaved rows
        reference = stored[hf_row_order(n_heads, HEAD_DIM)]
        if kind == Q.F16:
            got = np.array(weights[f"{name}.weight"].astype(mx.float32))
        else:
            got = dequantized(weights, name, 4 if kind in (Q.Q4_0, Q.Q4_1) else 8)
        np.testing.assert_allclose(got, reference, atol=1e-3)
        # and that is the original HF matrix, up to quantization error
        tol = 0.35 if kind in (Q.Q4_0, Q.Q4_1) else 0.03
        assert np.abs(got - hf[f"blk.{layer}.attn_{proj}.weight"]).max() < tol


def test_unpermuted_rows_with_hf_rope_give_llama_cpp_attention_scores(tmp_path: Path) -> None:
    """GGUF rows + interleaved RoPE == imported rows + half-split RoPE (the decoder's)."""
    src = tmp_path / "m.gguf"
    write_tiny_gguf(src)
    raw = mx.load(str(src))
    hf = mx.load(str(import_gguf(src, tmp_path / "out") / "model.safetensors"))
    x = mx.random.normal((1, 7, HIDDEN), key=mx.random.key(3))

    def scores(wq: mx.array, wk: mx.array, traditional: bool) -> mx.array:
        q = (x @ wq.T).reshape(1, 7, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
        k = (x @ wk.T).reshape(1, 7, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
        q = mx.fast.rope(q, HEAD_DIM, traditional=traditional, base=50000.0, scale=1.0, offset=0)
        k = mx.fast.rope(k, HEAD_DIM, traditional=traditional, base=50000.0, scale=1.0, offset=0)
        k = mx.repeat(k, HEADS // KV_HEADS, axis=1)
        return q @ k.transpose(0, 1, 3, 2)  # (1, heads, L, L)

    want = scores(raw["blk.0.attn_q.weight"], raw["blk.0.attn_k.weight"], traditional=True)
    got = scores(hf["model.layers.0.self_attn.q_proj.weight"],
                 hf["model.layers.0.self_attn.k_proj.weight"], traditional=False)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-3)
    # without un-permuting, the scores would differ
    wrong = scores(raw["blk.0.attn_q.weight"], raw["blk.0.attn_k.weight"], traditional=False)
    assert not np.allclose(np.array(wrong), np.array(want), atol=1e-2)


def test_qwen2_keeps_row_order_and_maps_biases(tmp_path: Path) -> None:
    src = tmp_path / "q.gguf"
    hf = write_tiny_gguf(src, arch="qwen2", pre="qwen2")
    out = import_gguf(src, tmp_path / "out")
    weights = mx.load(str(out / "model.safetensors"))
    assert read_json(out, "config.json")["model_type"] == "qwen2"
    np.testing.assert_array_equal(np.array(weights["model.layers.0.self_attn.q_proj.weight"]),
                                  hf["blk.0.attn_q.weight"])
    np.testing.assert_array_equal(np.array(weights["model.layers.1.self_attn.k_proj.bias"]),
                                  hf["blk.1.attn_k.bias"])


def test_llama3_rope_factors_become_rope_scaling(tmp_path: Path) -> None:
    # Llama 3.1's published parameters, written the way llama.cpp's converter computes them.
    factor, low, high, old = 8.0, 1.0, 4.0, 8192
    factors = []
    for freq in 1.0 / 50000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    write_tiny_gguf(tmp_path / "l3.gguf", rope_freqs=np.array(factors))
    config = read_json(import_gguf(tmp_path / "l3.gguf", tmp_path / "out"), "config.json")
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}
    write_tiny_gguf(tmp_path / "odd.gguf", rope_freqs=np.linspace(1, 3, HEAD_DIM // 2))
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        import_gguf(tmp_path / "odd.gguf", tmp_path / "odd")


@pytest.mark.parametrize(("pre", "text", "pieces"), [
    ("smollm", "ab 2024", ["ab", "Ġ", "2", "0", "2", "4"]),
    ("llama-bpe", "ab 2024", ["ab", "Ġ", "202", "4"]),
    ("default", "ab 2024", ["ab", "Ġ2024"]),
    ("qwen2", "ab 2024", ["ab", "Ġ", "2", "0", "2", "4"]),
    # GPT-4o's split (Phi-4-mini): at a case change, a contraction kept, digits by three
    ("gpt-4o", "abCDef's 12345", ["ab", "CDef's", "Ġ", "123", "45"]),
])
def test_pre_tokenizer_follows_ggml_pre(tmp_path: Path, pre: str, text: str, pieces: list[str]
                                        ) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", pre=pre)
    tok = HFTokenizer.from_file(str(import_gguf(tmp_path / "m.gguf", tmp_path / "o") / "tokenizer.json"))
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)] == pieces
    tokens, _ = vocabulary()
    assert tok.encode(" the<|im_end|>").ids == [tokens.index("Ġthe"), 2]
    assert tok.decode(tok.encode("héllo wörld 🙂").ids) == "héllo wörld 🙂"


def test_refuses_other_architectures(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "g.gguf", arch="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"g\.gguf.*architecture 'gpt2'"):
        import_gguf(tmp_path / "g.gguf", tmp_path / "out")
    assert list(tmp_path.iterdir()) == [tmp_path / "g.gguf"]  # nothing half-written


def test_refuses_unknown_tokenizer_and_pre(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "t5.gguf", tokenizer_model="t5")
    with pytest.raises(UnsupportedModelError, match="tokenizer model 't5'"):
        import_gguf(tmp_path / "t5.gguf", tmp_path / "a")
    write_tiny_gguf(tmp_path / "pre.gguf", pre="mystery")
    with pytest.raises(UnsupportedModelError, match="'mystery'"):
        import_gguf(tmp_path / "pre.gguf", tmp_path / "b")


def test_refuses_tensor_types_gguf_cannot_decode(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "f64.gguf", types={"blk.0.ffn_up.weight": Q.F64})
    with pytest.raises(UnsupportedModelError, match=r"f64\.gguf: tensor types F64 \(1 tensors\)"):
        import_gguf(tmp_path / "f64.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_and_foreign_files(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match=r"cut\.gguf: truncated"):
        import_gguf(tmp_path / "cut.gguf", tmp_path / "out")
    (tmp_path / "notes.gguf").write_text("just some text, not a model")
    with pytest.raises(ModelFormatError, match=r"notes\.gguf: not a GGUF"):
        import_gguf(tmp_path / "notes.gguf", tmp_path / "out")
    with pytest.raises(ModelFormatError, match="no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_destination(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf")
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    with pytest.raises(EngineError, match="already exists"):
        import_gguf(tmp_path / "m.gguf", out)
    (out / "stale.txt").write_text("old import")
    import_gguf(tmp_path / "m.gguf", out, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    other = tmp_path / "documents"
    other.mkdir()
    (other / "thesis.txt").write_text("precious")
    with pytest.raises(EngineError, match="not a model folder"):
        import_gguf(tmp_path / "m.gguf", other, overwrite=True)
    assert (other / "thesis.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["documents", "m.gguf", "out"]


@pytest.mark.slow
def test_demo_gguf_config(demo_model_dir: Path) -> None:
    config = read_json(demo_model_dir, "config.json")
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "intermediate_size", "vocab_size",
                                   "tie_word_embeddings", "rope_theta")} == {
        "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
        "tie_word_embeddings": True, "rope_theta": 100000.0}
    # Q4_1 file: 4-bit layers, the embedding table is Q8_0
    assert config["quantization"] == {"group_size": 32, "bits": 4,
                                      "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert read_json(demo_model_dir, "generation_config.json")["eos_token_id"] == [2]


@pytest.mark.slow
def test_demo_answers_like_smollm2_through_mlx_lm(demo_model_dir: Path) -> None:
    """mlx-lm (independent loader and model code) reads the imported folder as SmolLM2.

    One teacher-forced pass: after the chat prompt the greedy token is "The", and after
    "The capital of France is" it is " Paris" (a wrong q/k layout gives neither).
    """
    from mlx_lm.utils import dequantize_model, load

    model, tokenizer = load(str(demo_model_dir))
    model = dequantize_model(model)  # quantized matmuls are slow on MLX's CPU backend
    model.set_dtype(mx.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    logits = model(mx.array([prompt_ids + answer_ids]))
    greedy = mx.argmax(logits[0], axis=-1).tolist()
    assert tokenizer.decode([greedy[len(prompt_ids) - 1]]) == "The"
    assert tokenizer.decode([greedy[-1]]) == " Paris"


def test_a_later_import_removes_what_a_killed_one_left_but_not_a_running_ones(
        tmp_path: Path) -> None:
    """A killed import leaves its partial folder (the size of the model): the next import
    into the same destination removes it, but never the folder of an import still running."""
    import signal
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[2]
    dest = tmp_path / "out"
    hang = ("import sys, time; from pathlib import Path; from engine.gguf import "
            "_write_atomically as w\n"
            "def fill(folder):\n"
            "    (folder / 'model.safetensors').write_bytes(b'x' * 4096); time.sleep(600)\n"
            "w(Path(sys.argv[1]), fill, False)\n")

    def partial_of(proc: subprocess.Popen) -> Path:
        for _ in range(600):
            found = [p for p in tmp_path.glob(".out.importing-*")
                     if p.name.split("-")[1] == str(proc.pid)
                     and (p / "model.safetensors").is_file()]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError("the import never started writing")

    killed = subprocess.Popen([sys.executable, "-c", hang, str(dest)], cwd=repo)
    running = subprocess.Popen([sys.executable, "-c", hang, str(dest)], cwd=repo)
    try:
        left, busy = partial_of(killed), partial_of(running)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        write_tiny_gguf(tmp_path / "m.gguf")
        import_gguf(tmp_path / "m.gguf", dest)
        assert not left.exists()
        assert (busy / "model.safetensors").is_file()  # still in use: left alone
        assert (dest / "model.safetensors").is_file()
    finally:
        running.kill()
        running.wait(10)


# ---------------------------------------------------------------------------- Gemma 3

def gguf_writer_for(path: Path, arch: str, config: dict[str, Any], pre: str,
                    tokens: list[str], token_types: list[int]) -> gguf.GGUFWriter:
    """A writer with the hyper-parameters llama.cpp's converter takes from an HF config
    (`config`), and a byte-level vocabulary (`tokens` padded to the model's)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(MERGES)
    w.add_chat_template(TEMPLATE)
    return w


def llama_cpp_name(hf_name: str, layer_names: dict[str, str]) -> str:
    """An HF tensor name as llama.cpp's converter names it (`layer_names`: a family's
    layer modules)."""
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    layer, module = hf_name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
    return f"blk.{layer}.{layer_names[module]}.weight"


GEMMA3_TO_GGUF = {  # HF layer module -> llama.cpp's name (gguf-py's MODEL_TENSOR table)
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gemma3_gguf(path: Path, hf_folder: Path, *, vision: bool = False) -> None:
    """A Gemma 3 GGUF as llama.cpp's converter writes one from `hf_folder`: its names, its
    norms stored as 1 + weight, q/k rows as they are, the sliding window in the metadata
    and the rest left to what llama.cpp assumes. `vision`: Ollama's combined file, with
    vision tensors beside the text model's."""
    from safetensors.numpy import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    hf = load_file(str(hf_folder / "model.safetensors"))
    tokens, token_types = vocabulary()
    n_vocab = config["vocab_size"]
    tokens += [f"<unused{i}>" for i in range(n_vocab - len(tokens) - 1)] + ["<end_of_turn>"]
    token_types += [3] * (n_vocab - len(token_types))
    w = gguf_writer_for(path, "gemma3", config, "default", tokens, token_types)
    w.add_sliding_window(config["sliding_window"])
    if config.get("rope_scaling"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(config["rope_scaling"]["factor"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    for name, x in hf.items():
        gname = llama_cpp_name(name, GEMMA3_TO_GGUF)
        w.add_tensor(gname, (x + 1.0 if name.endswith("norm.weight") else x).astype(np.float32))
    if vision:
        w.add_tensor("v.blk.0.attn_q.weight", np.ones((8, 8), np.float32))
        w.add_tensor("mm.input_projection.weight", np.ones((8, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("vision", [False, True], ids=["text", "ollama-with-vision"])
def test_a_gemma3_gguf_imports_as_the_model_it_was_converted_from(tmp_path: Path,
                                                                 vision: bool) -> None:
    """A Gemma 3 GGUF (llama.cpp's names and 1 + weight norms, a global layer every sixth,
    linear RoPE scaling) imports as the gemma3_text checkpoint it came from: the same
    logits, <end_of_turn> a stop token though the metadata names only <eos>."""
    from engine.loading import load_weights
    from tests.fixtures.tiny_models import write_tiny_model

    hf_folder = write_tiny_model(tmp_path / "hf", "gemma3_text", num_hidden_layers=6,
                                 rope_scaling={"rope_type": "linear", "factor": 4.0})
    config = read_json(hf_folder, "config.json")
    # what llama.cpp assumes for every size but the 27B
    config |= {"sliding_window_pattern": 6, "query_pre_attn_scalar": config["head_dim"]}
    (hf_folder / "config.json").write_text(json.dumps(config))
    write_gemma3_gguf(tmp_path / "g.gguf", hf_folder, vision=vision)
    out = import_gguf(tmp_path / "g.gguf", tmp_path / "imported", backend="cpu")
    imported = read_json(out, "config.json")
    assert imported["model_type"] == "gemma3_text"
    assert imported["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert (imported["sliding_window"], imported["sliding_window_pattern"]) == (8, 6)
    # <|im_end|> (2) and <end_of_turn> (299) found by their text, as llama.cpp finds them
    assert read_json(out, "generation_config.json")["eos_token_id"] == [0, 2, 299]
    ours, _ = load_weights(out, backend="cpu")
    ref, _ = load_weights(hf_folder, backend="cpu")
    tokens = mx.array([[1, 17, 42, 201, 5, 77, 123, 2, 64, 9, 250, 33] * 2])
    want = ref(tokens)
    assert (mx.abs(ours(tokens) - want).max() / mx.abs(want).max()).item() < 1e-5


# ---------------------------------------------------------------------------- Qwen3-MoE

MOE_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps", "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}


@pytest.mark.parametrize("expert_type", [Q.F32, Q.Q8_0, Q.Q5_0], ids=["f32", "q8_0", "q5_0"])
def test_a_qwen3_moe_gguf_imports_with_its_experts_stacked(tmp_path: Path,
                                                           expert_type: Q) -> None:
    """Ollama's qwen3:30b and LM Studio's Qwen3-30B-A3B files: llama.cpp stores each
    layer's experts stacked, as the decoder holds them; quantized, they are decoded (or
    read as MLX reads Q8_0) and held as the backend wants, stacked still; Q5_0 takes the
    decoding path K-quants take."""
    from safetensors.numpy import load_file

    from engine.loading import load_weights
    from tests.fixtures.tiny_models import write_tiny_model

    # llama.cpp's qwen3moe has no dense layers
    # (rows of 64: whole quantization blocks)
    hf_folder = write_tiny_model(tmp_path / "hf", "qwen3_moe", num_hidden_layers=2, tie=False,
                                 config_overrides={"mlp_only_layers": [],
                                                   "moe_intermediate_size": 64})
    config = read_json(hf_folder, "config.json")
    hf = load_file(str(hf_folder / "model.safetensors"))
    tokens, token_types = vocabulary()
    tokens += [f"<unused{i}>" for i in range(config["vocab_size"] - len(tokens))]
    token_types += [3] * (config["vocab_size"] - len(token_types))
    w = gguf_writer_for(tmp_path / "m.gguf", "qwen3moe", config, "qwen2", tokens, token_types)
    w.add_expert_count(config["num_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_eos_token_id(2)
    dense = {}
    for name, x in hf.items():
        gname = llama_cpp_name(name, MOE_TO_GGUF)
        if gname.endswith("_exps.weight") and expert_type != Q.F32:
            packed = gguf.quants.quantize(x, expert_type)
            w.add_tensor(gname, packed, raw_dtype=expert_type)
            x = gguf.quants.dequantize(packed, expert_type)  # what the file holds
        else:
            w.add_tensor(gname, x.astype(np.float32))
        dense[name] = x.astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # the reference: the HF folder holding exactly the weights the file holds
    mx.save_safetensors(str(hf_folder / "model.safetensors"),
                        {k: mx.array(v) for k, v in dense.items()})
    (hf_folder / "config.json").write_text(json.dumps(config))
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported", backend="cpu")
    imported = read_json(out, "config.json")
    assert imported["model_type"] == "qwen3_moe"
    assert (imported["num_experts"], imported["num_experts_per_tok"]) == (4, 2)
    ours, _ = load_weights(out, backend="cpu")
    ref, _ = load_weights(hf_folder, backend="cpu")
    ids = mx.array([[1, 17, 42, 201, 5, 77, 123, 2, 64, 9, 250, 33]])
    want = ref(ids)
    assert (mx.abs(ours(ids) - want).max() / mx.abs(want).max()).item() < 1e-4
    if expert_type == Q.Q5_0:
        # where weights stay quantized, decoded experts are quantized again, stacked
        from engine.models.experts import QuantizedSwitchLinear

        kept = import_gguf(tmp_path / "m.gguf", tmp_path / "kept", backend="metal")
        held, _ = load_weights(kept, backend="metal")
        assert isinstance(held.model.layers[0].mlp.switch_mlp.up_proj, QuantizedSwitchLinear)
        assert (mx.abs(held(ids) - want).max() / mx.abs(want).max()).item() < 5e-2


# ---------------------------------------------------------------------------- Phi-3

PHI3_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
                "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def test_a_phi3_gguf_imports_with_its_fused_matrices_and_longrope(tmp_path: Path) -> None:
    """Phi-4-mini as llama.cpp's converter writes it: q/k/v and gate/up kept fused (the
    latter as `ffn_up`), the rope dimension count the rotated part of a head, LongRoPE's
    factors as tensors with the original window and magnitude in the metadata. It imports
    to the checkpoint it came from."""
    import math

    from safetensors.numpy import load_file

    from engine.loading import load_weights
    from tests.engine.test_models import PHI4_MINI_ROPE
    from tests.fixtures.tiny_models import write_tiny_model

    hf_folder = write_tiny_model(tmp_path / "hf", "phi3", num_hidden_layers=2, tie=False,
                                 config_overrides=PHI4_MINI_ROPE)
    config = read_json(hf_folder, "config.json")
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    hf = load_file(str(hf_folder / "model.safetensors"))
    tokens, token_types = vocabulary()
    tokens += [f"<unused{i}>" for i in range(config["vocab_size"] - len(tokens))]
    token_types += [3] * (config["vocab_size"] - len(token_types))
    w = gguf_writer_for(tmp_path / "p.gguf", "phi3", config, "default", tokens, token_types)
    rot = int(config["head_dim"] * config["partial_rotary_factor"])
    w.add_rope_dimension_count(rot)
    original = config["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(original)
    stretch = config["max_position_embeddings"] / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(stretch) / math.log(original)))
    w.add_eos_token_id(2)
    scaling = config["rope_scaling"]
    w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
    for name, x in hf.items():
        gname = llama_cpp_name(name, PHI3_TO_GGUF)
        w.add_tensor(gname, x.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = import_gguf(tmp_path / "p.gguf", tmp_path / "imported", backend="cpu")
    imported = read_json(out, "config.json")
    assert imported["model_type"] == "phi3"
    assert imported["partial_rotary_factor"] == 0.75
    assert imported["rope_scaling"]["long_factor"] == pytest.approx(scaling["long_factor"])
    ours, _ = load_weights(out, backend="cpu")
    ref, _ = load_weights(hf_folder, backend="cpu")
    ids = mx.array([[1, 17, 42, 201, 5, 77, 123, 2, 64, 9, 250, 33] * 2])
    want = ref(ids)
    assert (mx.abs(ours(ids) - want).max() / mx.abs(want).max()).item() < 1e-5
