"""The CPU backend's host sampler: a row's sample whatever the pass, and its scratch arrays."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from kernels import verify_sampler
from kernels.noise import SCRATCH_KEEP_BYTES, keys_array, positions_u32, scratch
from kernels.verify_sampler import SamplerSpec


def _rows(n_rows: int, vocab: int = 49_152, seed: int = 0) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal((n_rows, vocab)) * 3).astype(np.float32))


def test_a_row_samples_alike_alone_and_in_a_verify_pass() -> None:
    """Plain decoding samples one row, a verify pass 17: the same (seed, position, scores)
    must give the same token and probability, bit for bit, whatever the pass width."""
    scores = _rows(17)
    spec, keys = SamplerSpec(inv_temperature=1 / 0.8), keys_array(42)
    positions = positions_u32(range(500, 517))
    none = mx.array([], mx.int32)
    wide = verify_sampler.host_reference(scores, keys, positions, none, spec)
    for i in range(17):
        one = verify_sampler.host_reference(scores[i:i + 1], keys, positions[i:i + 1], none,
                                            spec)
        assert one.tokens.item() == wide.tokens[i].item()
        assert one.p_token.item() == wide.p_token[i].item()


def test_the_cpu_backend_samples_with_noise_on_the_host() -> None:
    spec = SamplerSpec(inv_temperature=1.25)
    assert verify_sampler.on_host(spec)
    assert not verify_sampler.on_host(SamplerSpec(greedy=True))  # an argmax stays in MLX
    scores, keys, positions = _rows(3, 1000), keys_array(1), positions_u32([7, 8, 9])
    got = verify_sampler.sample(scores, keys, positions, [5, 6], spec)
    want = verify_sampler.host_reference(scores, keys, positions, mx.array([5, 6]), spec)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.p_token.tolist() == want.p_token.tolist()  # the same function's numbers


def test_scratch_is_kept_per_thread_and_grows() -> None:
    small = scratch("test.a", (2, 8), np.float32)
    again = scratch("test.a", (4, 4), np.float32)
    assert np.shares_memory(small, again)  # the same buffer, another shape
    bigger = scratch("test.a", (64, 64), np.float32)
    assert bigger.shape == (64, 64) and bigger.dtype == np.float32
    assert not np.shares_memory(scratch("test.b", (2, 8), np.float32), bigger)
    other: list[np.ndarray] = []
    thread = threading.Thread(target=lambda: other.append(scratch("test.a", (64, 64),
                                                                  np.float32)))
    thread.start()
    thread.join()
    assert not np.shares_memory(other[0], scratch("test.a", (64, 64), np.float32))
    # past the cap a buffer is not kept: a long-lived thread holds at most the cap a name
    huge = (SCRATCH_KEEP_BYTES // 4 + 1,)
    assert not np.shares_memory(scratch("test.c", huge, np.float32),
                                scratch("test.c", huge, np.float32))
