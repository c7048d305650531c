"""One decoder-only transformer for llama, mistral, qwen2, qwen3 (and its MoE), SmolLM3,
Phi-3/Phi-4 and Gemma 3.

They differ only in switches read from `config.json`: qwen2 adds biases to the q/k/v
projections, qwen3 normalises q and k per head, llama3 rescales RoPE frequencies, SmolLM3
leaves RoPE out of every fourth layer, Mistral 7B v0.1 slides a 4,096-token window,
Qwen3-MoE routes each token through k of its experts' MLPs (`engine.models.experts`),
Phi-3 fuses q/k/v and gate/up into one matrix each and may rotate only part of each head
with LongRoPE's per-frequency stretch. Gemma 3
(`gemma3_text`, the text-only checkpoints such as gemma-3-270m and gemma-3-1b) adds more:
embeddings scaled by sqrt(hidden_size), norms that multiply by 1 + weight (folded into the
weights when they load, `Model.sanitize`), q/k norms, a norm after attention and around the
MLP ("sandwich" norms), a tanh-approximated GELU, its own attention scale
(`query_pre_attn_scalar`), and sliding-window layers: five of every six attend only to the
last `sliding_window` positions, with their own RoPE base (`rope_local_base_freq`), while
the sixth attends to everything with `rope_theta` (linearly scaled on the larger models).
Module attribute names equal the checkpoint keys, so loading needs no rename table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.cache import KVCache
from engine.errors import ModelFormatError, UnsupportedModelError
from engine.models.activations import gated
from engine.models.attention import attention, slide_window
from engine.models.experts import SparseMoE
from engine.models.rope import rope_table
from engine.models.taps import Capture, FeatureTap, FeatureTaps
from kernels import dispatch

DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "smollm3", "qwen3_moe",
                 "phi3")
# config.json model types the loader reads: these, and Gemma 3's vision-language
# checkpoints, whose text model is a gemma3_text (`engine.models.text_part`)
SUPPORTED_MODEL_TYPES = (*DECODER_TYPES, "gemma3")
GEMMA_TYPES = ("gemma3_text",)
PHI3_ORIGINAL_WINDOW = 4096  # LongRoPE's original window where a Phi-3 config states none
# the RoPE scalings the decoder computes (`rope_frequencies`); LongRoPE's two names
ROPE_SCALINGS = (None, "default", "llama3", "linear", "longrope", "su")
LONGROPE = ("longrope", "su")


def rope_kind(scaling: dict[str, Any] | None) -> str | None:
    """A rope_scaling object's type, under either key configs use for it."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type"))


@dataclass
class ModelArgs:
    """The config.json fields the decoder reads; defaults filled in `__post_init__`."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None
    mlp_bias: bool = False
    sliding_window: int | None = None
    # Gemma 3: attention scale query_pre_attn_scalar^-0.5; every `sliding_window_pattern`-th
    # layer is global, the others slide (or `layer_types` names each layer); local RoPE base
    query_pre_attn_scalar: float | None = None
    sliding_window_pattern: int | None = None
    layer_types: list[str] | None = None
    rope_local_base_freq: float | None = None
    hidden_activation: str | None = None
    # SmolLM3: layers without RoPE ("NoPE"), listed (1 = RoPE) or every `interval`-th
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int | None = None
    # Qwen3-MoE: `num_experts_per_tok` of `num_experts` expert MLPs per token, on every
    # `decoder_sparse_step`-th layer but those `mlp_only_layers` lists
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # Phi-3/Phi-4: RoPE over this share of each head's dims; LongRoPE's original window
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_type not in DECODER_TYPES:
            raise UnsupportedModelError(
                f"config.json: model_type {self.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        self._check_types()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.attention_bias is None:
            self.attention_bias = self.model_type == "qwen2"
        if self.is_gemma:
            self._check_gemma()
        self._check_rotary()
        if self.model_type in ("mistral", "phi3"):
            self._check_window()
        if self.model_type == "smollm3":
            self._check_nope()
        if self.model_type == "qwen3_moe":
            self._check_experts()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFormatError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) is not a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )

    def _check_types(self) -> None:
        """Each field the decoder computes with is of its kind, so a hand-edited config
        ("576" for 576, a negative layer count) is named here, not met as a TypeError in
        some arithmetic or as a model with no layers."""
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if not _is_int(value):
                raise ModelFormatError(f"config.json: {name} must be an integer, got {value!r}")
            if value < 1:
                raise ModelFormatError(f"config.json: {name} must be at least 1, got {value}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (_is_int(value) or isinstance(value, float)) or not value > 0:
                raise ModelFormatError(
                    f"config.json: {name} must be a positive number, got {value!r}")
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ModelFormatError(
                    f"config.json: {name} must be true or false, got {value!r}")
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise ModelFormatError(
                f"config.json: rope_scaling must be an object or null, got {scaling!r}")
        kind = rope_kind(scaling)
        if kind not in ROPE_SCALINGS:
            raise UnsupportedModelError(
                f"config.json: rope_scaling type {kind!r} is not supported "
                "(supported: default, llama3, linear, longrope)")
        factor = scaling.get("factor")
        if kind in ("llama3", "linear") and not (
                (_is_int(factor) or isinstance(factor, float)) and factor > 0):
            raise ModelFormatError(
                f"config.json: rope_scaling.factor must be a positive number, got {factor!r}")

    def _check_rotary(self) -> None:
        """Partial rotary and LongRoPE's factors, once head_dim is known."""
        share = self.partial_rotary_factor
        if not ((_is_int(share) or isinstance(share, float)) and 0 < share <= 1):
            raise ModelFormatError(
                f"config.json: partial_rotary_factor must be in (0, 1], got {share!r}")
        if rope_kind(self.rope_scaling) not in LONGROPE:
            return
        scaling = self.rope_scaling or {}
        half = self.rotary_dims // 2
        for name in ("short_factor", "long_factor"):
            value = scaling.get(name)
            if not (isinstance(value, list) and len(value) == half and all(
                    (_is_int(v) or isinstance(v, float)) and v > 0 for v in value)):
                raise ModelFormatError(
                    f"config.json: rope_scaling.{name} must list {half} positive numbers "
                    "(one per rotated frequency)")

    @property
    def rotary_dims(self) -> int:
        """How many of each head's dims RoPE rotates (Phi-4-mini: three quarters)."""
        assert self.head_dim is not None
        return int(self.head_dim * self.partial_rotary_factor) // 2 * 2

    @property
    def rope_scale(self) -> float:
        """LongRoPE's magnitude correction for the window it stretches to (1 elsewhere):
        what the config states, else sqrt(1 + ln(s) / ln(original)) for the stretch s."""
        if rope_kind(self.rope_scaling) not in LONGROPE:
            return 1.0
        scaling = self.rope_scaling or {}
        stated = scaling.get("long_mscale") or scaling.get("attention_factor")
        if stated:
            return float(stated)
        # (transformers' Phi-3 default where the config states no original window)
        original = (scaling.get("original_max_position_embeddings")
                    or self.original_max_position_embeddings or PHI3_ORIGINAL_WINDOW)
        stretch = self.max_position_embeddings / original
        return math.sqrt(1 + math.log(stretch) / math.log(original)) if stretch > 1 else 1.0

    def _check_gemma(self) -> None:
        """Gemma's own fields, each of its kind; the soft-capping Gemma 2 used is refused
        rather than ignored (a model computed without it writes nonsense)."""
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if self.extra.get(name) is not None:
                raise UnsupportedModelError(
                    f"config.json: {name} is not supported (Gemma 3 has none; got "
                    f"{self.extra[name]!r})")
        for name in ("query_pre_attn_scalar", "rope_local_base_freq"):
            value = getattr(self, name)
            if value is not None and not (
                    (_is_int(value) or isinstance(value, float)) and value > 0):
                raise ModelFormatError(
                    f"config.json: {name} must be a positive number, got {value!r}")
        self._check_window()
        types = self.layer_types
        if types is not None and (
                not isinstance(types, list) or len(types) != self.num_hidden_layers
                or any(t not in ("sliding_attention", "full_attention") for t in types)):
            raise ModelFormatError(
                "config.json: layer_types must list 'sliding_attention' or "
                f"'full_attention' for each of the {self.num_hidden_layers} layers")
        act = self.hidden_activation or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModelError(
                f"config.json: hidden_activation {act!r} is not supported "
                "(supported: gelu_pytorch_tanh)")

    def _check_window(self) -> None:
        for name in ("sliding_window", "sliding_window_pattern"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and value >= 1):
                raise ModelFormatError(
                    f"config.json: {name} must be a positive integer, got {value!r}")

    def _check_nope(self) -> None:
        listed, every = self.no_rope_layers, self.no_rope_layer_interval
        if listed is not None and (
                not isinstance(listed, list) or len(listed) != self.num_hidden_layers
                or any(v not in (0, 1) or isinstance(v, bool) for v in listed)):
            raise ModelFormatError(
                f"config.json: no_rope_layers must list 1 (RoPE) or 0 (none) for each of the "
                f"{self.num_hidden_layers} layers")
        if every is not None and not (_is_int(every) and every >= 1):
            raise ModelFormatError(
                f"config.json: no_rope_layer_interval must be a positive integer, got {every!r}")

    def _check_experts(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "decoder_sparse_step"):
            value = getattr(self, name)
            if not (_is_int(value) and value >= 1):
                raise ModelFormatError(
                    f"config.json: {name} must be a positive integer, got {value!r}")
        assert self.num_experts is not None and self.num_experts_per_tok is not None
        if self.num_experts_per_tok > self.num_experts:
            raise ModelFormatError(
                f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) is more than "
                f"num_experts ({self.num_experts})")
        if not isinstance(self.norm_topk_prob, bool):
            raise ModelFormatError(
                f"config.json: norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        if not isinstance(self.mlp_only_layers, list) or not all(
                _is_int(i) and 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ModelFormatError(
                f"config.json: mlp_only_layers must list layer indices below "
                f"num_hidden_layers ({self.num_hidden_layers}), got {self.mlp_only_layers!r}")

    def layer_is_sparse(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts (Qwen3-MoE's, but the dense ones
        `mlp_only_layers` lists)."""
        return (self.model_type == "qwen3_moe" and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def layer_has_rope(self, i: int) -> bool:
        """Whether layer i rotates q and k (SmolLM3 leaves every fourth layer without)."""
        if self.model_type != "smollm3":
            return True
        if self.no_rope_layers is not None:
            return bool(self.no_rope_layers[i])
        return (i + 1) % (self.no_rope_layer_interval or 4) != 0

    @property
    def fused_projections(self) -> bool:
        """Whether q/k/v and gate/up are each one matrix (Phi-3's `qkv_proj`,
        `gate_up_proj`)."""
        return self.model_type == "phi3"

    @property
    def is_gemma(self) -> bool:
        return self.model_type in GEMMA_TYPES

    @property
    def qk_norm(self) -> bool:
        return self.model_type in ("qwen3", "qwen3_moe") or self.is_gemma

    @property
    def attention_scale(self) -> float:
        assert self.head_dim is not None
        if self.is_gemma and self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim ** -0.5

    def layer_window(self, i: int) -> int | None:
        """How many positions layer i attends back over (itself included), or None for all:
        Gemma 3's sliding layers, and every layer of a Mistral or a Phi-3 that states a
        window (Mistral 7B v0.1's 4,096, Phi-3-mini-4k's 2,047; transformers applies them,
        mlx-lm does not)."""
        if self.sliding_window is None:
            return None
        if self.model_type in ("mistral", "phi3"):
            return self.sliding_window
        if not self.is_gemma:
            return None  # qwen2's configs state one they do not use
        if self.layer_types is not None:
            sliding = self.layer_types[i] == "sliding_attention"
        else:
            pattern = self.sliding_window_pattern or 6
            sliding = (i + 1) % pattern != 0
        return self.sliding_window if sliding else None

    def layer_rope(self, i: int) -> tuple[float, dict[str, Any] | None]:
        """(base, scaling) of layer i's RoPE: Gemma's sliding layers use their own base
        and no scaling."""
        if self.layer_window(i) is not None and self.rope_local_base_freq is not None:
            return float(self.rope_local_base_freq), None
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """Build from a parsed config.json, keeping unknown fields in `extra`."""
        config = _fold_rope_parameters(config)
        names = {f for f in cls.__dataclass_fields__ if f != "extra"}
        missing = [n for n in ("model_type", "hidden_size", "num_hidden_layers",
                               "intermediate_size", "num_attention_heads", "vocab_size")
                   if n not in config]
        if missing:
            raise ModelFormatError(f"config.json: missing field(s) {', '.join(missing)}")
        known = {k: v for k, v in config.items() if k in names}
        extra = {k: v for k, v in config.items() if k not in names}
        try:
            return cls(**known, extra=extra)
        except TypeError as e:
            raise ModelFormatError(f"config.json: {e}") from e


_POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "intermediate_size",
                  "num_attention_heads", "vocab_size", "num_key_value_heads", "head_dim",
                  "max_position_embeddings")
_OPTIONAL = ("num_key_value_heads", "head_dim")  # None: derived from the others


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no size


def _fold_rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """Read transformers >= 5 configs, which nest rope_theta and the scaling under
    `rope_parameters` instead of writing top-level `rope_theta`/`rope_scaling`."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        return config
    config = dict(config)
    if config.get("rope_theta") is None and "rope_theta" in params:
        config["rope_theta"] = params["rope_theta"]
    if config.get("rope_scaling") is None and rope_kind(params) not in (None, "default"):
        config["rope_scaling"] = params
    return config


def rope_frequencies(args: ModelArgs, base: float | None = None,
                     scaling: dict[str, Any] | None = None) -> mx.array | None:
    """Per-dimension RoPE periods for llama3 or linear scaling, else None (plain `base`).
    `base`/`scaling` default to the model's (`ModelArgs.layer_rope` gives a layer's)."""
    if base is None:
        base, scaling = args.rope_theta, args.rope_scaling
    scaling = scaling or {}
    kind = rope_kind(scaling)
    if kind in (None, "default"):
        return None
    dims = args.rotary_dims
    if kind in LONGROPE:
        # LongRoPE: each frequency stretched by its own factor; the long ones, as mlx-lm
        # uses them, since a chat here may run to the whole window the config states
        return mx.array(scaling["long_factor"], mx.float32) * base ** (
            mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    factor = scaling["factor"]
    if kind == "linear":  # positions divided by the factor: every period times it
        return factor * base ** (mx.arange(0, dims, 2) / dims)
    if kind != "llama3":
        raise UnsupportedModelError(f"config.json: rope_scaling type {kind!r} is not supported")
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    freqs = base ** (mx.arange(0, dims, 2) / dims)  # (dims/2,) as periods/2pi
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > low_wavelen, freqs * factor, freqs)
    smooth = (old_ctx / wavelens - low) / (high - low)
    smoothed = freqs / ((1 - smooth) / factor + smooth)
    is_medium = (wavelens <= low_wavelen) & (wavelens >= high_wavelen)
    return mx.where(is_medium, smoothed, freqs)


class Linear(nn.Linear):
    """`nn.Linear` that quantizes to our dispatching `QuantizedLinear`.

    On the CPU policy its weight is held column-major (`store_column_major`); the product is
    nn.Linear's either way.
    """

    def to_quantized(self, group_size: int | None = None, bits: int | None = None,
                     mode: str = "affine", quantize_input: bool = False) -> nn.Module:
        """What `nn.quantize` builds for a quantized checkpoint: our `QuantizedLinear`."""
        if quantize_input:
            return super().to_quantized(group_size, bits, mode, quantize_input)
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


def product_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose float `weight` a pass multiplies by: each `nn.Linear`, and a tied
    embedding, which is also the output layer (quantized ones excluded)."""
    tied = "lm_head" not in model and "model" in model and "embed_tokens" in model["model"]
    return [module for _, module in model.named_modules()
            if (isinstance(module, nn.Linear)
                or (tied and module is model["model"]["embed_tokens"]))
            and "scales" not in module and mx.issubdtype(module.weight.dtype, mx.floating)]


def store_column_major(model: nn.Module) -> None:
    """Hold every float matrix a pass multiplies by (`product_modules`) column-major: the
    same values and shape, laid out as the transpose's rows. Sets `model.weight_layout`.

    Why: a layer computes x @ W.T. With W row-major, MLX's CPU backend hands BLAS a
    transposed operand, and OpenBLAS's Haswell kernels are much slower on that: on the demo
    with the system OpenBLAS, a 1-row pass took ~1.25x and a 2-3 row pass ~1.2x as long as
    with W.T row-major, where BLAS reads the weight as stored (and ~1.45x with the W @ x.T
    order for 2-3 rows that this replaces). Its SkylakeX-family kernels are the other way
    round, so the CPU policy measures which layout to hold (`engine.layout`). Same products:
    with OpenBLAS's Prescott kernels the logits are bit-identical (tested), with others
    they agree to float32 rounding. An embedding lookup reads a column-major row as
    cheaply. Each matrix is copied and released in turn, so loading peaks at one extra one.
    """
    for module in product_modules(model):
        module.weight = mx.contiguous(module.weight.T).T
        mx.eval(module.weight)
    model.weight_layout = "column"


class QuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose affine matmul goes through `kernels.dispatch`.

    Why: on Metal, a verify pass of 2-16 rows is where MLX's quantized matmul re-reads each
    weight group per row; the dispatcher runs the small-batch kernel at the widths where
    `understudy doctor` saw it pass and win on this device, MLX's matmul everywhere else.
    """

    def __call__(self, x: mx.array) -> mx.array:
        if self.mode != "affine" or "biases" not in self:
            return super().__call__(x)
        y = dispatch.quantized_matmul(x, self["weight"], self["scales"], self["biases"],
                                      self.group_size, self.bits)
        return y + self["bias"] if "bias" in self else y


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        assert args.head_dim is not None and args.num_key_value_heads is not None
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.attention_scale
        self.window = args.layer_window(layer)
        self.rotates = args.layer_has_rope(layer)
        bias = bool(args.attention_bias)
        D = args.hidden_size
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if args.fused_projections:  # Phi-3: one product for q, k and v
            self.qkv_proj = Linear(D, q_out + 2 * kv_out, bias=bias)
        else:
            self.q_proj = Linear(D, q_out, bias=bias)
            self.k_proj = Linear(D, kv_out, bias=bias)
            self.v_proj = Linear(D, kv_out, bias=bias)
        self.o_proj = Linear(q_out, D, bias=False)
        self.rot = args.rotary_dims
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        base, scaling = args.layer_rope(layer)
        self._freqs = rope_frequencies(args, base, scaling)
        self._base = None if self._freqs is not None else base
        self._scale = args.rope_scale
        self._table = rope_table(self.rot, self._base, self._freqs, self._scale)

    def __call__(
        self, x: mx.array, mask: mx.array | str | None = None, cache: KVCache | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        """`positions` (L,) int32: each row's absolute position (a draft tree's nodes sit at
        committed length + depth); None means consecutive from the cache's length."""
        B, L, D = x.shape
        if "qkv_proj" in self:
            q_out = self.n_heads * self.head_dim
            q, k, v = mx.split(self.qkv_proj(x),
                               [q_out, q_out + self.n_kv_heads * self.head_dim], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(B, L, self.n_heads, self.head_dim)
        k = k.reshape(B, L, self.n_kv_heads, self.head_dim)
        v = v.reshape(B, L, self.n_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(0, 2, 1, 3)  # (B, heads, L, head_dim)
        k = k.transpose(0, 2, 1, 3)  # (B, kv_heads, L, head_dim)
        v = v.transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        if self.rotates:
            q, k = self._rope(q, offset, positions), self._rope(k, offset, positions)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self.window is not None:
            k, v, mask = slide_window(k, v, mask, L, positions, self.window,
                                      getattr(cache, "base", 0))
        out = attention(q, k, v, self.scale, mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, heads * head_dim)
        return self.o_proj(out)

    def _rope(self, x: mx.array, offset: int, positions: mx.array | None) -> mx.array:
        """RoPE over (B, heads, L, head_dim) at offset.., or at `positions` per row: on the
        CPU from a cos/sin table (`engine.models.rope`: MLX's CPU kernel works the angles
        out on every call); on a GPU the fused kernel, where a tree's rows go through it as
        a batch of one-row sequences with their own offsets."""
        if mx.default_device().type != mx.DeviceType.cpu:
            return self._fused_rope(x, offset, positions)
        if self.rot == self.head_dim:
            return self._table.apply(x, offset, positions)
        # partial rotary: the first `rot` dims turn, the rest pass as they are
        turned = self._table.apply(x[..., :self.rot], offset, positions)
        return mx.concatenate([turned, x[..., self.rot:]], axis=-1)

    def _fused_rope(self, x: mx.array, offset: int, positions: mx.array | None) -> mx.array:
        if self._scale != 1.0:
            x = mx.concatenate([x[..., :self.rot] * self._scale, x[..., self.rot:]], axis=-1)
        if positions is None:
            return mx.fast.rope(x, self.rot, traditional=False, base=self._base,
                                scale=1.0, offset=offset, freqs=self._freqs)
        rows = x.transpose(2, 1, 0, 3)  # (L, heads, B, head_dim): one row per "batch"
        rows = mx.fast.rope(rows, self.rot, traditional=False, base=self._base,
                            scale=1.0, offset=positions, freqs=self._freqs)
        return rows.transpose(2, 1, 0, 3)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        D, H, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        if args.fused_projections:  # Phi-3: gate and up in one product, gate first
            self.gate_up_proj = Linear(D, 2 * H, bias=bias)
        else:
            self.gate_proj = Linear(D, H, bias=bias)
            self.up_proj = Linear(D, H, bias=bias)
        self.down_proj = Linear(H, D, bias=bias)
        self._gelu = args.is_gemma

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(gated(gate, up, self._gelu))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        D, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer)
        if args.layer_is_sparse(layer):
            assert (args.moe_intermediate_size and args.num_experts
                    and args.num_experts_per_tok)
            self.mlp = SparseMoE(D, args.moe_intermediate_size, args.num_experts,
                                 args.num_experts_per_tok, args.norm_topk_prob)
        else:
            self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(D, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(D, eps=eps)
        if args.is_gemma:  # sandwich norms: after attention, and before and after the MLP
            self.pre_feedforward_layernorm = nn.RMSNorm(D, eps=eps)
            self.post_feedforward_layernorm = nn.RMSNorm(D, eps=eps)

    def __call__(
        self, x: mx.array, mask: mx.array | str | None = None, cache: KVCache | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        r = self.self_attn(self.input_layernorm(x), mask, cache, positions)
        if "pre_feedforward_layernorm" in self:
            h = x + self.post_attention_layernorm(r)
            return h + self.post_feedforward_layernorm(
                self.mlp(self.pre_feedforward_layernorm(h)))
        h = x + r
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # Gemma scales its embeddings by sqrt(hidden_size), rounded to bfloat16 as its
        # weights hold it (mlx-lm's choice too); the tied output layer reads them unscaled
        self._embed_scale = (mx.array(args.hidden_size ** 0.5, mx.bfloat16).item()
                             if args.is_gemma else None)

    def __call__(
        self,
        inputs: mx.array,
        mask: mx.array | str | None = None,
        cache: list[KVCache] | None = None,
        n_layers: int | None = None,
        capture: Capture | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        """`capture`: layer index -> filled with that layer's input hidden state (B, L, D).
        `positions`: per-row RoPE positions (see `Attention`), with an explicit `mask`."""
        B, L = inputs.shape
        h = self.embed_tokens(inputs)  # (B, L, D)
        if self._embed_scale is not None:
            h = h * mx.array(self._embed_scale, h.dtype)
        if mask is None and L > 1:
            mask = "causal"
        layers = self.layers if n_layers is None else self.layers[:n_layers]
        for i, layer in enumerate(layers):
            if capture is not None and i in capture:
                capture[i] = h
            h = layer(h, mask, cache[i] if cache is not None else None, positions)
        return self.norm(h)


class Model(nn.Module):
    """Token ids (B, L) -> logits (B, L, vocab)."""

    # how the CPU policy laid its matrices out (`engine.layout`): "column"
    # (`store_column_major`) or "row"; None: as the checkpoint stores them. A cost key's part
    weight_layout: str | None = None

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # a plain object attribute (not a module child): taps are run-time state, no weights
        self.feature_taps = FeatureTaps()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint tensors as this model computes with them: Gemma's norms multiply by
        1 + weight, so the 1 is added here once (in the weight's dtype, as mlx-lm does at
        every call) and every norm is a plain RMSNorm."""
        if not self.args.is_gemma:
            return weights
        return {k: (1.0 + v if k.endswith("norm.weight") else v) for k, v in weights.items()}

    @property
    def column_major(self) -> bool:
        return self.weight_layout == "column"

    @property
    def n_layers(self) -> int:
        return self.args.num_hidden_layers

    def __call__(
        self,
        inputs: mx.array,
        mask: mx.array | str | None = None,
        cache: list[KVCache] | None = None,
        n_layers: int | None = None,
        capture: Capture | None = None,
        positions: mx.array | None = None,
        last_only: bool = False,
    ) -> mx.array:
        """Run the first `n_layers` layers (all by default), then the final norm and head.

        `last_only`: logits for the last row alone, (B, 1, V), where a caller reads no other
        (a prompt's chunk, a drafter catching its cache up): the head over 512 rows was 5-13%
        of reading a prompt. A pass watched by a tap that keeps logits (the online buffer's)
        still gets every row's; the head's tap keeps hidden states only.

        `n_layers` is how the layer-skip drafter reuses the target's own early layers.
        `capture` (layer index -> None) is filled with those layers' input hidden states: the
        trained head's features. A full pass through caches that a `FeatureTap` watches
        records them there too (the verify pass's side output; no tap, no extra work).
        A draft tree's pass gives `mask` (ancestors only) and `positions` (engine/tree.py).
        """
        taps: list[FeatureTap] = []
        if capture is None and n_layers is None and cache and self.feature_taps:
            taps = self.feature_taps.find_all(cache[0])
            if taps:
                capture = dict.fromkeys(sorted({i for t in taps for i in t.layers}))
                start = cache[0].offset
        h = self.model(inputs, mask, cache, n_layers, capture, positions)
        if last_only and not any(t.needs_logits for t in taps):
            h = h[:, -1:]
        head = self.lm_head if "lm_head" in self else self.model.embed_tokens.as_linear
        logits = head(h)
        for tap in taps:
            assert capture is not None
            tap.record(start, capture, logits)
        return logits
