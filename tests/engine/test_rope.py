"""The CPU backend's table RoPE against a float64 reference and MLX's fused kernel."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from engine.models.decoder import Attention, ModelArgs, rope_frequencies
from engine.models.rope import MIN_ROWS, RopeTable, rope_table


def reference(x: np.ndarray, positions: np.ndarray, inverse: np.ndarray) -> np.ndarray:
    """HF-style RoPE in float64: pairs (i, i + dims/2) rotated by position * inverse[i]."""
    half = x.shape[-1] // 2
    angles = positions[:, None].astype(np.float64) * inverse[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    a, b = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _x(length: int, dims: int = 64, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((1, 3, length, dims),
                                                                dtype=np.float32))


@pytest.mark.parametrize("offset", [0, 7, 5000])
def test_table_matches_a_float64_reference(offset: int) -> None:
    base, dims = 100000.0, 64
    table = RopeTable(dims, tuple(base ** (-i / dims) for i in range(0, dims, 2)))
    x = _x(9)
    got = np.array(table.apply(x, offset))
    inverse = base ** (-np.arange(0, dims, 2) / dims)
    want = reference(np.array(x), np.arange(offset, offset + 9), inverse)
    assert np.abs(got - want).max() < 2e-5


def test_positions_rotate_each_row_to_its_own_position() -> None:
    table = rope_table(64, 10000.0, None)
    x = _x(5, seed=1)
    positions = [40, 41, 41, 42, 41]  # a tree: the root's row, then nodes at their depths
    got = np.array(table.apply(x, 40, mx.array(positions, dtype=mx.int32)))
    for row, p in enumerate(positions):
        alone = np.array(table.apply(x[:, :, row:row + 1], p))
        assert np.array_equal(got[:, :, row:row + 1], alone)
    # negative control: the consecutive positions 40..44 give other rows from row 2 on
    consecutive = np.array(table.apply(x, 40))
    assert np.abs(consecutive[:, :, 2:] - got[:, :, 2:]).max() > 1e-2


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                            "original_max_position_embeddings": 256}])
def test_table_agrees_with_the_fused_kernel(scaling: dict | None) -> None:
    args = ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=1,
                     intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                     rms_norm_eps=1e-5, vocab_size=32, rope_theta=50000.0,
                     rope_scaling=scaling)
    freqs = rope_frequencies(args)
    base = None if freqs is not None else args.rope_theta
    x = _x(6)
    for offset in (0, 300):
        got = rope_table(64, base, freqs).apply(x, offset)
        fused = mx.fast.rope(x, 64, traditional=False, base=base, scale=1.0, offset=offset,
                             freqs=freqs)
        assert mx.abs(got - fused).max().item() < 1e-3 * max(1, offset / 100)
        interleaved = mx.fast.rope(x, 64, traditional=True, base=base, scale=1.0,
                                   offset=offset, freqs=freqs)
        assert mx.abs(got - interleaved).max().item() > 0.1  # GGUF's order is not this one


def test_cpu_attention_uses_the_shared_table() -> None:
    args = ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                     intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                     rms_norm_eps=1e-5, vocab_size=32, rope_theta=10000.0)
    first, second = Attention(args), Attention(args)
    assert first._table is second._table is rope_table(32, 10000.0, None)
    assert mx.default_device().type == mx.DeviceType.cpu
    x = _x(3, dims=32)
    assert mx.array_equal(first._rope(x, 10, None), first._table.apply(x, 10)).item()


def test_the_table_grows_on_demand() -> None:
    table = RopeTable(8, (1.0, 0.1, 0.01, 0.001))
    assert table.rows == 0
    table.apply(_x(2, dims=8), 0)
    assert table.rows == MIN_ROWS
    far = MIN_ROWS + 10
    out = np.array(table.apply(_x(1, dims=8), far))
    assert table.rows == 2 * MIN_ROWS
    want = reference(np.array(_x(1, dims=8)), np.array([far]),
                     np.array([1.0, 0.1, 0.01, 0.001]))
    assert np.abs(out - want).max() < 1e-4 * math.log10(far)


def test_bad_dimensions_are_refused() -> None:
    with pytest.raises(ValueError, match="needs 2 frequencies"):
        RopeTable(4, (1.0,))


@pytest.mark.slow
def test_the_demo_gives_the_fused_kernels_logits_through_the_table(
        demo_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 700-token prompt read in chunks, then a 5-row draft tree's pass: every row's
    logits are the fused kernel's to float32 noise, with the same argmax."""
    from pathlib import Path

    import engine.models.rope as rope_module
    from engine.cache import make_caches
    from engine.loading import load_model
    from engine.steps import prefill
    from engine.tree import DraftTree
    from engine.tree_verify import tree_pass

    loaded = load_model(str(demo_model_dir))
    ids = loaded.tokenizer.encode(Path(rope_module.__file__).read_text() * 4)[:700]
    assert len(ids) == 700
    tree = DraftTree((ids[-5], ids[-4], ids[-3], 11), (-1, 0, 1, 0))

    def run() -> tuple[np.ndarray, np.ndarray]:
        caches = make_caches(loaded.model.n_layers)
        prompt = np.array(list(prefill(loaded.model, ids[:-6], caches))[-1][1])
        return prompt, np.array(tree_pass(loaded.model, caches, ids[-6], tree))

    table = run()
    monkeypatch.setattr(Attention, "_rope", Attention._fused_rope)
    fused = run()
    for got, want in zip(table, fused, strict=True):
        assert np.abs(got - want).max() < 1e-2
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
    # negative control: a tree rotated to consecutive positions gives other logits
    monkeypatch.setattr(Attention, "_rope", lambda self, x, offset, positions:
                        self._table.apply(x, offset, None))
    assert np.abs(run()[1] - fused[1]).max() > 0.1
