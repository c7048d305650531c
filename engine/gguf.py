"""GGUF (llama family, Gemma 3) -> HF-style model folder.

A GGUF file holds weights, hyper-parameters and the tokenizer in one file. The rest of the
engine only reads HF-style folders, so importing converts once: `config.json` from the
metadata, `model.safetensors` with HF tensor names, `tokenizer.json` rebuilt with the
`tokenizers` library (engine/gguf_tokenizer.py), `tokenizer_config.json` with the chat
template, `generation_config.json` with every end-of-turn id.

Weights (read by engine/gguf_reading.py): Q4_0/Q4_1/Q8_0 files stay quantized as MLX reads
them (affine triples `.weight/.scales/.biases`, group 32). Every other GGML type (K-quants,
IQ-quants) is dequantized by llama.cpp's `gguf` package and then held as the backend wants
(`engine.loading.holds_quantized`): float32, exactly as decoded, for MLX's CPU backend;
re-quantized to MLX affine 8 or 4 bits, group 64 (`mlx_bits` picks by source type), where
quantized matmuls are fast. The mlx-style `quantization` entry in `config.json` says so.

llama.cpp's converter interleaves the q/k rows of each head for its RoPE kernel; HF layout
keeps the two rotated halves apart. `_unpermute_rows` undoes that, which is the one step
that silently ruins the model when it is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.errors import EngineError, ModelFormatError, UnsupportedModelError
from engine.gguf_reading import REQUANT_GROUP, TensorSource, meta_value, mlx_bits, read_gguf
from engine.gguf_tokenizer import build_tokenizer, generation_config, tokenizer_config
from engine.loading import default_backend, holds_quantized
from engine.weights import WeightPlan, check_memory

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3")
GROUP_SIZE = 32  # GGUF block size of Q4_0/Q4_1/Q8_0, kept by MLX as the quantization group
IMPORTER_VERSION = 1
IMPORT_INFO = "import_info.json"
FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", IMPORT_INFO)

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
            "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
# config.json's model_type where it is not the arch
_MODEL_TYPE = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
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
# Gemma 3 names its norms apart: `ffn_norm` is the norm before the MLP, and two more follow
# attention and the MLP
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Qwen3-MoE's router and stacked experts (llama.cpp stores them stacked, as mlx-lm does)
_MOE_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
# Phi-3 keeps q/k/v in one matrix, and gate and up in one that llama.cpp names `ffn_up`
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj",
                     "ffn_up": "mlp.gate_up_proj"}
# tensors llama.cpp stores that config.json holds instead (RoPE factors)
_FOLDED_INTO_CONFIG = ("rope_freqs.weight", "rope_factors_long.weight",
                       "rope_factors_short.weight")
# Ollama's Gemma 3 files hold the vision tower and projector beside the text model
_IMAGE_PREFIXES = {"gemma3": ("v.", "mm.")}
# what llama.cpp takes as given for Gemma 3 rather than storing it
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is not head_dim^-0.5
_SUFFIXES = ("weight", "bias", "scales", "biases")


def import_gguf(src: Path, dest: Path, *, overwrite: bool = False, backend: str | None = None,
                memory_budget: int | None = None,
                on_progress: Callable[[int, int], None] | None = None,
                content_hashes: bool = False) -> Path:
    """Convert the GGUF file `src` into the HF-style folder `dest`; returns `dest`.

    `on_progress(done, total)` counts tensors converted, for a progress bar (the folder is
    written after the last one).

    `backend` ("cpu", "metal", "cuda"; default: this machine's) decides how dequantized
    types are written (see the module docstring); `memory_budget` (bytes) replaces the
    measured available memory in the check made before dequantizing to float32.
    The folder is written under a temporary name beside `dest` and renamed at the end, so a
    killed import never leaves a half-written model behind. With `overwrite`, an existing
    model folder at `dest` is replaced; otherwise an existing `dest` is an error.
    With `content_hashes`, import_info.json also records each file's hash and mtime, so a
    folder the app owns (the demo) can tell bytes damaged in place at the same size.
    """
    src, dest = Path(src), Path(dest)
    backend = backend or default_backend()
    sources, meta = read_gguf(src)
    arch = meta_value(meta, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{src}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    sources = {n: t for n, t in sources.items()
               if not n.startswith(_IMAGE_PREFIXES.get(arch, ()))}
    config = _config(src, arch, meta, sources)
    tokenizer = build_tokenizer(src, meta)
    quantize = holds_quantized(backend)
    if not quantize:
        _check_float32_fits(src, sources, memory_budget, backend)
    weights, quantization = _hf_weights(src, arch, config, sources, quantize, on_progress)
    if quantization:
        config["quantization"] = quantization
    info = {"source": src.name, "size": src.stat().st_size, "importer_version": IMPORTER_VERSION,
            "backend": backend}

    def write(folder: Path) -> None:
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
        tokenizer.save(str(folder / "tokenizer.json"))
        _write_json(folder / "config.json", config)
        _write_json(folder / "tokenizer_config.json", tokenizer_config(meta, config))
        _write_json(folder / "generation_config.json", generation_config(meta, config))
        # written last, with the sizes of the files before it (a later truncation shows)
        sizes = {name: (folder / name).stat().st_size for name in FOLDER_FILES
                 if name != IMPORT_INFO}
        extra = content_stamps(folder) if content_hashes else {}
        _write_json(folder / IMPORT_INFO, {**info, "files": sizes, **extra})

    _write_atomically(dest, write, overwrite)
    return dest


def _check_float32_fits(src: Path, sources: dict[str, TensorSource], budget: int | None,
                        backend: str) -> None:
    """Refuse before dequantizing when float32 copies of the quantized tensors won't fit."""
    decoded = [s for s in sources.values() if s.dequantized]
    if not decoded:
        return
    n_params = sum(math.prod(s.shape) for s in sources.values())
    check_memory(src, WeightPlan(n_params, n_params * 4, dequantize=True), budget, backend)


def _require(src: Path, meta: dict[str, Any], key: str) -> Any:
    v = meta_value(meta, key)
    if v is None:
        raise ModelFormatError(f"{src}: metadata field {key!r} is missing")
    if isinstance(v, list):
        raise UnsupportedModelError(f"{src}: per-layer values for {key!r} are not supported")
    return v


# ----------------------------------------------------------------------------------- config


def _config(src: Path, arch: str, meta: dict[str, Any], tensors: dict[str, TensorSource]
            ) -> dict[str, Any]:
    """config.json fields from `<arch>.*` metadata; shapes double-check the numbers."""
    if "token_embd.weight" not in tensors:
        raise ModelFormatError(f"{src}: tensor 'token_embd.weight' is missing")
    hidden = int(_require(src, meta, f"{arch}.embedding_length"))
    n_heads = int(_require(src, meta, f"{arch}.attention.head_count"))
    n_kv = int(meta_value(meta, f"{arch}.attention.head_count_kv", n_heads))
    # Phi-3's rope dimension count is the rotated part of a head, not the head
    rope_counts_head = arch != "phi3"
    head_dim = int(meta_value(meta, f"{arch}.attention.key_length", 0)
                   or (rope_counts_head and meta_value(meta, f"{arch}.rope.dimension_count", 0))
                   or hidden // n_heads)
    rope_dims = int(meta_value(meta, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim and rope_counts_head:
        raise UnsupportedModelError(
            f"{src}: partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    config: dict[str, Any] = {
        "architectures": [_HF_ARCH[arch]],
        "model_type": _MODEL_TYPE.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": int(_require(src, meta, f"{arch}.feed_forward_length"
                                          if arch != "qwen3moe"
                                          or meta_value(meta, f"{arch}.feed_forward_length")
                                          else f"{arch}.expert_feed_forward_length")),
        "num_hidden_layers": int(_require(src, meta, f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "rms_norm_eps": float(meta_value(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta_value(meta, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta_value(meta, f"{arch}.context_length", 4096)),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if head_dim != hidden // n_heads or arch in ("qwen3", "qwen3moe", "gemma3"):
        config["head_dim"] = head_dim
    if arch == "qwen3moe":
        config |= _experts_config(src, arch, meta)
    if arch == "phi3":
        config |= _phi3_config(meta, head_dim, rope_dims)
    if arch == "llama" and "blk.0.attn_q.bias" in tensors:
        config["attention_bias"] = True
    if arch == "gemma3":
        config |= _gemma3_config(src, meta, config, head_dim)
    rope_scaling = _rope_scaling(src, arch, meta, tensors, config, head_dim)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    bos = meta_value(meta, "tokenizer.ggml.bos_token_id")
    eos = meta_value(meta, "tokenizer.ggml.eos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    if eos is not None:
        config["eos_token_id"] = int(eos)
    return config


def _experts_config(src: Path, arch: str, meta: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's expert counts; every layer sparse, the chosen experts' weights
    renormalized (llama.cpp's `norm_w` for this arch)."""
    return {
        "num_experts": int(_require(src, meta, f"{arch}.expert_count")),
        "num_experts_per_tok": int(_require(src, meta, f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(_require(src, meta,
                                              f"{arch}.expert_feed_forward_length")),
        "norm_topk_prob": bool(meta_value(meta, f"{arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _phi3_config(meta: dict[str, Any], head_dim: int, rope_dims: int) -> dict[str, Any]:
    """Phi-3's share of each head that turns, its LongRoPE window, and its sliding window
    where the file states one."""
    out: dict[str, Any] = {"partial_rotary_factor": rope_dims / head_dim}
    original = meta_value(meta, "phi3.rope.scaling.original_context_length")
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    window = meta_value(meta, "phi3.attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
    return out


def _gemma3_config(src: Path, meta: dict[str, Any], config: dict[str, Any], head_dim: int
                   ) -> dict[str, Any]:
    """Gemma 3's own fields. llama.cpp stores the sliding window; the rest it takes as
    given (`llama-model.cpp`): a global layer every sixth, local layers at RoPE base 10,000,
    and the attention scale head_dim^-0.5 except on the 27B (62 layers), where it is
    (hidden / heads)^-0.5, as Google's reference code has it."""
    window = meta_value(meta, "gemma3.attention.sliding_window")
    if window is None:
        raise ModelFormatError(f"{src}: metadata field 'gemma3.attention.sliding_window' is missing")
    scalar = (config["hidden_size"] // config["num_attention_heads"]
              if config["num_hidden_layers"] == GEMMA3_27B_LAYERS else head_dim)
    return {
        "sliding_window": int(window),
        "sliding_window_pattern": int(meta_value(meta, "gemma3.attention.sliding_window_pattern",
                                                 GEMMA3_SWA_PATTERN)),
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": float(meta_value(meta, "gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
    }


def _rope_scaling(src: Path, arch: str, meta: dict[str, Any], tensors: dict[str, TensorSource],
                  config: dict[str, Any], head_dim: int) -> dict[str, Any] | None:
    """Recover Llama 3.1-style scaling from the `rope_freqs` factors llama.cpp stores, or
    the linear scaling it names (Gemma 3's larger sizes).

    The converter keeps only the per-frequency factors; they match the llama3 formula with
    the published parameters, which we check before claiming them.
    """
    if "rope_factors_long.weight" in tensors:  # Phi-3's LongRoPE
        factors = {name: np.array(tensors[f"rope_factors_{name}.weight"].load()
                                  .astype(mx.float32)).tolist()
                   for name in ("long", "short") if f"rope_factors_{name}.weight" in tensors}
        scaling: dict[str, Any] = {"type": "longrope", "long_factor": factors["long"],
                                   "short_factor": factors.get("short", factors["long"])}
        attn_factor = meta_value(meta, f"{arch}.rope.scaling.attn_factor")
        if attn_factor is not None:
            scaling["long_mscale"] = float(attn_factor)
        return scaling
    kind = meta_value(meta, f"{arch}.rope.scaling.type")
    if kind == "linear":
        factor = meta_value(meta, f"{arch}.rope.scaling.factor")
        if not isinstance(factor, int | float) or factor <= 0:
            raise ModelFormatError(
                f"{src}: metadata field '{arch}.rope.scaling.factor' must be a positive number, "
                f"got {factor!r}")
        return {"rope_type": "linear", "factor": float(factor)}
    if kind not in (None, "none") and "rope_freqs.weight" not in tensors:
        raise UnsupportedModelError(f"{src}: RoPE scaling {kind!r} is not supported")
    if "rope_freqs.weight" not in tensors:
        return None
    stored = np.array(tensors["rope_freqs.weight"].load().astype(mx.float32))
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


def _hf_name(name: str, arch: str = "llama") -> str | None:
    """GGUF tensor name -> HF name, or None for names we do not know."""
    base, _, suffix = name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    layer_names = {"gemma3": _GEMMA3_LAYER_NAMES, "qwen3moe": _MOE_LAYER_NAMES,
                   "phi3": _PHI3_LAYER_NAMES}.get(arch, _LAYER_NAMES)
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    return None


def _hf_weights(src: Path, arch: str, config: dict[str, Any], tensors: dict[str, TensorSource],
                quantize: bool, on_progress: Callable[[int, int], None] | None = None,
                ) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Rename to HF keys, un-permute llama q/k rows, hold dequantized types as the backend
    wants, and describe the quantization. One tensor at a time, so at most one float32
    copy of a re-quantized tensor exists at once."""
    unknown = [n for n in tensors if n not in _FOLDED_INTO_CONFIG and _hf_name(n, arch) is None]
    if unknown:
        raise UnsupportedModelError(
            f"{src}: unexpected tensors {', '.join(sorted(unknown)[:3])} (not a plain "
            f"{arch} decoder; merged QKV GGUFs, and mixture-of-experts ones but Qwen3-MoE's, "
            "are not supported)")
    heads = {"self_attn.q_proj": config["num_attention_heads"],
             "self_attn.k_proj": config["num_key_value_heads"]}
    weights: dict[str, mx.array] = {}
    specs: dict[str, tuple[int, int]] = {}  # module -> (group size, bits)
    for done, (name, source) in enumerate(tensors.items()):
        if on_progress is not None:
            on_progress(done, len(tensors))
        hf = _hf_name(name, arch)
        if hf is None:  # RoPE factors: folded into config.json
            continue
        module, _, suffix = hf.rpartition(".")
        x = source.load()
        if arch == "llama" and module.split(".", 3)[-1] in heads:
            x = _unpermute_rows(x, heads[module.split(".", 3)[-1]])
        if arch == "gemma3" and hf.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norms as the 1 + weight they multiply
            # by; the checkpoint's own weight is what the decoder loads
            x = x.astype(mx.float32) - 1.0
        if source.dequantized:
            held = _held(x, source.ggml_type, suffix, quantize)
            if isinstance(held, tuple):
                packed, scales, biases, specs[module] = held
                weights |= {hf: packed, f"{module}.scales": scales, f"{module}.biases": biases}
                continue
            x = held
        weights[hf] = x
        if suffix == "scales":  # mx.load's own triple: group 32, bits from the packed width
            packed_in = tensors[name.rpartition(".")[0] + ".weight"].shape[-1]
            specs[module] = (GROUP_SIZE, packed_in * 32 // (x.shape[-1] * GROUP_SIZE))
    if on_progress is not None:
        on_progress(len(tensors), len(tensors))
    return weights, _quantization_block(specs)


def _held(x: mx.array, ggml_type: str, suffix: str, quantize: bool
          ) -> mx.array | tuple[mx.array, mx.array, mx.array, tuple[int, int]]:
    """A dequantized tensor as the backend holds it: float32 (exact) when it does not keep
    weights quantized; else an MLX affine triple of `mlx_bits(ggml_type)` bits, or float16
    for a tensor that is no matrix or whose rows do not split into groups."""
    if not quantize:
        return x
    bits = mlx_bits(ggml_type)
    cols = x.shape[-1] if x.ndim >= 2 else 0  # a matrix, or stacked experts' matrices
    group = next((g for g in (REQUANT_GROUP, 32) if cols and cols % g == 0), None)
    if bits is None or suffix != "weight" or group is None:
        return x.astype(mx.float16)
    packed, scales, biases = mx.quantize(x.astype(mx.float16), group_size=group, bits=bits)
    mx.eval(packed, scales, biases)  # frees the float32 copy before the next tensor
    return packed, scales, biases, (group, bits)


def _quantization_block(specs: dict[str, tuple[int, int]]) -> dict[str, Any] | None:
    """mlx-style `quantization`: the most common (group, bits), other modules one by one."""
    if not specs:
        return None
    group, bits = Counter(specs.values()).most_common(1)[0][0]
    block: dict[str, Any] = {"group_size": group, "bits": bits}
    for module, (g, b) in sorted(specs.items()):
        if (g, b) != (group, bits):  # unquantized modules simply have no `.scales`
            block[module] = {"group_size": g, "bits": b}
    return block


# ---------------------------------------------------------------------------------- writing


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def file_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def content_stamps(folder: Path) -> dict[str, dict[str, Any]]:
    """import_info's "hashes" and "mtimes" of the folder's files: the mtime lets a check
    hash again only files written since, so a normal start pays nothing."""
    names = [n for n in FOLDER_FILES if n != IMPORT_INFO]
    return {"hashes": {n: file_hash(folder / n) for n in names},
            "mtimes": {n: (folder / n).stat().st_mtime_ns for n in names}}


def _stale_partials(dest: Path) -> list[Path]:
    """Partial folders of earlier imports into `dest` whose process is gone: a killed
    import leaves its `.importing-<pid>-<tag>` folder (often the size of the model)."""
    stale = []
    for p in dest.parent.glob(f".{dest.name}.importing-*"):
        pid = p.name.rsplit(".importing-", 1)[1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            stale.append(p)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process: alive
        return True
    return True


def _write_atomically(dest: Path, write: Callable[[Path], None], overwrite: bool) -> None:
    """Fill a temporary sibling folder named with this process's id, then rename it to
    `dest`; partial folders that killed imports into `dest` left are removed first."""
    if dest.exists():
        if not overwrite:
            raise EngineError(f"{dest}: already exists; choose another folder or remove it")
        if not dest.is_dir() or (any(dest.iterdir()) and not (dest / "config.json").exists()):
            raise EngineError(f"{dest}: exists and is not a model folder; refusing to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in _stale_partials(dest):
        shutil.rmtree(stale, ignore_errors=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
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
