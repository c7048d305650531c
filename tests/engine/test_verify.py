"""The two acceptance rules on hand-made distributions (no model).

Rows of `logp` are the target's log-distributions at positions t0, t0+1, ...; the drafts
are chosen by hand so each path of each rule is hit on purpose: all accepted + bonus, first
rejection + replacement, deterministic drafts (q one-hot), p == q, masked tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.sampling import sample_coupled
from engine.verify import Verdict, verify_coupled, verify_rejection

V = 6
SEEDS = range(200)
CHI2_999_DF3 = 16.266  # upper 0.999 quantile of chi-square with 3 degrees of freedom


def log_rows(*rows: list[float]) -> mx.array:
    """Log of the given (normalised here) probability rows; zeros become -inf."""
    p = np.array(rows, dtype=np.float64)
    p = p / p.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        return mx.array(np.log(p).astype(np.float32))


P_ROWS = log_rows(
    [0.05, 0.4, 0.2, 0.15, 0.1, 0.1],
    [0.3, 0.0, 0.3, 0.2, 0.1, 0.1],  # token 1 masked at t0+1
    [0.1, 0.1, 0.1, 0.1, 0.3, 0.3],
    [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],
)


# ----------------------------------------------------------------------------- coupled


def coupled_samples(logp: mx.array, seed: int, t0: int) -> list[int]:
    return sample_coupled(logp, seed, list(range(t0, t0 + logp.shape[0]))).tolist()


@pytest.mark.parametrize("seed", [0, 1, 7, 2**40 + 3])
def test_coupled_accepts_drafts_equal_to_the_targets_samples_then_adds_a_bonus(seed: int) -> None:
    t0 = 17
    s = coupled_samples(P_ROWS, seed, t0)
    verdict = verify_coupled(P_ROWS, s[:3], seed, t0)
    assert (verdict.n_accepted, verdict.token) == (3, s[3])
    p = np.exp(np.array(P_ROWS))
    assert verdict.token_prob == pytest.approx(p[3, s[3]])
    assert verdict.draft_probs == pytest.approx([p[i, s[i]] for i in range(3)])


@pytest.mark.parametrize("wrong_at", [0, 1, 2])
def test_coupled_stops_at_the_first_mismatch_with_the_targets_own_token(wrong_at: int) -> None:
    seed, t0 = 5, 40
    s = coupled_samples(P_ROWS, seed, t0)
    drafts = list(s[:3])
    drafts[wrong_at] = (s[wrong_at] + 1) % V
    for later in range(wrong_at + 1, 3):  # whatever follows a mismatch is irrelevant
        drafts[later] = s[later]
    verdict = verify_coupled(P_ROWS, drafts, seed, t0)
    assert verdict.n_accepted == wrong_at
    assert verdict.token == s[wrong_at] != drafts[wrong_at]


def test_coupled_without_drafts_is_plain_sampling_at_t0() -> None:
    for seed in range(20):
        verdict = verify_coupled(P_ROWS[:1], (), seed, 9)
        assert verdict == Verdict(0, coupled_samples(P_ROWS[:1], seed, 9)[0],
                                  verdict.token_prob, ())


def test_coupled_greedy_rows_accept_exactly_the_argmax() -> None:
    greedy = log_rows([0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0])
    assert verify_coupled(greedy, [2, 4], 3, 0) == Verdict(2, 0, 1.0, (1.0, 1.0))
    assert verify_coupled(greedy, [2, 5], 3, 0) == Verdict(1, 4, 1.0, (1.0, 0.0))


# ----------------------------------------------------------------------------- rejection


def test_rejection_one_hot_q_is_the_deterministic_draft() -> None:
    drafts = [1, 3, 4]
    one_hot = np.full((3, V), -np.inf, np.float32)
    one_hot[np.arange(3), drafts] = 0.0
    for seed in SEEDS:
        a = verify_rejection(P_ROWS, drafts, mx.array(one_hot), seed, 11)
        b = verify_rejection(P_ROWS, drafts, None, seed, 11)
        assert (a.n_accepted, a.token) == (b.n_accepted, b.token)


def test_rejection_p_equal_q_accepts_everything() -> None:
    p = np.exp(np.array(P_ROWS))
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        drafts = [int(rng.choice(V, p=p[i])) for i in range(3)]  # tokens q can propose
        verdict = verify_rejection(P_ROWS, drafts, P_ROWS[:3], seed, 3)
        assert verdict.n_accepted == 3
        assert p[3, verdict.token] > 0


def test_rejection_certain_target_token_is_always_accepted() -> None:
    """p(d) = 1 >= q(d): the ratio is at least 1, so d passes whatever q is."""
    certain = log_rows([0, 0, 0, 1, 0, 0], [0.2] * 5 + [0.0])
    uniform = mx.log(mx.full((1, V), 1.0 / V))
    for seed in range(50):
        verdict = verify_rejection(certain, [3], uniform, seed, 0)
        assert verdict.n_accepted == 1 and verdict.token != 5


def test_rejection_never_returns_a_token_the_target_gives_zero_probability() -> None:
    """A draft of a masked token is always rejected; the residual never picks a masked one."""
    p = np.exp(np.array(P_ROWS))
    q = log_rows([0.1, 0.5, 0.1, 0.1, 0.1, 0.1], [0.1, 0.6, 0.1, 0.1, 0.05, 0.05])
    for seed in SEEDS:
        verdict = verify_rejection(P_ROWS[:3], [0, 1], q, seed, 2)
        assert verdict.n_accepted <= 1  # token 1 at t0+1 has p = 0
        assert p[verdict.n_accepted, verdict.token] > 0
        assert verdict.token_prob == pytest.approx(p[verdict.n_accepted, verdict.token])
        assert verdict.draft_probs == pytest.approx([p[0, 0], 0.0])
        if verdict.n_accepted == 0:
            assert verdict.token != 0 or p[0, 0] > np.exp(np.array(q))[0, 0]


def test_rejection_residual_excludes_tokens_where_q_covers_p() -> None:
    """After rejecting d with q(d) > p(d), the replacement comes from max(0, p - q) only."""
    p_row = [0.5, 0.3, 0.2, 0.0, 0.0, 0.0]
    q_row = [0.1, 0.6, 0.3, 0.0, 0.0, 0.0]  # p - q > 0 only at token 0
    logp = log_rows(p_row, [1 / V] * V)
    logq = log_rows(q_row)
    seen = set()
    for seed in range(300):
        verdict = verify_rejection(logp, [1], logq, seed, 0)
        if verdict.n_accepted == 0:
            seen.add(verdict.token)
    assert seen == {0}


def test_rejection_is_reproducible_per_seed_and_position() -> None:
    q = log_rows([1 / V] * V, [1 / V] * V)
    a = [verify_rejection(P_ROWS[:3], [2, 3], q, s, 8) for s in range(30)]
    b = [verify_rejection(P_ROWS[:3], [2, 3], q, s, 8) for s in range(30)]
    assert a == b
    assert len({(v.n_accepted, v.token) for v in a}) > 1  # and the seed matters


@pytest.mark.parametrize("q", [
    (0.55, 0.05, 0.1, 0.3),
    None,  # a deterministic drafter: always token 3, q one-hot
    (0.3, 0.05, 0.1, 0.2, 0.2, 0.15),  # a padded draft vocabulary: ids 4, 5 are not tokens
    (0.5, 0.3, 0.2),  # a draft vocabulary without token 3
], ids=["sampled", "deterministic", "wider-draft", "narrower-draft"])
def test_rejection_first_token_follows_p(q: tuple[float, ...] | None) -> None:
    """One draft from q: the committed first token is distributed as p.

    The full multi-token test with models is in test_rejection_stats.py; this one pins the
    rule itself on four tokens.
    """
    p = np.array([0.1, 0.2, 0.3, 0.4])
    logp = mx.array(np.log(np.stack([p, p])).astype(np.float32))
    logq = None if q is None else mx.array(np.log(np.array([q])).astype(np.float32))
    n = 2000
    counts = np.zeros(4)
    rng = np.random.default_rng(0)
    for seed in range(n):
        d = 3 if q is None else int(rng.choice(len(q), p=q))
        verdict = verify_rejection(logp, [d], logq, seed, 0)
        counts[d if verdict.n_accepted else verdict.token] += 1
    stat = ((counts - n * p) ** 2 / (n * p)).sum()
    assert stat < CHI2_999_DF3, counts


def test_draft_ids_outside_the_target_vocabulary_are_rejected() -> None:
    """A padded draft embedding can propose ids >= V: no out-of-bounds reads, no acceptance."""
    p = np.exp(np.array(P_ROWS))
    coupled = verify_coupled(P_ROWS[:3], [V + 3, 1], 4, 0)
    assert coupled.n_accepted == 0 and coupled.token < V
    assert coupled.draft_probs == pytest.approx([0.0, p[1, 1]])
    wide_q = mx.log(mx.full((2, V + 8), 1.0 / (V + 8)))
    for seed in range(50):
        verdict = verify_rejection(P_ROWS[:3], [2, V + 5], wide_q, seed, 0)
        assert verdict.n_accepted <= 1 and verdict.token < V
        assert p[verdict.n_accepted, verdict.token] > 0
        assert verdict.draft_probs == pytest.approx([p[0, 2], 0.0])
        deterministic = verify_rejection(P_ROWS[:2], [V + 1], None, seed, 0)
        assert deterministic.n_accepted == 0 and deterministic.token < V
