"""Sampling: each processor on hand-computed cases, the coupled noise, and its marginals.

Statistical tests use fixed seeds, so they are deterministic; their thresholds are fixed in
advance (0.999 chi-square quantiles, hard-coded because scipy is not a dependency).
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.errors import EngineError
from engine.sampling import (
    SamplingParams,
    gumbel_noise,
    gumbel_noise_at,
    log_probs,
    make_greedy_one_hot,
    make_min_p,
    make_processors,
    make_repetition_penalty,
    make_temperature,
    make_top_k,
    make_top_p,
    noise_bits,
    probs,
    residual_distribution,
    sample_categorical,
    sample_coupled,
    sample_coupled_at,
)

NEG_INF = -np.inf

# Upper 0.999 quantiles of the chi-square distribution (scipy.stats.chi2.ppf(0.999, dof)).
CHI2_999 = {4: 18.467, 7: 24.322, 15: 37.697}

EULER_GAMMA = 0.5772156649015329


def np_(a: mx.array) -> np.ndarray:
    return np.array(a)


def row(*values: float) -> mx.array:
    return mx.array([list(values)], dtype=mx.float32)


# --------------------------------------------------------------------------- params


def test_params_defaults_are_greedy_and_frozen() -> None:
    params = SamplingParams()
    assert params.greedy
    assert not SamplingParams(temperature=0.7).greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1"),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.2),
        ("repetition_context_size", -1),
        ("seed", -1),
        ("seed", 2**64),
    ],
)
def test_params_reject_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(EngineError, match=field):
        SamplingParams(**{field: value})


# --------------------------------------------------------------------------- processors


def test_temperature_scales_scores() -> None:
    out = make_temperature(0.5)(row(1.0, -2.0, 0.25))
    np.testing.assert_allclose(np_(out), [[2.0, -4.0, 0.5]], rtol=1e-6)
    with pytest.raises(ValueError):
        make_temperature(0.0)


def test_top_k_keeps_exactly_k_highest() -> None:
    out = np_(make_top_k(2)(row(1.0, 3.0, 2.0, 0.5)))
    np.testing.assert_array_equal(out, [[NEG_INF, 3.0, 2.0, NEG_INF]])
    # k >= V is a no-op; each row has its own threshold.
    unchanged = np_(make_top_k(4)(row(1.0, 3.0, 2.0, 0.5)))
    np.testing.assert_array_equal(unchanged, [[1.0, 3.0, 2.0, 0.5]])
    two_rows = mx.array([[0.0, 5.0, 1.0], [9.0, -1.0, 2.0]])
    np.testing.assert_array_equal(
        np_(make_top_k(1)(two_rows)),
        [
            [NEG_INF, 5.0, NEG_INF],
            [9.0, NEG_INF, NEG_INF],
        ],
    )


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.45, [0]),  # 0.5 alone already exceeds 0.45
        (0.6, [0, 1]),  # 0.5 < 0.6: the boundary token 0.25 is needed and kept
        (0.8, [0, 1, 2]),  # 0.75 < 0.8
        (0.95, [0, 1, 2, 3]),  # 0.9 < 0.95
    ],
)
def test_top_p_keeps_minimal_nucleus_including_boundary(top_p: float, kept: list[int]) -> None:
    # Scores in shuffled order so the test does not rely on sorted input.
    p = [0.15, 0.5, 0.1, 0.25]
    out = np_(make_top_p(top_p)(mx.log(row(*p))))
    order = [1, 3, 0, 2]  # indices by decreasing probability
    expect_kept = {order[i] for i in kept}
    for j in range(4):
        if j in expect_kept:
            assert out[0, j] == pytest.approx(math.log(p[j]), rel=1e-6)
        else:
            assert out[0, j] == NEG_INF


def test_min_p_is_relative_to_the_most_likely_token() -> None:
    logp = mx.log(row(0.5, 0.25, 0.15, 0.1))
    # min_p 0.4 -> threshold 0.2: keeps 0.5 and 0.25.
    out = np_(make_min_p(0.4)(logp))
    assert np.isfinite(out[0]).tolist() == [True, True, False, False]
    # min_p 0.25 -> threshold 0.125: keeps 0.15 too.
    out = np_(make_min_p(0.25)(logp))
    assert np.isfinite(out[0]).tolist() == [True, True, True, False]
    # Shifting every score leaves the relative rule unchanged.
    out = np_(make_min_p(0.4)(logp + 7.0))
    assert np.isfinite(out[0]).tolist() == [True, True, False, False]


def test_repetition_penalty_only_touches_seen_tokens_in_window() -> None:
    logits = mx.array([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    penalize = make_repetition_penalty(2.0, context_size=3)
    # Row 0: window is the last 3 tokens [1, 1, 4]; token 0 fell out of it.
    # Row 1: window [0, 3, 9] - id 9 is outside the vocabulary and ignored.
    out = np_(penalize(logits, [[0, 1, 1, 4], [0, 3, 9]]))
    np.testing.assert_allclose(out[0], [2.0, -2.0, 0.5, 3.0, -4.0])
    np.testing.assert_allclose(out[1], [1.0, -1.0, 0.5, 1.5, -2.0])
    empty = np_(penalize(logits, [[], []]))
    np.testing.assert_array_equal(empty, np_(logits))
    with pytest.raises(ValueError):
        penalize(logits, [[0]])


def test_log_probs_without_histories_ignores_the_penalty() -> None:
    logits = row(2.0, 1.0, 0.0)
    with_penalty = SamplingParams(temperature=1.0, repetition_penalty=3.0)
    np.testing.assert_array_equal(
        np_(log_probs(logits, with_penalty)),
        np_(log_probs(logits, SamplingParams(temperature=1.0))),
    )
    penalized = np_(log_probs(logits, with_penalty, histories=[[0]]))
    expected = np.array([2.0 / 3.0, 1.0, 0.0])
    expected -= np.log(np.exp(expected).sum())
    np.testing.assert_allclose(penalized[0], expected, rtol=1e-5)


def test_greedy_is_log_one_hot_at_penalized_argmax() -> None:
    logits = mx.array([[0.1, 2.0, 1.9, -3.0], [5.0, 1.0, 0.0, 0.0]])
    out = np_(log_probs(logits, SamplingParams()))
    np.testing.assert_array_equal(out, [[NEG_INF, 0.0, NEG_INF, NEG_INF], [0.0] + [NEG_INF] * 3])
    np.testing.assert_array_equal(
        np_(probs(logits, SamplingParams())), [[0, 1, 0, 0], [1, 0, 0, 0]]
    )
    # Penalty 1.1 on token 1 (seen) makes token 2 the argmax of row 0.
    out = np_(log_probs(logits, SamplingParams(repetition_penalty=1.1), [[1], [1]]))
    assert out[0].tolist() == [NEG_INF, NEG_INF, 0.0, NEG_INF]
    assert out[1].tolist() == [0.0, NEG_INF, NEG_INF, NEG_INF]
    assert out.dtype == np.float32


def test_log_probs_applies_temperature_before_top_p() -> None:
    logits = mx.log(row(0.5, 0.25, 0.15, 0.1))
    # At T=1 the 0.6-nucleus is {0.5, 0.25} -> renormalized to 2/3, 1/3.
    p1 = np_(probs(logits, SamplingParams(temperature=1.0, top_p=0.6)))
    np.testing.assert_allclose(p1[0], [2 / 3, 1 / 3, 0.0, 0.0], rtol=1e-5)
    # At T=0.5 the distribution is p^2 / sum = [0.725, 0.181, ...]: the top token alone covers 0.6.
    p05 = np_(probs(logits, SamplingParams(temperature=0.5, top_p=0.6)))
    np.testing.assert_allclose(p05[0], [1.0, 0.0, 0.0, 0.0], rtol=1e-6)


def test_log_probs_matches_the_eager_processor_chain_and_normalizes() -> None:
    logits = mx.random.normal((5, 300), key=mx.random.key(3)) * 2.0
    for params in [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=40),
        SamplingParams(temperature=0.9, top_k=100, top_p=0.8, min_p=0.02),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(),
    ]:
        eager = logits
        for step in make_processors(params):
            eager = step(eager)
        compiled = np_(log_probs(logits, params))
        np.testing.assert_allclose(compiled, np_(eager), rtol=1e-6, atol=1e-6)
        total = np.exp(compiled.astype(np.float64)).sum(axis=-1)
        np.testing.assert_allclose(total, 1.0, atol=1e-5)
        # Different row counts (1 vs K+1) retrace the compiled chain and agree row by row.
        one = np_(log_probs(logits[2:3], params))
        np.testing.assert_allclose(one[0], compiled[2], rtol=1e-6, atol=1e-6)


def test_top_k_then_softmax_against_numpy_reference() -> None:
    logits = np.array([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5]], dtype=np.float32)
    out = np_(log_probs(mx.array(logits), SamplingParams(temperature=0.7, top_k=5)))
    scaled = logits[0] / 0.7
    keep = scaled >= np.sort(scaled)[-5]
    ref = np.where(keep, scaled - np.log(np.exp(scaled[keep]).sum()), -np.inf)
    np.testing.assert_allclose(out[0], ref, rtol=1e-5)


def test_single_processors_compose_to_the_documented_chain() -> None:
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.05)
    names = [step.__qualname__.split(".")[0] for step in make_processors(params)]
    assert names == [
        "make_temperature",
        "make_top_k",
        "make_top_p",
        "make_min_p",
        "make_log_softmax",
    ]
    assert [s.__qualname__.split(".")[0] for s in make_processors(SamplingParams())] == [
        make_greedy_one_hot.__name__
    ]


# --------------------------------------------------------------------------- noise


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _bits_reference(seed: int, positions: list[int], vocab: int) -> np.ndarray:
    """Independent numpy version of the documented hash (uint32 arithmetic wraps)."""
    u = np.uint32
    key_a = _fmix32_np(np.array([(seed & 0xFFFFFFFF) ^ 0x243F6A88], dtype=u))[0]
    hi = np.array([((seed >> 32) ^ 0x85A308D3)], dtype=u)
    key_b = _fmix32_np(hi + key_a)[0]
    t = np.array(positions, dtype=u)
    row_ = _fmix32_np(t * u(0x9E3779B9) + key_b)[:, None]
    row_key = _fmix32_np(row_ ^ u(0x13198A2E)) + key_a
    column = np.arange(vocab, dtype=u)[None, :] * u(0x7FEB352D)
    return _fmix32_np(_fmix32_np(row_ + column) ^ row_key)


@pytest.mark.parametrize("seed", [0, 1, 123456789, 2**32 + 5, 2**64 - 1])
def test_noise_bits_match_independent_implementation(seed: int) -> None:
    positions = [0, 1, 2, 1000, 2**31 + 7, 2**32 - 1]
    with np.errstate(over="ignore"):
        expected = _bits_reference(seed, positions, 97)
    np.testing.assert_array_equal(np_(noise_bits(seed, positions, 97)), expected)
    # Gumbel from the same bits: u = (2k+1)/2^24, k = top 23 bits; compared in float64.
    k = (expected >> np.uint32(9)).astype(np.float64)
    u = (2 * k + 1) / 2**24
    g_ref = -np.log(-np.log(u))
    np.testing.assert_allclose(np_(gumbel_noise(seed, positions, 97)), g_ref, atol=2e-6, rtol=1e-6)


def test_noise_rows_depend_only_on_seed_and_position() -> None:
    full = np_(gumbel_noise(42, [5, 9, 2, 700], 1000))
    assert full.dtype == np.float32 and full.shape == (4, 1000)
    reordered = np_(gumbel_noise(42, [700, 2, 5], 1000))
    np.testing.assert_array_equal(reordered, full[[3, 2, 0]])
    for i, t in enumerate([5, 9, 2, 700]):
        np.testing.assert_array_equal(np_(gumbel_noise(42, [t], 1000))[0], full[i])
        np.testing.assert_array_equal(np_(gumbel_noise(42, mx.array([t]), 1000))[0], full[i])
    # A larger vocabulary extends each row; the shared prefix is unchanged.
    np.testing.assert_array_equal(np_(gumbel_noise(42, [9], 1500))[0, :1000], full[1])


def test_noise_and_coupled_samples_over_part_of_the_vocabulary_are_the_lifted_ones() -> None:
    """A drafter with a hot vocabulary draws over its own columns with the noise of their
    ids: the very tokens `sample_coupled` draws from its rows lifted to every token."""
    V, rng = 3000, np.random.default_rng(0)
    ids = np.sort(rng.choice(V, 400, replace=False)).astype(np.int32)
    positions = [3, 17, 17, 900, 2**31 + 1]
    full = np_(gumbel_noise(11, positions, V))
    np.testing.assert_array_equal(np_(gumbel_noise_at(11, positions, mx.array(ids))),
                                  full[:, ids])
    same = 0
    for seed in range(40):
        logits = rng.standard_normal((len(positions), len(ids))).astype(np.float32) * 2
        lq = mx.array(logits) - mx.logsumexp(mx.array(logits), axis=-1, keepdims=True)
        lifted = mx.full((len(positions), V), -mx.inf)
        lifted[:, mx.array(ids)] = lq
        want = sample_coupled(lifted, seed, positions)
        np.testing.assert_array_equal(np_(sample_coupled_at(lq, seed, positions,
                                                            mx.array(ids))), np_(want))
        # negative control: each column with its neighbour's noise draws other tokens
        wrong = sample_coupled_at(lq, seed, positions, mx.array(np.roll(ids, 1)))
        same += int((np_(wrong) == np_(want)).sum())
    assert same < 0.2 * 40 * len(positions)


def test_noise_differs_across_positions_and_seeds() -> None:
    base = np_(gumbel_noise(7, [10], 4096))[0]
    others = {
        "next position": np_(gumbel_noise(7, [11], 4096))[0],
        "next seed": np_(gumbel_noise(8, [10], 4096))[0],
        "high seed word": np_(gumbel_noise(7 + 2**32, [10], 4096))[0],
    }
    for name, other in others.items():
        # Independent rows coincide in a float32 entry with probability ~1e-6 each.
        assert np.mean(base == other) < 0.01, name
        assert abs(np.corrcoef(base, other)[0, 1]) < 0.1, name


def test_noise_marginals_are_gumbel() -> None:
    g = np_(gumbel_noise(2024, list(range(1000)), 1000)).astype(np.float64)  # 1e6 draws
    assert np.isfinite(g).all()
    # Sampled from u in [2^-24, 1 - 2^-24]: g in [-log(16.64), 16.64].
    assert g.min() >= -2.82 and g.max() <= 16.7
    # Mean gamma, variance pi^2/6; standard errors ~1.3e-3 and ~5e-3: tolerances are >= 4 sigma.
    assert g.mean() == pytest.approx(EULER_GAMMA, abs=0.006)
    assert g.var() == pytest.approx(math.pi**2 / 6, abs=0.025)
    # The Gumbel CDF maps g back to uniforms: 16 equal bins, chi-square vs 15 dof.
    u = np.exp(-np.exp(-g)).ravel()
    counts = np.histogram(u, bins=16, range=(0.0, 1.0))[0]
    expected = u.size / 16
    assert ((counts - expected) ** 2 / expected).sum() < CHI2_999[15]
    # Neighbouring vocab entries and neighbouring positions are uncorrelated (sd ~1e-3).
    assert abs(np.corrcoef(g[:, :-1].ravel(), g[:, 1:].ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(g[:-1].ravel(), g[1:].ravel())[0, 1]) < 0.01


def test_noise_bits_are_balanced() -> None:
    bits = np_(noise_bits(0, list(range(500)), 2000)).ravel()  # 1e6 words
    for b in range(32):
        # Each bit set half the time; sd 5e-4, tolerance 10 sd.
        assert np.mean((bits >> np.uint32(b)) & np.uint32(1)) == pytest.approx(0.5, abs=0.005), b


def test_noise_rejects_bad_seed_and_positions() -> None:
    with pytest.raises(ValueError):
        gumbel_noise(-1, [0], 8)
    with pytest.raises(ValueError):
        gumbel_noise(0, [-1], 8)
    with pytest.raises(ValueError):
        sample_coupled(mx.zeros((2, 8)), 0, [0])


# --------------------------------------------------------------------------- coupled sampler


def test_sample_coupled_greedy_returns_argmax() -> None:
    logits = mx.random.normal((6, 50), key=mx.random.key(1))
    greedy = log_probs(logits, SamplingParams())
    expected = np_(mx.argmax(logits, axis=-1)).tolist()
    for seed in (0, 1, 99):
        tokens = sample_coupled(greedy, seed, [3, 4, 5, 6, 7, 8])
        assert tokens.dtype == mx.int32 and tokens.shape == (6,)
        assert np_(tokens).tolist() == expected


def test_sample_coupled_is_the_same_token_in_any_batch() -> None:
    logits = mx.random.normal((5, 200), key=mx.random.key(2))
    logp = log_probs(logits, SamplingParams(temperature=1.2))
    positions = [40, 41, 42, 43, 44]
    batch = np_(sample_coupled(logp, 5, positions)).tolist()
    singles = [np_(sample_coupled(logp[i : i + 1], 5, [t]))[0] for i, t in enumerate(positions)]
    assert batch == singles
    # Equals argmax(logp + g) computed by hand from the public noise.
    manual = np_(mx.argmax(logp + gumbel_noise(5, positions, 200), axis=-1)).tolist()
    assert batch == manual


LOGITS_8 = mx.array([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5]])
N_PER_SEED = 5000
SEEDS = (0, 1, 2, 3)  # 20,000 draws in all


def _coupled_counts(logp: mx.array, noise_scale: float = 1.0) -> np.ndarray:
    tiled = mx.broadcast_to(logp, (N_PER_SEED, logp.shape[-1]))
    positions = list(range(N_PER_SEED))
    counts = np.zeros(logp.shape[-1], dtype=np.int64)
    for seed in SEEDS:
        if noise_scale == 1.0:
            tokens = sample_coupled(tiled, seed, positions)
        else:
            noise = gumbel_noise(seed, positions, logp.shape[-1])
            tokens = mx.argmax(tiled + noise_scale * noise, axis=-1)
        counts += np.bincount(np_(tokens), minlength=logp.shape[-1])
    return counts


def _chi_square(counts: np.ndarray, target: np.ndarray) -> tuple[float, int]:
    """Pearson statistic over the support of `target`, and its degrees of freedom."""
    support = target > 0
    assert counts[~support].sum() == 0, "drew a masked token"
    n = counts.sum()
    expected = n * target[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_k=5),
    ],
)
def test_coupled_sampler_matches_target_distribution(params: SamplingParams) -> None:
    logp = log_probs(LOGITS_8, params)
    target = np.exp(np_(logp)[0].astype(np.float64))
    stat, dof = _chi_square(_coupled_counts(logp), target)
    assert stat < CHI2_999[dof], (stat, dof)


def test_chi_square_negative_controls_fail() -> None:
    """The same test must reject samplers that are wrong in realistic ways."""
    logp_07 = log_probs(LOGITS_8, SamplingParams(temperature=0.7))
    target = np.exp(np_(logp_07)[0].astype(np.float64))
    # Half-strength noise samples from p^2 (too sharp).
    stat, dof = _chi_square(_coupled_counts(logp_07, noise_scale=0.5), target)
    assert stat > CHI2_999[dof], stat
    # Forgetting the temperature: draws from the T=1 softmax judged against T=0.7.
    untempered = log_probs(LOGITS_8, SamplingParams(temperature=1.0))
    stat, dof = _chi_square(_coupled_counts(untempered), target)
    assert stat > CHI2_999[dof], stat


# --------------------------------------------------------------------------- rejection rule


def test_sample_categorical_matches_distribution_and_skips_zeros() -> None:
    p = np.array([0.3, 0.0, 0.2, 0.1, 0.25, 0.0, 0.05, 0.1], dtype=np.float32)
    tiled = mx.broadcast_to(mx.array(p), (20000, 8))
    tokens = sample_categorical(tiled, mx.random.key(11))
    assert tokens.dtype == mx.int32 and tokens.shape == (20000,)
    counts = np.bincount(np_(tokens), minlength=8)
    stat, dof = _chi_square(counts, p.astype(np.float64))
    assert dof == 5
    assert stat < 20.515, stat  # chi2.ppf(0.999, 5)


def test_residual_distribution() -> None:
    p = mx.array([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    q = mx.array([[0.3, 0.1, 0.6], [0.2, 0.5, 0.3], [0.5, 0.3, 0.2]])
    out = np_(residual_distribution(p, q))
    np.testing.assert_allclose(out[0], [0.5, 0.5, 0.0], atol=1e-6)  # max(0, p-q) = [.2, .2, 0]
    np.testing.assert_allclose(out[1], [1.0, 0.0, 0.0], atol=1e-6)  # [.3, 0, 0]
    np.testing.assert_allclose(out[2], [0.5, 0.3, 0.2], atol=1e-6)  # p == q: falls back to p


# --------------------------------------------------------------------------- threads

_THREAD_SCRIPT = """
import threading
import mlx.core as mx
from engine.sampling import SamplingParams, log_probs, sample_coupled

logits = mx.array([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5]] * 64)
params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1)

def draw():
    logp = log_probs(logits, params, [[4]] * 64)
    return sample_coupled(logp, 9, list(range(64))).tolist()

main = draw()
out = {}
worker = threading.Thread(target=lambda: out.setdefault("tokens", draw()))
worker.start()
worker.join()
assert out["tokens"] == main, (out["tokens"], main)
print("ok")
"""


def test_worker_thread_gets_same_tokens_and_process_exits_cleanly() -> None:
    """The engine samples on a worker thread; that thread's exit must not abort the process.

    With mx.compile used on the worker thread, MLX 0.32 aborted at interpreter exit in most
    runs; two runs make a regression very likely to show.
    """
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _THREAD_SCRIPT],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "ok"
