"""Kernels against their references on the GPU: runs where Metal exists, skipped elsewhere.

The same cases as the reference tests (the property settings through the engine, the demo
model's logits, every matmul variant, the KV compaction's random and largest trees), with
the dispatcher switched on. Tokens must match
exactly except where a row's two best perturbed scores tie within float rounding (the
kernel sums the log-sum-exp in another order); probabilities to float tolerance.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import SamplingParams, coupled_rows, gumbel_noise, log_probs
from kernels import dispatch, selftest
from tests.kernels.oracle import oracle
from tests.kernels.test_kv_compact_reference import largest_tree_case, random_tree_case
from tests.kernels.test_verify_sampler_reference import DEMO_SETTINGS, settings_strategy

pytestmark = pytest.mark.skipif(not mx.metal.is_available(),
                                reason="no Metal here: kernels cannot run (references tested)")


@pytest.fixture(autouse=True)
def kernels_on():
    dispatch.configure(sampler_widths=range(1, 17), qmm_widths=range(2, 17),
                       kv_compact_widths=range(1, 17))
    yield
    dispatch.configure()


def near_tie(logits: mx.array, params: SamplingParams, histories, positions, row: int) -> bool:
    logp = log_probs(logits, params, histories)
    z = np.array(logp + gumbel_noise(params.seed, positions, logits.shape[-1]))[row]
    top = np.sort(z[np.isfinite(z)])[-2:]
    return len(top) == 2 and abs(top[1] - top[0]) <= 1e-4 * max(1.0, abs(top[1]))


def assert_kernel_agrees(logits: mx.array, params: SamplingParams, histories, t0: int) -> None:
    n_rows, vocab = logits.shape
    positions = list(range(t0, t0 + n_rows))
    want = oracle(logits, params, histories, positions, [])
    draft = want.tokens[:-1]
    rows = coupled_rows(logits, params, histories, positions, draft)
    got = rows.tokens.tolist()
    for row, (a, b) in enumerate(zip(want.tokens, got, strict=True)):
        assert a == b or near_tie(logits, params, histories, positions, row), (row, a, b)
    if got == want.tokens:
        assert int(rows.n_accepted.item()) == n_rows - 1
        np.testing.assert_allclose(np.array(rows.p_token), want.p_token, rtol=1e-3, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(params=settings_strategy, t0=st.integers(0, 2**32 - 20), n_rows=st.integers(1, 16),
       data_seed=st.integers(0, 2**31))
def test_kernel_equals_reference_over_settings(params, t0, n_rows, data_seed) -> None:
    rng = np.random.default_rng(data_seed)
    logits = mx.array((rng.standard_normal((n_rows, 1024)) * 3).astype(np.float32))
    histories = [rng.integers(0, 1024, 20).tolist() for _ in range(n_rows)]
    assert_kernel_agrees(logits, params, histories, t0)


@pytest.mark.slow
def test_kernel_equals_reference_on_the_demo_model(demo_model_dir) -> None:
    from engine.loading import load_model

    loaded = load_model(demo_model_dir)
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    logits = loaded.model(mx.array([ids]))[0, -8:]
    histories = [ids[: len(ids) - 8 + i] for i in range(8)]
    for params in DEMO_SETTINGS:
        assert_kernel_agrees(logits, params, histories, len(ids) - 8)


def test_selftest_sampler_cases_pass() -> None:
    passed, reason, _ = selftest.check_sampler()
    assert passed, reason


def test_selftest_qmm_cases_pass() -> None:
    passed, reason = selftest.check_qmm()
    assert passed, reason


def test_selftest_kv_compact_cases_pass() -> None:
    passed, reason = selftest.check_kv_compact()
    assert passed, reason


@pytest.mark.parametrize("seed", range(24))
def test_kernel_compaction_equals_the_old_gather(seed: int) -> None:
    """The cache's compaction through the kernel, bit for bit the old MLX gather's buffer."""
    random_tree_case(seed)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kernel_compaction_of_the_largest_tree(dtype) -> None:
    largest_tree_case(dtype)
