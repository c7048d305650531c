"""GGUF (llama family) -> HF-style model folder.

A GGUF file holds weights, hyper-parameters and the tokenizer in one file. The rest of the
engine only reads HF-style folders, so importing converts once: `config.json` from the
metadata, `model.safetensors` with HF tensor names, `tokenizer.json` rebuilt with the
`tokenizers` library, `tokenizer_config.json` with the chat template, `generation_config.json`
with every end-of-turn id. Quantized tensors stay quantized (MLX reads Q4_0/Q4_1/Q8_0 as
affine triples `.weight/.scales/.biases`, group 32) and the mlx-style `quantization` entry in
`config.json` says so.

llama.cpp's converter interleaves the q/k rows of each head for its RoPE kernel; HF layout
keeps the two rotated halves apart. `_unpermute_rows` undoes that, which is the one step
that silently ruins the model when it is wrong.
"""

from __future__ import annotations

import json
import math
import shutil
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import EngineError, ModelFormatError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Tensor types mx.load decodes; anything else (K-quants, IQ-quants) it cannot read.
READABLE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
GROUP_SIZE = 32  # GGUF block size of Q4_0/Q4_1/Q8_0, kept by MLX as the quantization group
IMPORTER_VERSION = 1
IMPORT_INFO = "import_info.json"
FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", IMPORT_INFO)

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_SUFFIXES = ("weight", "bias", "scales", "biases")

# Pre-tokenizer regexes, as in the original HF tokenizers these GGUFs were converted from.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_KINDS = {
    "default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits",
    "llama-bpe": "llama3", "llama3": "llama3", "smaug-bpe": "llama3", "dbrx": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


def import_gguf(src: Path, dest: Path, *, overwrite: bool = False) -> Path:
    """Convert the GGUF file `src` into the HF-style folder `dest`; returns `dest`.

    The folder is written under a temporary name beside `dest` and renamed at the end, so a
    killed import never leaves a half-written model behind. With `overwrite`, an existing
    model folder at `dest` is replaced; otherwise an existing `dest` is an error.
    """
    src, dest = Path(src), Path(dest)
    tensors, meta = _read_gguf(src)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{src}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    config = _config(src, arch, meta, tensors)
    weights, quantization = _hf_weights(src, arch, config, tensors)
    if quantization:
        config["quantization"] = quantization
    tokenizer = _build_tokenizer(src, meta)
    info = {"source": src.name, "size": src.stat().st_size, "importer_version": IMPORTER_VERSION}

    def write(folder: Path) -> None:
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
        tokenizer.save(str(folder / "tokenizer.json"))
        _write_json(folder / "config.json", config)
        _write_json(folder / "tokenizer_config.json", _tokenizer_config(meta, config))
        _write_json(folder / "generation_config.json", _generation_config(meta, config))
        _write_json(folder / IMPORT_INFO, info)

    _write_atomically(dest, write, overwrite)
    return dest


# ---------------------------------------------------------------------------------- reading


def _read_gguf(src: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """mx.load the file, turning its terse failures into messages a user can act on."""
    if not src.is_file():
        raise ModelFormatError(f"{src}: no such file")
    with src.open("rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        raise ModelFormatError(f"{src}: not a GGUF file (it does not start with 'GGUF')")
    if len(head) < 8 or int.from_bytes(head[4:8], "little") not in (2, 3):
        raise ModelFormatError(f"{src}: unsupported GGUF version (expected 2 or 3)")
    try:
        tensors, meta = mx.load(str(src), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise _diagnose(src, e) from e
    return tensors, meta


def _diagnose(src: Path, error: Exception) -> EngineError:
    """Name the unreadable tensor types, else report the file as truncated or corrupt."""
    text = str(error)
    if "past the end" in text or "gguf_init" in text:
        return ModelFormatError(
            f"{src}: truncated or corrupt GGUF file ({text}); download it again")
    try:  # slow (seconds) but only on this error path
        import gguf

        reader = gguf.GGUFReader(src)
        bad = Counter(t.tensor_type.name for t in reader.tensors
                      if t.tensor_type.name not in READABLE_TYPES)
    except Exception:  # the reader failing is itself a sign of a corrupt file
        bad = Counter()
    if bad:
        kinds = ", ".join(f"{k} ({n} tensors)" for k, n in bad.most_common())
        return UnsupportedModelError(
            f"{src}: tensor types {kinds} cannot be read; MLX reads {', '.join(READABLE_TYPES)}. "
            "Download the Q8_0, Q4_0 or F16 file of this model instead")
    return ModelFormatError(f"{src}: cannot read GGUF file ({text})")


def _value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as plain Python (mx.load gives 0-d arrays for numbers)."""
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def _require(src: Path, meta: dict[str, Any], key: str) -> Any:
    v = _value(meta, key)
    if v is None:
        raise ModelFormatError(f"{src}: metadata field {key!r} is missing")
    if isinstance(v, list):
        raise UnsupportedModelError(f"{src}: per-layer values for {key!r} are not supported")
    return v


# ----------------------------------------------------------------------------------- config


def _config(src: Path, arch: str, meta: dict[str, Any], tensors: dict[str, mx.array]
            ) -> dict[str, Any]:
    """config.json fields from `<arch>.*` metadata; shapes double-check the numbers."""
    if "token_embd.weight" not in tensors:
        raise ModelFormatError(f"{src}: tensor 'token_embd.weight' is missing")
    hidden = int(_require(src, meta, f"{arch}.embedding_length"))
    n_heads = int(_require(src, meta, f"{arch}.attention.head_count"))
    n_kv = int(_value(meta, f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(_value(meta, f"{arch}.attention.key_length", 0)
                   or _value(meta, f"{arch}.rope.dimension_count", 0) or hidden // n_heads)
    rope_dims = int(_value(meta, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise UnsupportedModelError(
            f"{src}: partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    config: dict[str, Any] = {
        "architectures": [_HF_ARCH[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(_require(src, meta, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_require(src, meta, f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "rms_norm_eps": float(_value(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_value(meta, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_value(meta, f"{arch}.context_length", 4096)),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if head_dim != hidden // n_heads or arch == "qwen3":
        config["head_dim"] = head_dim
    if arch == "llama" and "blk.0.attn_q.bias" in tensors:
        config["attention_bias"] = True
    rope_scaling = _rope_scaling(src, arch, meta, tensors, config, head_dim)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    bos, eos = _value(meta, "tokenizer.ggml.bos_token_id"), _value(meta, "tokenizer.ggml.eos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    if eos is not None:
        config["eos_token_id"] = int(eos)
    return config


def _rope_scaling(src: Path, arch: str, meta: dict[str, Any], tensors: dict[str, mx.array],
                  config: dict[str, Any], head_dim: int) -> dict[str, Any] | None:
    """Recover Llama 3.1-style scaling from the `rope_freqs` factors llama.cpp stores.

    The converter keeps only the per-frequency factors; they match the llama3 formula with
    the published parameters, which we check before claiming them.
    """
    kind = _value(meta, f"{arch}.rope.scaling.type")
    if kind not in (None, "none") and "rope_freqs.weight" not in tensors:
        raise UnsupportedModelError(f"{src}: RoPE scaling {kind!r} is not supported")
    if "rope_freqs.weight" not in tensors:
        return None
    stored = np.array(tensors["rope_freqs.weight"].astype(mx.float32))
    scaling = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expected = _llama3_factors(config["rope_theta"], head_dim, scaling)
    if expected.shape != stored.shape or not np.allclose(expected, stored, rtol=1e-3):
        raise UnsupportedModelError(
            f"{src}: tensor 'rope_freqs.weight' holds RoPE factors that match no known scaling")
    return scaling


def _llama3_factors(theta: float, dims: int, s: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors Llama 3.1 scaling applies (llama.cpp's `rope_freqs`)."""
    freqs = 1.0 / theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelen = 2 * math.pi / freqs
    old, low, high = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    smooth = (old / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / s["factor"] + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, s["factor"], mid))


# ---------------------------------------------------------------------------------- weights


def _unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row interleave: per head, rows (j, i) -> (i, j), i in {0, 1}.

    llama.cpp wrote `hf.reshape(h, 2, d/2, ...).swapaxes(1, 2)`; rows permute freely for the
    quantized triples because quantization groups run along the input (column) dimension.
    """
    rows, rest = x.shape[0], tuple(x.shape[1:])
    half = rows // n_heads // 2
    return x.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _hf_name(name: str) -> str | None:
    """GGUF tensor name -> HF name, or None for names we do not know."""
    base, _, suffix = name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def _hf_weights(src: Path, arch: str, config: dict[str, Any], tensors: dict[str, mx.array]
                ) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Rename to HF keys, un-permute llama q/k rows, and describe the quantization."""
    unknown = [n for n in tensors if n != "rope_freqs.weight" and _hf_name(n) is None]
    if unknown:
        raise UnsupportedModelError(
            f"{src}: unexpected tensors {', '.join(sorted(unknown)[:3])} (not a plain "
            f"{arch} decoder; merged QKV or mixture-of-experts GGUFs are not supported)")
    heads = {"self_attn.q_proj": config["num_attention_heads"],
             "self_attn.k_proj": config["num_key_value_heads"]}
    weights: dict[str, mx.array] = {}
    bits_of: dict[str, int] = {}
    for name, x in tensors.items():
        hf = _hf_name(name)
        if hf is None:  # rope_freqs: folded into config.json
            continue
        module, _, suffix = hf.rpartition(".")
        kind = module.split(".", 3)[-1]
        if arch == "llama" and kind in heads:
            x = _unpermute_rows(x, heads[kind])
        weights[hf] = x
        if suffix == "scales":
            packed = tensors[name.rpartition(".")[0] + ".weight"]
            bits_of[module] = packed.shape[-1] * 32 // (x.shape[-1] * GROUP_SIZE)
    if not bits_of:
        return weights, None
    default = Counter(bits_of.values()).most_common(1)[0][0]
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default}
    for module, bits in sorted(bits_of.items()):
        if bits != default:  # unquantized modules simply have no `.scales`
            quantization[module] = {"group_size": GROUP_SIZE, "bits": bits}
    return weights, quantization


# -------------------------------------------------------------------------------- tokenizer


def _build_tokenizer(src: Path, meta: dict[str, Any]) -> HFTokenizer:
    """Byte-level BPE from `tokenizer.ggml.*`, pre-tokenized as the original HF tokenizer."""
    kind = _value(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{src}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'; "
            "SentencePiece 'llama' tokenizers are not)")
    pre = _value(meta, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_KINDS:
        raise UnsupportedModelError(
            f"{src}: tokenizer pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_PRE_KINDS))})")
    tokens: list[str] = _value(meta, "tokenizer.ggml.tokens") or []
    merges: list[str] = _value(meta, "tokenizer.ggml.merges") or []
    types: list[int] = _value(meta, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or not merges:
        raise ModelFormatError(f"{src}: tokenizer tokens or merges are missing")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ModelFormatError(f"{src}: malformed entry in tokenizer.ggml.merges")
    style = _PRE_KINDS[pre]
    tok = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=style == "llama3"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=style in ("gpt2", "digits"))
    if style == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif style in ("llama3", "qwen2"):
        split = _LLAMA3_SPLIT if style == "llama3" else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=ty == _TOKEN_CONTROL, normalized=False)
             for t, ty in zip(tokens, types, strict=False)
             if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    bos = _value(meta, "tokenizer.ggml.bos_token_id")
    if _add_bos(meta) and bos is not None and bos < len(tokens):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B:1",
            special_tokens=[(tokens[bos], int(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _add_bos(meta: dict[str, Any]) -> bool:
    return bool(_value(meta, "tokenizer.ggml.add_bos_token", False))


def _token(meta: dict[str, Any], key: str) -> str | None:
    tokens = meta.get("tokenizer.ggml.tokens") or []
    i = _value(meta, key)
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None


def _tokenizer_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """HF tokenizer_config.json: special tokens, BOS policy and the chat template(s)."""
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _add_bos(meta),
        "add_eos_token": bool(_value(meta, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    for field, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"),
                       ("unk_token", "unknown")):
        text = _token(meta, f"tokenizer.ggml.{key}_token_id")
        if text is not None:
            out[field] = text
    template = _value(meta, "tokenizer.chat_template")
    named = [{"name": n, "template": _value(meta, f"tokenizer.chat_template.{n}")}
             for n in (_value(meta, "tokenizer.chat_templates") or [])]
    if named and template:
        out["chat_template"] = [{"name": "default", "template": template}, *named]
    elif template:
        out["chat_template"] = template
    return out


def _generation_config(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Every id that ends a turn: eos plus llama.cpp's end-of-turn/end-of-message ids."""
    eos: list[int] = []
    for key in ("eos", "eot", "eom"):
        i = _value(meta, f"tokenizer.ggml.{key}_token_id")
        if i is not None and int(i) not in eos:
            eos.append(int(i))
    out: dict[str, Any] = {"eos_token_id": eos}
    if "bos_token_id" in config:
        out["bos_token_id"] = config["bos_token_id"]
    return out


# ---------------------------------------------------------------------------------- writing


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_atomically(dest: Path, write: Callable[[Path], None], overwrite: bool) -> None:
    """Fill a temporary sibling folder, then rename it to `dest`."""
    if dest.exists():
        if not overwrite:
            raise EngineError(f"{dest}: already exists; choose another folder or remove it")
        if not dest.is_dir() or (any(dest.iterdir()) and not (dest / "config.json").exists()):
            raise EngineError(f"{dest}: exists and is not a model folder; refusing to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = dest.parent / f".{dest.name}.importing-{tag}"
    tmp.mkdir()
    try:
        write(tmp)
        if dest.exists():
            old = dest.parent / f".{dest.name}.replaced-{tag}"
            dest.rename(old)
            tmp.rename(dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
