"""The fused verify sampler's reference equals today's sampler, token for token.

Property tests over seeds, positions, temperatures, top-k/p, min-p and the repetition
penalty on random logits, then every setting on the demo model's real logits. Drafts are
built from the oracle's own tokens with a miss at a chosen place, so every accepted-prefix
length is exercised. Bad input (shapes the kernel was not written for) is shown to go to
the reference even when the kernel is switched on.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import SamplingParams, coupled_rows, log_probs
from kernels import verify_sampler
from kernels.noise import keys_array, positions_u32
from kernels.verify_sampler import LOG_PROBS, SamplerSpec
from tests.kernels.oracle import oracle

# How far the host sampler's probabilities may stand from MLX's: its log-sum-exp is
# numpy's pairwise sum, MLX's a running one. Over 4 x 49,152 normal scores (sd 3) MLX's
# was 4.6e-5 from the float64 value, numpy's 4.6e-7; the demo's logits moved p by up to
# 8.4e-5 relative
HOST_RTOL = 2e-4


def read(rows: verify_sampler.SampledRows) -> tuple[list[int], int, np.ndarray, np.ndarray]:
    mx.eval(rows.tokens, rows.n_accepted, rows.p_token, rows.p_draft)
    return (rows.tokens.tolist(), int(rows.n_accepted.item()), np.array(rows.p_token),
            np.array(rows.p_draft))


def drafts_missing_at(tokens: list[int], miss: int, vocab: int) -> list[int]:
    """K = len(tokens) - 1 drafts equal to the tokens except at `miss` (>= K: none)."""
    draft = list(tokens[:-1])
    if miss < len(draft):
        draft[miss] = (draft[miss] + 1) % vocab
    return draft


def assert_same(logits: mx.array, params: SamplingParams, histories, t0: int,
                miss: int) -> None:
    n_rows, vocab = logits.shape
    positions = list(range(t0, t0 + n_rows))
    first = oracle(logits, params, histories, positions, [])
    draft = drafts_missing_at(first.tokens, miss, vocab)
    want = oracle(logits, params, histories, positions, draft)
    tokens, n, p_token, p_draft = read(coupled_rows(logits, params, histories, positions, draft))
    assert tokens == want.tokens
    assert n == want.n_accepted == min(miss, len(draft))
    if params.greedy:
        np.testing.assert_array_equal(p_token, want.p_token.astype(np.float32))
        np.testing.assert_array_equal(p_draft, want.p_draft)
    else:  # sampled on the host: see HOST_RTOL
        np.testing.assert_allclose(p_token, want.p_token.astype(np.float32), rtol=HOST_RTOL,
                                   atol=1e-12)
        np.testing.assert_allclose(p_draft, want.p_draft, rtol=HOST_RTOL, atol=1e-12)


settings_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.6]),
    top_k=st.sampled_from([0, 1, 5, 40]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    seed=st.integers(0, 2**64 - 1),
)


@settings(max_examples=60, deadline=None)
@given(params=settings_strategy, t0=st.integers(0, 2**32 - 20), n_rows=st.integers(1, 9),
       miss=st.integers(0, 9), data_seed=st.integers(0, 2**31))
def test_reference_equals_todays_sampler(params: SamplingParams, t0: int, n_rows: int,
                                         miss: int, data_seed: int) -> None:
    rng = np.random.default_rng(data_seed)
    logits = mx.array((rng.standard_normal((n_rows, 96)) * 3).astype(np.float32))
    histories = [rng.integers(0, 96, 20).tolist() for _ in range(n_rows)]
    assert_same(logits, params, histories, t0, miss)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), t0=st.integers(0, 2**32 - 20),
       temperature=st.sampled_from([0.5, 1.0, 1.4]), data_seed=st.integers(0, 2**31))
def test_log_prob_rows_sample_as_sample_coupled_did(seed: int, t0: int, temperature: float,
                                                    data_seed: int) -> None:
    """`LOG_PROBS` mode (scores are log-probabilities) is `sample_coupled`'s contract."""
    rng = np.random.default_rng(data_seed)
    logits = mx.array(rng.standard_normal((5, 300)).astype(np.float32))
    params = SamplingParams(temperature=temperature, seed=seed)
    logp = log_probs(logits, params)
    positions = list(range(t0, t0 + 5))
    want = oracle(logits, params, None, positions, [])
    draft = drafts_missing_at(want.tokens, 2, 300)
    tokens, n, p_token, p_draft = read(verify_sampler.reference(
        logp, keys_array(seed), positions_u32(positions), mx.array(draft), LOG_PROBS))
    assert (tokens, n) == (want.tokens, 2)
    np.testing.assert_array_equal(p_token, want.p_token.astype(np.float32))


@settings(max_examples=40, deadline=None)
@given(params=settings_strategy, t0=st.integers(0, 2**32 - 20), n_rows=st.integers(1, 9),
       miss=st.integers(0, 9), data_seed=st.integers(0, 2**31),
       normalize=st.booleans())
def test_the_host_sampler_equals_the_reference(params: SamplingParams, t0: int, n_rows: int,
                                               miss: int, data_seed: int,
                                               normalize: bool) -> None:
    """What the CPU backend runs (`host_reference`) against the MLX reference it stands
    in for: the same tokens and prefix, probabilities to float32 rounding."""
    rng = np.random.default_rng(data_seed)
    vocab = 1000
    scores = mx.array((rng.standard_normal((n_rows, vocab)) * 3).astype(np.float32))
    if not normalize:
        scores = scores - mx.logsumexp(scores, axis=-1, keepdims=True)
    spec = SamplerSpec(normalize=normalize, inv_temperature=1.0 / max(params.temperature, 0.1))
    keys, positions = keys_array(params.seed), positions_u32(range(t0, t0 + n_rows))
    first = read(verify_sampler.reference(scores, keys, positions, mx.array([], mx.int32), spec))
    # a draft with a miss at `miss`, and an id past the vocabulary (probability 0)
    draft = drafts_missing_at(first[0], miss, vocab + 1)
    want = read(verify_sampler.reference(scores, keys, positions, mx.array(draft, mx.int32),
                                         spec))
    got = read(verify_sampler.host_reference(scores, keys, positions,
                                             mx.array(draft, mx.int32), spec))
    assert got[:2] == want[:2]
    np.testing.assert_allclose(got[2], want[2], rtol=HOST_RTOL, atol=1e-12)
    np.testing.assert_allclose(got[3], want[3], rtol=HOST_RTOL, atol=1e-12)


def test_the_host_sampler_with_noise_for_the_wrong_seed_fails_the_same_check() -> None:
    """Negative control for the test above."""
    rng = np.random.default_rng(5)
    scores = mx.array(rng.standard_normal((8, 500)).astype(np.float32))
    spec, positions, none = SamplerSpec(), positions_u32(range(40, 48)), mx.array([], mx.int32)
    want = read(verify_sampler.reference(scores, keys_array(1), positions, none, spec))
    got = read(verify_sampler.host_reference(scores, keys_array(2), positions, none, spec))
    assert got[0] != want[0]


def test_a_wrong_sampler_fails_the_same_check() -> None:
    """Negative control: the check catches a sampler whose noise is for the wrong position."""
    rng = np.random.default_rng(3)
    logits = mx.array((rng.standard_normal((6, 96)) * 0.5).astype(np.float32))
    params = SamplingParams(temperature=1.0, seed=11)
    want = oracle(logits, params, None, list(range(100, 106)), [])
    shifted = coupled_rows(logits, params, None, list(range(101, 107)))
    assert shifted.tokens.tolist() != want.tokens


DEMO_SETTINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.0, top_k=40, seed=2),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3),
    SamplingParams(temperature=1.2, min_p=0.05, seed=4),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.02,
                   repetition_penalty=1.2, seed=2**63 + 5),
]


@pytest.mark.slow
def test_reference_equals_todays_sampler_on_the_demo_model(demo_model_dir) -> None:
    from engine.loading import load_model

    loaded = load_model(demo_model_dir)
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    logits = loaded.model(mx.array([ids]))[0, -8:]  # (8, V): a verify pass's worth of rows
    assert verify_sampler.covers(logits, 7)  # the kernel covers this model
    histories = [ids[: len(ids) - 8 + i] for i in range(8)]
    for params in DEMO_SETTINGS:
        for t0, miss in ((len(ids) - 8, 7), (12_345, 0), (2**31, 3)):
            assert_same(logits, params, histories, t0, miss)


# --------------------------------------------------------------------------- bad input


def _case(n_rows: int, vocab: int, dtype=mx.float32):
    rng = np.random.default_rng(n_rows * 1000 + vocab)
    scores = mx.array(rng.standard_normal((n_rows, vocab)).astype(np.float32)).astype(dtype)
    positions = positions_u32(range(7, 7 + n_rows))
    return scores, keys_array(5), positions, mx.array([1] * (n_rows - 1), dtype=mx.int32)


@pytest.mark.parametrize(("n_rows", "vocab", "dtype", "why"), [
    (4, 1000, mx.float32, "vocabulary not a multiple of the tile"),
    (17, 1024, mx.float32, "more than 16 rows"),
    (4, 1024, mx.bfloat16, "bfloat16 scores"),
])
def test_shapes_the_kernel_does_not_cover_go_to_the_reference(n_rows, vocab, dtype,
                                                              why) -> None:
    scores, keys, positions, draft = _case(n_rows, vocab, dtype)
    assert not verify_sampler.covers(scores, draft.shape[0]), why
    spec = SamplerSpec(inv_temperature=1 / 0.8)
    # Even with the kernel switched on (here, without Metal, a kernel call would raise).
    got = read(verify_sampler.sample(scores, keys, positions, draft, spec, use_kernel=True))
    # the reference, or on the CPU backend its host twin
    fallback = (verify_sampler.host_reference if verify_sampler.on_host(spec)
                else verify_sampler.reference)
    want = read(fallback(scores.astype(mx.float32), keys, positions, draft, spec))
    assert got[:2] == want[:2]
    np.testing.assert_array_equal(got[2], want[2])


def test_covered_shapes_do_reach_the_kernel() -> None:
    """Control for the test above: a covered shape with the kernel on does try the kernel."""
    scores, keys, positions, draft = _case(4, 1024, mx.float16)
    assert verify_sampler.covers(scores, draft.shape[0])
    if mx.metal.is_available():
        pytest.skip("Metal present: the kernel runs (tests/kernels/test_on_metal.py)")
    with pytest.raises(RuntimeError, match="Metal"):
        rows = verify_sampler.sample(scores, keys, positions, draft, SamplerSpec(),
                                     use_kernel=True)
        mx.eval(rows.tokens)


@pytest.mark.parametrize(("vocab", "covered"), [
    (151_936, True),  # Qwen2/2.5
    (49_152, True),  # SmolLM2
    (128_256, True),  # Llama 3
    (32_000, True),  # Llama 2, Mistral
    (32_001, False),  # a vocabulary grown by one token: not a multiple of the tile
])
def test_common_vocabularies_are_covered(vocab: int, covered: bool) -> None:
    assert verify_sampler.covers(mx.zeros((5, vocab), dtype=mx.float16), 4) is covered
