"""The language model inside a vision-language checkpoint: Gemma 3 4B, 12B and 27B.

Gemma 3's larger sizes ship as one image-and-text model (`model_type` "gemma3"): the
text decoder's settings sit under `text_config`, its tensors under a prefix beside a vision
tower and a projector. Understudy chats in text, so it reads the decoder alone, as the
`gemma3_text` model it is, and leaves the image parts unread: the 270M and 1B text-only
sizes share its tokenizer (its embedding is padded to a few more rows), so they draft for
it.

Two tensor layouts are in use: the original releases' `language_model.model.*` (and
mlx-community's conversions of them), and `model.language_model.*` with a top-level
`lm_head`, which transformers writes since it moved the parts of its VLMs (4.52).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from engine.errors import ModelFormatError
from engine.weights import TensorInfo

WRAPPER_TYPES = ("gemma3",)
# (stored prefix, the text model's prefix): the first that matches renames a tensor
TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
IMAGE_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                  "model.multi_modal_projector.")
# what Gemma 3's text config means where it leaves a field out (transformers'
# Gemma3TextConfig defaults, which mlx-lm follows too)
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "query_pre_attn_scalar": 256, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "sliding_window_pattern": 6, "rms_norm_eps": 1e-6, "max_position_embeddings": 131_072,
    "hidden_activation": "gelu_pytorch_tanh",
}
# what a wrapper's top level says for the text model too (tying decided by the loader
# where neither level says: tied when there is no lm_head)
TOP_LEVEL_KEYS = ("quantization", "quantization_config", "bos_token_id", "eos_token_id")


def is_wrapped(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") in WRAPPER_TYPES


def text_model(config: Mapping[str, Any], tensors: Mapping[str, TensorInfo]
               ) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """config.json and the tensors as the text model reads them: for a wrapper, its
    `text_config` with Gemma 3's defaults filled in and the top level's quantization and
    special tokens, and its decoder's tensors under the names the model expects (each
    keeps its stored name in `TensorInfo.name`, to read it by), the image parts left out.
    Any other model's as they are."""
    if not is_wrapped(config):
        return dict(config), dict(tensors)
    inner = config.get("text_config")
    if not isinstance(inner, dict):
        raise ModelFormatError(
            f"config.json: model_type {config.get('model_type')!r} needs a text_config "
            f"object, got {inner!r}")
    if inner.get("model_type", "gemma3_text") != "gemma3_text":
        raise ModelFormatError(
            f"config.json: text_config.model_type is {inner['model_type']!r}; a gemma3 "
            "checkpoint's text model is a 'gemma3_text'")
    renamed = {_renamed(stored): replace(info, name=stored) for stored, info in tensors.items()
               if not stored.startswith(IMAGE_PREFIXES)}
    out = {**GEMMA3_TEXT_DEFAULTS, **inner, "model_type": "gemma3_text"}
    for key in (*TOP_LEVEL_KEYS, "vocab_size", "tie_word_embeddings"):
        if key in config and key not in inner:
            out[key] = config[key]
    for key in ("quantization", "quantization_config"):
        block = out.get(key)
        if isinstance(block, dict):  # per-module entries name modules by their stored paths
            out[key] = {_renamed(k): v for k, v in block.items()
                        if not k.startswith(IMAGE_PREFIXES)}
    if "vocab_size" not in out:
        # the original releases leave it to a default; the embedding says it
        embed = renamed.get("model.embed_tokens.weight")
        if embed is not None and embed.shape:
            out["vocab_size"] = embed.shape[0]
    return out, renamed


def _renamed(stored: str) -> str:
    """A wrapper's tensor (or module) path as the text model names it."""
    return next((new + stored[len(old):] for old, new in TEXT_PREFIXES
                 if stored.startswith(old)), stored)
