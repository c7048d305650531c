"""A fresh head starts from the target's own weights: its block is the target's last layer,
and `fc` passes the highest feature layer through.

The check that matters is what the head computes: with the parts that start random set to
zero, the head's block must be that target layer applied to the top feature, for every
architecture the loader knows (biases, q/k norms) and for a quantized target.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from engine.drafters.head import default_layers
from engine.loading import LoadedModel, load_model
from engine.training.head_init import (
    OTHER_FEATURES_SCALE,
    dense_weight,
    init_head,
    seed_layer,
)
from tests.fixtures.tiny_models import write_tiny_model


def _target(tmp_path: Path, model_type: str) -> LoadedModel:
    path = write_tiny_model(tmp_path / model_type, model_type, num_hidden_layers=4, seed=3)
    return load_model(str(path))


def _hot(target: LoadedModel, n: int = 40) -> np.ndarray:
    V = target.model.args.vocab_size
    return np.sort(np.random.default_rng(0).choice(V, n, replace=False))


def _zero_random_parts(head) -> None:
    """Zero what starts random: the embedding's half of q/k/v, fc's other features and
    the small noise on its pass-through."""
    D = head.config.hidden_size
    attn = head.midlayer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(attn, name).weight
        getattr(attn, name).weight = mx.concatenate([mx.zeros_like(w[:, :D]), w[:, D:]], 1)
    top = int(np.argmax(head.config.aux_layers))
    fc = mx.zeros_like(head.fc.weight)
    fc[:, top * D : (top + 1) * D] = mx.eye(D)
    head.fc.weight = fc


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_the_heads_block_computes_the_target_layer_on_the_top_feature(
        tmp_path: Path, model_type: str) -> None:
    target = _target(tmp_path, model_type)
    model = target.model
    head = init_head(model, _hot(target), None, seed=0)
    layers = head.config.aux_layers
    assert layers == default_layers(4) and seed_layer(4) == 3
    _zero_random_parts(head)
    D = head.config.hidden_size
    rng = np.random.default_rng(1)
    top = mx.array(rng.normal(size=(1, 6, D)).astype(np.float32))
    parts = [mx.array(rng.normal(size=(1, 6, D)).astype(np.float32)) for _ in layers]
    parts[int(np.argmax(layers))] = top
    features = mx.concatenate(parts, axis=-1)
    ids = mx.array([[5, 9, 2, 7, 1, 3]])
    got = head(head.fuse(features), ids)
    want = model.model.layers[3](top, mask="causal")
    assert mx.allclose(got, want, atol=1e-4), float(mx.abs(got - want).max())
    # negative control: another layer of the same target computes something else
    other = model.model.layers[2](top, mask="causal")
    assert not mx.allclose(got, other, atol=1e-2)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_a_target_with_biases_or_qk_norms_seeds_the_weights_the_head_has(
        tmp_path: Path, model_type: str) -> None:
    """EAGLE-3's block has no q/k/v bias and no q/k norm (its heads for Qwen models are
    llama blocks), so those are left out and every weight the block has is seeded."""
    target = _target(tmp_path, model_type)
    layer = target.model.model.layers[3]
    head = init_head(target.model, _hot(target), None, seed=0)
    D = head.config.hidden_size
    names = [n for n, _ in tree_flatten(head.midlayer.parameters())]
    assert not any(n.endswith(".bias") or "q_norm" in n for n in names)
    block = head.midlayer
    for name in ("q_proj", "k_proj", "v_proj"):
        assert mx.array_equal(getattr(block.self_attn, name).weight[:, D:],
                              getattr(layer.self_attn, name).weight)
    assert mx.array_equal(block.self_attn.o_proj.weight, layer.self_attn.o_proj.weight)
    assert mx.array_equal(block.mlp.down_proj.weight, layer.mlp.down_proj.weight)
    assert mx.array_equal(block.hidden_norm.weight, layer.input_layernorm.weight)


def test_the_random_parts_start_small_beside_the_pass_through(tmp_path: Path) -> None:
    target = _target(tmp_path, "llama")
    head = init_head(target.model, _hot(target), (0, 1, 3), seed=0)
    D = head.config.hidden_size
    fc = np.array(head.fc.weight)
    top = fc[:, 2 * D :]
    assert np.allclose(np.diag(top), 1.0, atol=OTHER_FEATURES_SCALE)
    bound = OTHER_FEATURES_SCALE / np.sqrt(3 * D)  # a tenth of nn.Linear's uniform init
    assert np.abs(fc[:, : 2 * D]).max() <= bound + 1e-6
    assert np.abs(fc[:, : 2 * D]).max() > 0.5 * bound  # still random, not zero
    emb_half = np.array(head.midlayer.self_attn.q_proj.weight[:, :D])
    assert np.abs(emb_half).max() > 0  # the new token's half keeps its random start
    assert np.array_equal(np.array(head.midlayer.input_layernorm.weight), np.ones(D))
    lm = dense_weight(target.model.lm_head) if "lm_head" in target.model \
        else target.model.model.embed_tokens.weight
    assert np.array_equal(np.array(head.lm_head.weight),
                          np.array(lm)[head.hot_ids])
    # the same seed gives the same head; another seed another random part
    again = init_head(target.model, _hot(target), (0, 1, 3), seed=0)
    other = init_head(target.model, _hot(target), (0, 1, 3), seed=1)
    same = [mx.array_equal(a, b) for (_, a), (_, b) in
            zip(tree_flatten(head.parameters()), tree_flatten(again.parameters()), strict=True)]
    assert all(same)
    assert not mx.array_equal(head.fc.weight, other.fc.weight)


def test_a_quantized_target_layer_seeds_its_dequantized_weights(tmp_path: Path) -> None:
    target = _target(tmp_path, "llama")
    layer = target.model.model.layers[3]
    dense = np.array(layer.mlp.up_proj.weight)
    nn.quantize(layer, group_size=32, bits=8)
    assert "scales" in layer.mlp.up_proj
    got = np.array(dense_weight(layer.mlp.up_proj))
    assert np.abs(got - dense).max() < 0.02 * np.abs(dense).max()
    head = init_head(target.model, _hot(target), None, seed=0)
    assert np.array_equal(np.array(head.midlayer.mlp.up_proj.weight), got)
    D = head.config.hidden_size
    assert np.array_equal(np.array(head.midlayer.self_attn.k_proj.weight[:, D:]),
                          np.array(dense_weight(layer.self_attn.k_proj)))


def test_a_head_for_a_longrope_target_turns_with_plain_rope(tmp_path: Path) -> None:
    """Phi-4-mini's LongRoPE factors are for three quarters of a head; the head's llama
    block turns whole heads, so it takes plain RoPE at the target's base (with the
    target's scaling it could not even be built), and it drafts."""
    from tests.engine.test_models import PHI4_MINI_ROPE

    path = write_tiny_model(tmp_path / "phi", "phi3", num_hidden_layers=4, seed=3,
                            config_overrides=PHI4_MINI_ROPE)
    target = load_model(str(path))
    head = init_head(target.model, _hot(target), None, seed=0)
    assert head.config.rope_scaling is None
    assert head.config.rope_theta == target.model.args.rope_theta
    D = head.config.hidden_size
    features = mx.zeros((1, 3, D * len(head.config.aux_layers)))
    out = head(head.fuse(features), mx.array([[5, 9, 2]]))
    assert out.shape == (1, 3, D)
