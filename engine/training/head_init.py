"""A fresh head that starts from the target's own weights rather than from noise.

Why: on a desktop CPU the data phase of an evening makes only ~130k reply tokens, so the
head's accuracy is bound by how much it learns per token. The head starts as a shortcut
to the target's output: `fc` passes the highest feature layer through, the block is the
target's last layer (whose output the final norm and `lm_head` read, as the head's do),
and the norm and output layer are the target's own. On the demo's 128k-token set, after
200 optimizer steps, held-out top-1 at draft steps 1/2/3 was 30.6/25.7/22.6% against
26.5/20.4/16.2% for a random block; seeding from the layer that reads the highest feature
layer instead gave 28.5/23.4/19.7% (docs/ARCHITECTURE.md, "Fit").

The new token's half of q/k/v (the embedding) has no counterpart in the target layer and
keeps its random start; the other feature layers enter `fc` at a tenth of theirs, so the
pass-through dominates and the head still sees them from the first step.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from engine.drafters.head import HeadConfig, HeadModel
from engine.weights import QuantSpec, dequantize_float32

OTHER_FEATURES_SCALE = 0.1  # of the default init, for fc's low and middle feature layers


def dense_weight(layer: nn.Module) -> mx.array:
    """A linear or embedding layer's weight as floats (a quantized one dequantized the
    way loading does on the CPU)."""
    if "scales" in layer:
        spec = QuantSpec(layer.group_size, layer.bits, getattr(layer, "mode", "affine"))
        return dequantize_float32(layer["weight"], layer["scales"], layer.get("biases"), spec)
    return layer["weight"]


def seed_layer(n_layers: int) -> int:
    """The target layer the head's block starts as: the last, whose output the final norm
    and the output layer read, as the head's output is read by copies of them."""
    return n_layers - 1


def init_head(model, hot: np.ndarray, layers: Sequence[int] | None, seed: int) -> HeadModel:
    """A fresh head for a decoder `model` over the hot tokens `hot`, seeded from the target
    (see the module docstring); `seed` fixes the parts that start random."""
    config = HeadConfig.for_target(model.args, len(hot), layers)
    mx.random.seed(seed)
    head = HeadModel(config, hot, model.model.embed_tokens)
    out = model.lm_head if "lm_head" in model else model.model.embed_tokens
    head.lm_head.weight = dense_weight(out)[mx.array(hot.astype(np.int32))]
    head.norm.weight = mx.array(model.model.norm.weight)
    _seed_block(head, model.model.layers[seed_layer(len(model.model.layers))])
    _seed_fc(head)
    mx.eval(head.parameters())
    return head


def _seed_block(head: HeadModel, layer: nn.Module) -> None:
    """The head's block takes the target layer's parameters under the same names; q/k/v
    read [embedding ; hidden], so the layer's weights become their hidden half, and the
    hidden half's norm is the layer's input norm. The embedding's norm stays at ones."""
    D = head.config.hidden_size
    source = _dense_parameters(layer)
    rename = {"hidden_norm.weight": "input_layernorm.weight", "input_layernorm.weight": None}
    updates: list[tuple[str, mx.array]] = []
    for name, value in tree_flatten(head.midlayer.parameters()):
        own = rename.get(name, name)
        w = source.get(own) if own else None
        if w is None:
            continue
        if value.ndim == 2 and value.shape[1] == 2 * D and w.shape == (value.shape[0], D):
            w = mx.concatenate([value[:, :D], w], axis=1)
        if w.shape == value.shape:
            updates.append((name, w.astype(value.dtype)))
    head.midlayer.load_weights(updates, strict=False)


def _dense_parameters(layer: nn.Module) -> dict[str, mx.array]:
    """A layer's parameters by name, quantized weights dequantized."""
    params = dict(tree_flatten(layer.parameters()))
    for name, module in layer.named_modules():
        if "scales" in module:
            params[f"{name}.weight"] = dense_weight(module)
    return params


def _seed_fc(head: HeadModel) -> None:
    """fc passes the highest feature layer through; the others enter at a tenth of the
    default init."""
    D = head.config.hidden_size
    n = len(head.config.aux_layers)
    high = int(np.argmax(head.config.aux_layers)) * D
    w = head.fc.weight * OTHER_FEATURES_SCALE
    head.fc.weight = w + mx.concatenate(
        [mx.zeros((D, high)), mx.eye(D), mx.zeros((D, (n - 1) * D - high))], axis=1)
