"""Choosing K: the expected-tokens formula, the cost model, the acceptance estimate, the
per-step policy, and calibration cached in the app-data dir."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from itertools import pairwise

import numpy as np
import pytest

from engine import tuning
from engine.drafters.ngram import NgramDrafter
from engine.tuning import (
    CONFIRM_TIMINGS,
    COPY_MATCH,
    COST_EMA,
    DRAFT_MARGIN,
    DRIFT_FRACTION,
    GUARD_CLEAR_STEPS,
    GUARD_FRESH,
    GUARD_MIN_STEPS,
    GUARD_RETRY,
    GUARD_SLACK,
    K_MAX,
    OVERHEAD_MIN_STEPS,
    PAD_MARGIN,
    PROBE_EVERY,
    PROBE_SHARE,
    PROVEN_MARGIN,
    REFINE_FRACTION,
    SLOW_CLIP,
    AcceptanceEstimate,
    Choice,
    CostModel,
    DraftPolicy,
    PolicyMemory,
    RealizedSpeed,
    StepOverhead,
    best_k,
    expected_tokens,
    row_budget,
    useful_depth,
)

FLAT = CostModel({1: 0.010, 16: 0.010})  # a verify pass costs the same at any width
LINEAR = CostModel({1: 0.010, 16: 0.160})  # ... or grows with every token


# ----------------------------------------------------------------------------- formula


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.99])
@pytest.mark.parametrize("k", [0, 1, 4, 15])
def test_expected_tokens_is_the_geometric_sum(alpha: float, k: int) -> None:
    assert expected_tokens(alpha, k) == pytest.approx(sum(alpha**i for i in range(k + 1)))


def test_expected_tokens_edges() -> None:
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.7, 0) == 1.0


def test_expected_tokens_matches_simulated_steps() -> None:
    """Each draft passes with probability alpha until the first failure; +1 target token."""
    rng = np.random.default_rng(0)
    alpha, k, n = 0.7, 5, 200_000
    passes = rng.random((n, k)) < alpha
    accepted = np.where(passes.all(axis=1), k, np.argmin(passes, axis=1))
    assert (accepted + 1).mean() == pytest.approx(expected_tokens(alpha, k), rel=0.01)


# ----------------------------------------------------------------------------- costs


def test_cost_model_interpolates_and_extrapolates() -> None:
    costs = CostModel({1: 1.0, 4: 4.0, 8: 6.0})
    assert costs.verify(1) == 1.0
    assert costs.verify(2) == pytest.approx(2.0)
    assert costs.verify(6) == pytest.approx(5.0)
    assert costs.verify(12) == pytest.approx(8.0)  # the last slope continues
    assert costs.verify(0) == 1.0  # never below the narrowest measurement


def test_cost_curve_follows_every_observed_pass() -> None:
    costs = CostModel({1: 1.0, 4: 4.0})
    assert costs.verify(4) == 4.0 and costs.verify(2) == pytest.approx(2.0)
    costs.observe(4, 4.0)  # a live timing that agrees with the table: width 4 is tested
    costs.observe(4, 5.0)  # the running cost moves a COST_EMA step towards 5.0
    assert costs.verify(4) == pytest.approx(4.0 + COST_EMA * 1.0)
    assert costs.verify(2) == pytest.approx(1.0 + (3.0 + COST_EMA * 1.0) / 3)
    assert costs.verify(40) > costs.verify(16) > costs.verify(4)  # past the cached widths


# a BLAS whose small-matrix kernels block rows by 8: 12 rows cost more than 16
HUMP = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.3, 12: 2.0, 16: 1.6}


def test_a_pass_in_a_hump_of_the_curve_is_padded_to_the_cheaper_width() -> None:
    costs = CostModel(dict(HUMP))
    # widths 9-10 interpolate to under 1.6 * (1 + PAD_MARGIN); from 11 on 16 rows pay
    assert [costs.pad_width(w) for w in (1, 2, 8, 9, 10, 11, 12, 15, 16)] == [
        1, 2, 8, 9, 10, 16, 16, 16, 16]
    assert costs.verify(8) == pytest.approx(1.3) and costs.verify(10) == pytest.approx(1.65)
    # run at 16 rows (1.6), but never priced below a narrower pass
    assert costs.verify(11) == costs.verify(15) == pytest.approx(1.65)
    assert costs.verify(12) < costs.table()[12]
    prices = [costs.verify(w) for w in range(K_MAX + 2)]
    assert prices == sorted(prices)  # never less for a wider pass
    assert costs.verify(24) >= costs.verify(16)  # past the table: from the rising curve
    assert costs.table()[12] == 2.0  # the table keeps the hump it measured
    # a step's row budget bounds the padding (verify-pass memory)
    assert costs.pad_width(12, limit=12) == 12 and costs.pad_width(12, limit=16) == 16
    assert costs.pad_width(12, limit=15) == 15  # the cheapest width the budget reaches
    # timings of the padded width correct its price like any other
    costs.observe(16, 1.6)
    for _ in range(5):  # each smoothed and clipped: 1.6 * (1 + COST_EMA * SLOW_CLIP) ** 5
        costs.observe(16, 4.0)
    assert costs.table()[16] == pytest.approx(1.6 * (1 + COST_EMA * SLOW_CLIP) ** 5)
    assert costs.table()[16] > 2.0  # above 12's
    assert costs.verify(12) > 1.6 and costs.pad_width(12) == 12


def test_a_row_budget_below_the_dip_prices_and_pads_within_the_budget() -> None:
    """A step may pad only within its row budget: where the budget stops short of the
    dip, a pass is priced at what it will cost (its own width, or the cheapest width the
    budget reaches), not at the dip it may not use."""
    costs = CostModel({1: 1.0, 8: 1.3, 12: 2.0, 13: 1.7, 16: 1.6})
    # unbudgeted: run at 16 rows, priced no lower than 10 rows' 1.65
    assert costs.pad_width(12) == 16 and costs.verify(12) == pytest.approx(1.65)
    # budget 13: 13 rows are the cheapest it reaches (1.7 undercuts 2.0 by > PAD_MARGIN)
    assert costs.pad_width(12, limit=13) == 13
    assert costs.verify(12, limit=13) == pytest.approx(1.7)
    # budget 12: no padding, and the price is 12 rows' own
    assert costs.pad_width(12, limit=12) == 12
    assert costs.verify(12, limit=12) == pytest.approx(2.0)
    assert costs.verify(11, limit=11) == pytest.approx(1.3 + 0.7 * 3 / 4)
    # the unbudgeted prices are unchanged by asking for budgeted ones (separate curves)
    assert costs.verify(12) == pytest.approx(1.65) and costs.pad_width(12) == 16


def test_best_k_prices_each_k_within_its_own_row_budget() -> None:
    """A dip at 32 rows is reachable by padding only from K = 15 (row budget 1 + K +
    EXTRA_NODES): a 4-token draft runs at its own width and must be priced there."""
    costs = CostModel({1: 1.0, 2: 1.5, 5: 3.0, 31: 3.0, 32: 1.05})
    assert row_budget(4) == 21 and row_budget(15) == 32
    assert best_k(0.3, 0.0, costs, k_max=4) == (0, pytest.approx(1.0))
    # negative control: a draft long enough that padding to 32 rows is allowed
    assert costs.pad_width(5, row_budget(15)) == 32 and best_k(0.3, 0.0, costs)[0] == 15


def test_a_flattened_table_from_before_padding_learns_the_hump_from_live_passes() -> None:
    """calibration.json files written before padding hold the curve made non-decreasing
    (12 priced like 16): the passes at 12 rows that table still runs unpadded show the
    hump, and from then on they are run 16 rows wide."""
    costs = CostModel({1: 1.0, 8: 1.3, 12: 1.6, 16: 1.6})
    assert costs.pad_width(12) == 12
    costs.observe(16, 1.6)
    timings = 0
    while costs.pad_width(12) == 12 and timings < 10:
        costs.observe(12, 2.0)
        timings += 1
    assert costs.pad_width(12) == 16 and timings == 2


def test_a_dip_within_the_margin_or_below_width_one_pads_nothing() -> None:
    """Negative controls: a wider width 3% cheaper is timing noise, and plain steps (one
    row) are never run wider, even where the table says two rows cost less."""
    costs = CostModel({1: 1.2, 2: 1.0, 8: 1.5, 12: 1.5 * (1 + PAD_MARGIN / 2), 16: 1.5})
    assert costs.pad_width(1) == 1 and costs.verify(1) == 1.2
    assert costs.pad_width(12) == 12 and costs.pad_width(8) == 8


def test_best_k_is_large_when_acceptance_is_near_one_and_verify_is_flat() -> None:
    k, rate = best_k(0.98, 0.0, FLAT)
    assert k == K_MAX
    assert rate == pytest.approx(expected_tokens(0.98, K_MAX) / 0.010)


@pytest.mark.parametrize(("alpha", "draft_s", "costs"), [
    (0.2, 0.010, FLAT),  # drafts cost a full pass each and rarely pass
    (0.5, 0.0, LINEAR),  # free drafts, but every verified token costs a pass
    (0.0, 0.0, FLAT),  # nothing is ever accepted
])
def test_best_k_is_zero_when_drafting_cannot_pay(alpha: float, draft_s: float,
                                                  costs: CostModel) -> None:
    assert best_k(alpha, draft_s, costs) == (0, pytest.approx(1.0 / costs.verify(1)))


def test_best_k_respects_k_max_and_grows_with_acceptance() -> None:
    assert best_k(0.98, 0.0, FLAT, k_max=4)[0] == 4
    costs = CostModel({1: 0.010, 2: 0.011, 4: 0.013, 8: 0.018, 16: 0.030})
    ks = [best_k(a, 0.001, costs)[0] for a in np.linspace(0.0, 0.98, 30)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] > 4


def test_best_k_rate_beats_plain_whenever_it_drafts() -> None:
    for alpha in np.linspace(0.0, 0.98, 15):
        for draft_s in (0.0, 0.001, 0.005):
            k, rate = best_k(alpha, draft_s, LINEAR)
            plain = 1.0 / LINEAR.verify(1)
            assert (k == 0 and rate == pytest.approx(plain)) or rate > plain


# the demo model on a 2-core CPU: widths 2-3 cost a little more than width 1, and a step
# that must read the pending token before building its pass loses ~6% of one
CPU_LIKE = CostModel({1: 0.127, 2: 0.136, 3: 0.146, 4: 0.184, 8: 0.204, 16: 0.225},
                     overlap_s=0.008)


def test_reading_the_pending_token_first_makes_drafting_pay_less() -> None:
    for alpha in np.linspace(0.05, 0.98, 15):
        rate_unfed = best_k(alpha, 0.0, CPU_LIKE)[1]
        rate_pending = best_k(alpha, 0.0, CPU_LIKE, pending=True)[1]
        assert rate_pending <= rate_unfed
    assert best_k(0.98, 0.0, CPU_LIKE, pending=True)[0] > 0  # good drafts still pay


def test_a_guessed_pending_token_drafts_only_when_guesses_are_mostly_right() -> None:
    """Chat on the demo model: about 1 in 3 prompt-lookup guesses is right. From the unfed
    state that pays; as a guess of the pending token it does not (most guesses only cost
    the read). Copied text (most guesses right) still drafts long."""
    assert best_k(0.35, 0.0, CPU_LIKE)[0] > 0
    assert best_k(0.35, 0.0, CPU_LIKE, pending=True, guessed=True)[0] == 0
    assert best_k(0.85, 0.0, CPU_LIKE, pending=True, guessed=True)[0] >= 4


def random_tables(n: int, seed: int = 0) -> list[CostModel]:
    """Cost tables of every shape the policy meets: sparse or dense, rising or with dips
    (which padding uses), some timed live, some drifted."""
    rng = np.random.default_rng(seed)
    tables = []
    for _ in range(n):
        widths = {1, *rng.choice(np.arange(2, 40), size=rng.integers(0, 10), replace=False)}
        base = float(rng.uniform(0.01, 0.1))
        costs = CostModel({int(w): base * (1 + float(rng.uniform(-0.3, 1.5)) * (w - 1) / 10)
                           for w in widths}, overlap_s=float(rng.uniform(0, 0.3)) * base)
        for _ in range(rng.integers(0, 6)):
            costs.observe(int(rng.choice([*widths, 2, 5, 9])), base * float(rng.uniform(0.5, 2)))
        tables.append(costs)
    return tables


def test_step_prices_are_each_width_priced_under_its_own_steps_row_budget() -> None:
    """The list the policy prices every K from, built once per change, is exactly what
    `verify` says for each width under a K-draft step's row budget."""
    padded = 0
    for costs in random_tables(400):
        want = [costs.verify(w, row_budget(w - 1)) for w in range(K_MAX + 2)]
        assert costs.step_prices() == want
        padded += any(costs.pad_width(w, row_budget(w - 1)) != w for w in range(2, K_MAX + 2))
    assert padded > 40  # the tables exercise padding, so the budgets matter


def reference_best_k(alpha: float, draft_s: float, costs: CostModel, k_max: int,
                     pending: bool, guessed: bool, margin: float,
                     overhead: float) -> tuple[int, float]:
    """`best_k` as its docstring defines it, every width priced."""
    widths = [costs.verify(w, row_budget(w - 1)) for w in range(k_max + 2)]
    plain = 1.0 / widths[1]
    extra = costs.overlap_s if pending or guessed else 0.0
    best = (0, plain)
    for k in range(1, k_max + 1):
        tokens, seconds = expected_tokens(alpha, k), (k * draft_s + widths[k + 1]) * overhead
        if guessed:
            tokens = alpha * tokens + (1.0 - alpha)
            seconds = alpha * seconds + (1.0 - alpha) * widths[1]
        if tokens / (seconds + extra) > best[1]:
            best = (k, tokens / (seconds + extra))
    return (0, plain) if best[0] and best[1] < plain * (1.0 + margin) else best


def test_best_k_ruling_a_drafter_out_at_one_token_prices_changes_no_answer() -> None:
    rng = np.random.default_rng(1)
    drafting = 0
    for costs in random_tables(2000, seed=1):
        args = (float(rng.random()), float(rng.choice([0.0, rng.uniform(0, 0.5)])) *
                costs.verify(1), costs, int(rng.integers(1, K_MAX + 1)), bool(rng.random() < 0.5),
                bool(rng.random() < 0.5), float(rng.choice([PROVEN_MARGIN, DRAFT_MARGIN])),
                float(rng.uniform(0.8, 2.0)))
        got = best_k(*args)
        assert got == reference_best_k(*args)
        drafting += got[0] > 0
    assert 200 < drafting < 1800  # both answers are common: the test sees both paths


def test_a_drafter_sitting_out_is_judged_without_pricing_every_width() -> None:
    """Every plain step re-times width 1, so the whole curve would be rebuilt each step
    (~0.5 ms of the policy's, which on this CPU the pass pays: `auto` with nothing to
    draft ran ~5% behind plain decoding). A drafter that cannot pay even at one-token
    prices is ruled out first."""
    costs = CostModel(dict(TRUE), {"layerskip": 0.5 * TRUE[1]})
    policy = DraftPolicy("layerskip", ("layerskip",), costs)
    policy.estimates["layerskip"] = AcceptanceEstimate(0.2, weight=40.0)
    costs.observe(1, TRUE[1])
    assert policy.choose(FRESH).drafter is None
    assert costs._steps is None
    policy.estimates["layerskip"] = AcceptanceEstimate(0.9, weight=40.0)  # one that pays
    assert policy.choose(FRESH).drafter == "layerskip" and costs._steps is not None


# ----------------------------------------------------------------------------- acceptance


def test_acceptance_estimate_starts_at_the_prior() -> None:
    assert AcceptanceEstimate(0.6).alpha == pytest.approx(0.6)


def test_acceptance_estimate_rises_with_full_acceptance_and_falls_with_rejections() -> None:
    up, down = AcceptanceEstimate(0.5), AcceptanceEstimate(0.5)
    ups, downs = [], []
    for _ in range(40):
        up.update(4, 4)
        down.update(4, 0)
        ups.append(up.alpha)
        downs.append(down.alpha)
    assert ups == sorted(ups) and ups[-1] >= 0.95
    assert downs == sorted(downs, reverse=True) and downs[-1] < 0.1


def test_acceptance_estimate_ignores_steps_without_drafts() -> None:
    est = AcceptanceEstimate(0.4)
    est.update(0, 0)
    assert est.alpha == pytest.approx(0.4)


@pytest.mark.parametrize("true_alpha", [0.3, 0.7, 0.9])
def test_acceptance_estimate_tracks_the_observed_rate(true_alpha: float) -> None:
    rng = np.random.default_rng(1)
    est = AcceptanceEstimate(0.5)
    seen = []
    for step in range(600):
        passes = rng.random(4) < true_alpha
        n_accepted = 4 if passes.all() else int(np.argmin(passes))
        est.update(4, n_accepted)
        if step >= 100:
            seen.append(est.alpha)
    assert np.mean(seen) == pytest.approx(true_alpha, abs=0.06)


# ----------------------------------------------------------------------------- policy


def ngram_match(context: Sequence[int], k: int) -> tuple[tuple[int, ...], int]:
    """What ChatSession hands the policy: tokens prompt lookup would draft, suffix length."""
    return NgramDrafter().match_with_length(context, k)


REPEATING = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5]  # suffix 1..5 seen; 6..5 followed
FRESH = list(range(20, 40))  # no token repeats


def timed(costs: CostModel) -> CostModel:
    """`costs` as if each width had just been timed live at its table value: a table the
    machine has confirmed, which needs no cost probes."""
    for width, seconds in list(costs.verify_s.items()):
        for _ in range(CONFIRM_TIMINGS):
            costs.observe(width, seconds)
    return costs


COSTS = timed(CostModel({1: 0.010, 16: 0.011},
                        {"ngram": 0.0, "model": 0.001, "layerskip": 0.001}))


def test_fixed_k_always_drafts_k() -> None:
    policy = DraftPolicy("model", ("ngram", "model"), None, fixed_k=3, ngram_match=ngram_match)
    for _ in range(5):
        choice = policy.choose(FRESH)
        assert (choice.drafter, choice.k) == ("model", 3)
        policy.update(choice, 3, 0)


def test_ngram_mode_without_a_match_takes_a_plain_step() -> None:
    policy = DraftPolicy("ngram", ("ngram",), COSTS, ngram_match=ngram_match)
    assert policy.choose(FRESH).drafter is None
    choice = policy.choose(REPEATING)
    assert choice.drafter == "ngram"
    assert 1 <= choice.k <= len(ngram_match(REPEATING, K_MAX)[0]) == 10  # at most what follows
    # from pending logits the first token is a guess of the pending one: K counts the rest
    pending = DraftPolicy("ngram", ("ngram",), COSTS, ngram_match=ngram_match)
    assert 1 <= pending.choose(REPEATING, pending=True).k <= 9


def test_auto_picks_ngram_when_it_has_a_match() -> None:
    policy = DraftPolicy("auto", ("ngram", "layerskip", "model"), COSTS,
                         ngram_match=ngram_match)
    assert policy.choose(REPEATING).drafter == "ngram"
    assert policy.choose(FRESH).drafter in ("model", "layerskip")


def test_free_checks_of_prompt_lookup_guesses_teach_the_policy() -> None:
    """A short match starts below the drafting threshold; the tokens the plain steps commit
    show whether its guesses were right, and only right guesses make it draft."""
    ctx = [1, 2, 3, 9, 1, 2]  # suffix (1, 2) matched once: guesses 3

    def after(committed: int) -> tuple[Choice, Choice]:
        policy = DraftPolicy("auto", ("ngram",), COSTS, ngram_match=ngram_match)
        first = policy.choose(ctx)
        for _ in range(12):
            policy.observe(committed)
            policy.choose(ctx)
        return first, policy.choose(ctx)

    first, later = after(3)
    assert first.drafter is None and later.drafter == "ngram"
    first, later = after(4)  # negative control: wrong guesses teach it nothing good
    assert first.drafter is None and later.drafter is None


def test_a_guess_a_lookup_tree_held_counts_as_right() -> None:
    """With trees on, a free check counts the step a hit where another earlier match (a
    first-layer branch) guessed the token though the chain's guess missed: the tree would
    have kept it. Not so where no branch held it (negative control)."""
    ctx = [1, 2, 3, 9, 1, 2]

    def later(branched: bool) -> Choice:
        policy = DraftPolicy("auto", ("ngram",), COSTS, ngram_match=ngram_match)
        for _ in range(12):
            policy.choose(ctx)
            assert policy.observe(4, branched) is False  # the chain's guess was 3
        return policy.choose(ctx)

    assert later(True).drafter == "ngram"
    assert later(False).drafter is None


def test_a_failing_drafter_falls_back_to_plain_steps_then_probes() -> None:
    policy = DraftPolicy("model", ("model",), COSTS)
    choices = []
    for _ in range(60):
        choice = policy.choose(FRESH)
        policy.update(choice, choice.k, 0)  # never accepted
        choices.append(choice)
    plain = [i for i, c in enumerate(choices) if c.drafter is None]
    assert plain, "drafting kept going although nothing was accepted"
    first = plain[0]
    probes = [i for i, c in enumerate(choices) if c.drafter == "model" and i > first]
    assert probes and probes[0] == first + PROBE_EVERY - 1  # idle steps, then one probe
    assert all(choices[i].k <= 2 for i in probes)
    assert probes[1] - probes[0] == PROBE_EVERY


def test_rechecks_of_a_drafter_sitting_out_are_spaced_by_what_they_cost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A head's recheck at ~10% acceptance cost half a pass beyond the plain steps it
    replaced; at one per PROBE_EVERY steps auto lost 2-3% of chat decoding to them. Spaced
    to take RECHECK_SHARE of the time, they come ~50 steps apart; a drafter whose text
    turns in its favour is still back within a few rechecks."""
    def run(alpha_at: Callable[[int], float], steps: int) -> list[int]:
        rng = np.random.default_rng(0)
        policy = DraftPolicy("model", ("model",), timed(CostModel(dict(HEAD_COSTS),
                                                                  {"model": 0.0005})))
        drafted = []
        for i in range(steps):
            choice = policy.choose(FRESH)
            if choice.drafter is None:
                policy.update(choice, 0, 0, 0.010, 1, 0.010, 1)
                continue
            drafted.append(i)
            n = 0
            while n < choice.k and rng.random() < alpha_at(i):
                n += 1
            # a recheck's whole step: its pass, the lost overlap and the head catching up
            seconds = 0.005 + HEAD_COSTS[3]
            policy.update(choice, n if n == choice.k else n + 1, n, HEAD_COSTS[3],
                          choice.k + 1, seconds, n + 1)
        return drafted

    gaps = [b - a for a, b in pairwise(run(lambda i: 0.0, 600)[3:])]
    assert gaps and min(gaps) >= 50
    # a drafter that starts paying at step 600 drafts every step again within 100
    turning = run(lambda i: 0.0 if i < 600 else 0.9, 800)
    assert all(i in turning for i in range(700, 800))
    # negative control: rechecks at no cost come every PROBE_EVERY steps
    monkeypatch.setattr("engine.tuning.RECHECK_SHARE", 1e9)
    gaps = [b - a for a, b in pairwise(run(lambda i: 0.0, 600)[3:])]
    assert set(gaps) == {PROBE_EVERY}


def test_a_succeeding_drafter_gets_longer_drafts() -> None:
    policy = DraftPolicy("model", ("model",), COSTS)
    first = policy.choose(FRESH)
    for _ in range(30):
        choice = policy.choose(FRESH)
        policy.update(choice, choice.k, choice.k)
    assert policy.choose(FRESH).k > first.k


def test_lookup_drafts_between_plain_steps_do_not_hold_off_a_recheck() -> None:
    """A drafter sitting out is rechecked after PROBE_EVERY plain steps, whether or not
    prompt lookup drafted between them; no sooner after a recheck."""
    policy = DraftPolicy("auto", ("ngram", "model"), COSTS, ngram_match=ngram_match)
    policy.estimates["model"] = AcceptanceEstimate(0.0, weight=1e9)  # sits out
    choices = []
    for i in range(4 * PROBE_EVERY):
        choice = policy.choose(REPEATING if i % 2 else FRESH)
        assert choice.drafter == ("ngram" if i % 2 else None) or choice.recheck
        policy.update(choice, 0, 0)
        choices.append(choice)
    rechecks = [i for i, c in enumerate(choices) if c.recheck]
    assert all(choices[i].drafter == "model" for i in rechecks)
    # one per PROBE_EVERY plain steps: lookup's steps between them count for nothing
    assert len(rechecks) == 2 and rechecks[1] - rechecks[0] == 2 * PROBE_EVERY


def test_each_drafter_sitting_out_is_rechecked_on_its_own_schedule() -> None:
    """Layer-skip, first in line, rechecks at two passes beyond plain steps; a head at a
    sixth of one. Each keeps its own spacing: the head is looked at every PROBE_EVERY idle
    steps, layer-skip every ~200. With one shared count and price, layer-skip took every
    recheck and spaced them, and the head got none while layer-skip was not benched."""
    def rechecks(head_s: float, steps: int = 400) -> dict[str, list[int]]:
        memory = PolicyMemory()
        for name in ("layerskip", "head"):
            memory.estimates[name] = AcceptanceEstimate(0.0, weight=1e9)  # both sit out
        costs = timed(CostModel({1: 0.010, 16: 0.011}, {"layerskip": 0.001, "head": 0.0005}))
        policy = DraftPolicy("auto", ("layerskip", "head"), costs, memory=memory)
        seen: dict[str, list[int]] = {"layerskip": [], "head": []}
        for i in range(steps):
            choice = policy.choose(FRESH)
            if choice.recheck:
                seen[choice.drafter].append(i)
                seconds = 0.030 if choice.drafter == "layerskip" else head_s
                policy.update(choice, 2, 0, seconds, 3, seconds, 1)
            else:
                assert choice.drafter is None
                policy.update(choice, 0, 0, 0.010, 1, 0.010, 1)
        return seen

    seen = rechecks(0.0115)
    assert len(seen["layerskip"]) <= 3
    head_gaps = [b - a for a, b in pairwise(seen["head"])]
    assert len(seen["head"]) >= 20 and max(head_gaps) <= PROBE_EVERY + 1
    # negative control: a head whose rechecks cost what layer-skip's do is spaced as far
    costly = rechecks(0.030)
    assert min(b - a for a, b in pairwise(costly["head"])) >= 150


def test_one_slow_recheck_does_not_hold_off_the_next_for_hundreds_of_steps() -> None:
    """The head's second recheck takes 150 ms (a slow moment; the rest take 11.5 ms). The
    cheaper of its last two rechecks spaces the next, so it comes after PROBE_EVERY idle
    steps, not the ~1,400 the slow one's price would buy. A drafter whose rechecks are all
    costly is still spaced by their cost (the test above)."""
    def head_rechecks(slow: tuple[int, ...] = (2,)) -> list[int]:
        memory = PolicyMemory()
        memory.estimates["head"] = AcceptanceEstimate(0.0, weight=1e9)  # sits out
        costs = timed(CostModel({1: 0.010, 16: 0.011}, {"head": 0.0005}))
        policy = DraftPolicy("auto", ("head",), costs, memory=memory)
        seen = []
        for i in range(400):
            choice = policy.choose(FRESH)
            if choice.recheck:
                seen.append(i)
                seconds = 0.150 if len(seen) in slow else 0.0115
                policy.update(choice, 2, 0, 0.0115, 3, seconds, 1)
            else:
                policy.update(choice, 0, 0, 0.010, 1, 0.010, 1)
        return seen

    seen = head_rechecks()
    assert len(seen) >= 20 and seen[2] - seen[1] <= PROBE_EVERY + 1
    # negative control: two slow rechecks in a row hold the next off for good
    assert len(head_rechecks(slow=(2, 3))) == 3


def test_a_drafter_that_cannot_pay_even_when_right_is_never_probed() -> None:
    def probes(draft_s: float) -> int:
        policy = DraftPolicy("layerskip", ("layerskip",),
                             CostModel({1: 0.010, 16: 0.011}, {"layerskip": draft_s}))
        count = 0
        for _ in range(4 * PROBE_EVERY):
            choice = policy.choose(FRESH)
            policy.update(choice, choice.k, 0)  # every draft fails
            count += choice.drafter is not None
        return count

    # drafting one token costs more than a whole target pass: even 80% acceptance loses
    assert probes(0.030) == 0
    # negative control: a cheap drafter that fails the same way is still probed now and then
    assert probes(0.0005) >= 3


def test_what_a_policy_learned_carries_over_to_the_next_reply() -> None:
    memory = PolicyMemory()
    first = DraftPolicy("model", ("model",), COSTS, memory=memory)
    for _ in range(20):
        choice = first.choose(FRESH)
        first.update(choice, choice.k, 0)
    fresh_policy = DraftPolicy("model", ("model",), COSTS)
    next_reply = DraftPolicy("model", ("model",), COSTS, memory=memory)
    assert next_reply.estimates["model"].alpha < fresh_policy.estimates["model"].alpha
    assert next_reply.choose(FRESH).k < fresh_policy.choose(FRESH).k


# ----------------------------------------------------------------------------- a stale table

# a calibration taken before OpenBLAS (or on a busy machine): widths >= 2 priced 10x
TRUE = {1: 0.127, 2: 0.136, 3: 0.146, 4: 0.184, 8: 0.204, 16: 0.225}
STALE = {w: s * (10 if w >= 2 else 1) for w, s in TRUE.items()}


def true_cost(width: int) -> float:
    return CostModel(dict(TRUE)).verify(width)


def test_one_live_pass_of_a_wide_width_caps_every_stale_entry_below_it() -> None:
    costs = CostModel(dict(STALE))
    assert not costs.tested(1) and costs.verify(9) > 10 * true_cost(9) * 0.9
    costs.observe(1, TRUE[1])
    assert costs.tested(1) and not costs.tested(2)
    assert costs.verify(16) > 5 * TRUE[16]  # width 1 agreeing says nothing about others
    costs.observe(16, TRUE[16])  # strays from the table by far more than DRIFT_FRACTION
    assert costs.tested(2) and costs.tested(16) and not costs.tested(17)
    assert costs.verify(16) == pytest.approx(TRUE[16])
    assert all(TRUE[1] <= costs.verify(w) <= TRUE[16] for w in range(1, 17))
    assert costs.corrections == [(16, STALE[16], TRUE[16])]


def test_a_live_pass_between_calibrated_widths_corrects_the_curve_too() -> None:
    costs = CostModel(dict(STALE))
    costs.observe(7, true_cost(7))  # 7 was never calibrated: the curve said ~10x
    assert costs.corrections == [(7, pytest.approx(10 * true_cost(7)), true_cost(7))]
    assert costs.verify(4) <= costs.verify(7) == pytest.approx(true_cost(7))
    # the untested wider entries were off the same way: rescaled by the same ratio
    assert costs.verify(16) == pytest.approx(TRUE[16], rel=0.05)
    assert costs.tested(7) and not costs.tested(8)


def test_a_wide_probe_rescales_the_untested_narrower_widths_too() -> None:
    """The lag a stale table left behind: capped at the probe's width-7 timing, widths
    2-6 were priced like width 7, so short drafts stayed shut out for a whole reply."""
    costs = CostModel(dict(STALE))
    costs.observe(1, TRUE[1])
    costs.observe(7, true_cost(7))
    for w in (2, 3, 4):
        assert costs.verify(w) == pytest.approx(true_cost(w), rel=0.05), w
    # negative control: a width already timed live keeps its timing
    costs = CostModel(dict(STALE))
    costs.observe(2, STALE[2] * 0.9)  # within DRIFT_FRACTION: smoothed, now tested
    costs.observe(7, true_cost(7))
    assert costs.table()[2] > 5 * TRUE[2]
    # (a 2-row pass is then run 3 rows wide, which the rescaled table prices far lower)
    assert costs.pad_width(2) == 3 and costs.verify(2) == pytest.approx(costs.table()[3])


def test_a_slow_first_probe_is_rescaled_by_the_next_correction() -> None:
    """The demo's first probe of width 7 ran 1.4x its steady cost (CI, a stale table):
    taken whole, it set the whole table 1.4x high. The next probe's width 16, timed at its
    true cost, rescales that entry with the untested ones."""
    costs = CostModel(dict(STALE))
    costs.observe(7, 1.4 * true_cost(7))
    assert costs.table()[7] == pytest.approx(1.4 * true_cost(7))
    assert costs.verify(12) == pytest.approx(1.4 * true_cost(12))
    costs.observe(16, TRUE[16])
    assert [w for w, _, _ in costs.corrections] == [7, 16]
    assert costs.table()[7] == pytest.approx(true_cost(7), rel=0.05)
    for w in (2, 4, 7, 8, 12, 16):
        assert costs.verify(w) == pytest.approx(true_cost(w), rel=0.05), w
    # negative control: an entry smoothed from a timing near the table is live evidence,
    # and a later correction elsewhere leaves it as timed
    costs = CostModel(dict(TRUE))
    costs.observe(7, 1.2 * true_cost(7))  # within DRIFT_FRACTION: smoothed
    kept = costs.table()[7]
    costs.observe(16, TRUE[16] / 2)  # far cheaper: a correction
    assert costs.corrections[-1][0] == 16 and costs.table()[7] == kept


def test_the_passes_after_a_slow_correcting_probe_refine_the_table() -> None:
    """The first probe of width 7 ran 1.25x slow and set the whole table 1.25x high: too
    little for DRIFT_FRACTION to catch again. The next ordinary pass, width 4 at its true
    cost, brings every entry that correction set back to the truth, the probed one too."""
    slow = 1.25
    assert 1 + REFINE_FRACTION < slow < 1 + DRIFT_FRACTION
    costs = CostModel(dict(STALE))
    costs.observe(7, slow * true_cost(7))
    assert costs.table()[4] == pytest.approx(slow * TRUE[4])
    costs.observe(4, TRUE[4])
    assert [w for w, _, _ in costs.corrections] == [7, 4]
    for w in (2, 4, 7, 8, 16):
        assert costs.table()[w] == pytest.approx(TRUE.get(w, true_cost(w)), rel=0.05), w
    # negative control: with no correction before it, a fresh table's entry that a first
    # timing undercuts by as much is only smoothed (one fast pass is not a stale table)
    costs = CostModel(dict(TRUE))
    costs.observe(4, TRUE[4] / 1.25)
    assert costs.corrections == []
    assert costs.table()[4] == pytest.approx(TRUE[4] + COST_EMA * (TRUE[4] / 1.25 - TRUE[4]))


def test_an_entry_a_correction_rescaled_is_set_by_its_own_first_pass_either_way() -> None:
    """A fast moment on a shared machine (a width-16 pass at 0.7x its steady cost) corrects
    a stale table and rescales every untested entry to 0.7x. Each of those is then set by
    its own first pass, also where that pass is slower: else such moments, each rescaling
    downwards and none upwards, ratchet the untested entries far below any real pass (a
    saved table priced a 2-row pass at 0.27x a 1-row one) and the policy drafts into rows
    it takes for free."""
    costs = CostModel(dict(STALE))
    costs.observe(1, TRUE[1])
    costs.observe(16, 0.7 * TRUE[16])
    assert costs.table()[4] == pytest.approx(0.7 * TRUE[4])
    assert costs.inferred == {2, 3, 4, 8}
    costs.observe(4, TRUE[4])
    assert costs.table()[4] == pytest.approx(TRUE[4])
    assert costs.corrections[-1] == (4, pytest.approx(0.7 * TRUE[4]), TRUE[4])
    assert costs.inferred == {2, 3, 8}
    assert costs.table()[8] == pytest.approx(0.7 * TRUE[8])  # alone: no rescale upwards
    # negative control: an entry no correction set (a calibration, a live timing) is
    # only smoothed by a slower first pass, as before
    costs = CostModel({1: TRUE[1], 4: 0.7 * TRUE[4], 16: TRUE[16]})
    costs.observe(4, TRUE[4])  # 1/0.7 of the entry: clipped to SLOW_CLIP over it
    assert costs.table()[4] == pytest.approx(0.7 * TRUE[4] * (1 + COST_EMA * SLOW_CLIP))
    assert costs.corrections == [] and costs.inferred == set()


def test_after_a_fast_correction_each_width_used_once_is_priced_near_its_passes() -> None:
    """Fixed seed. A stale table corrected by a pass in a fast moment (0.75x its steady
    cost; this VM's per-pass times are bimodal, ~22 and ~29 ms) prices every untested
    width 0.75x. One use of each width, at 0.9-1.1x its steady cost, then prices it within
    15%. Negative control: with the rule before (only cheaper first timings taken whole),
    the same passes leave every one of them at most 0.82x."""
    used = [2, 3, 4, 8]

    def after_one_use(mark_inferred: bool) -> list[float]:
        rng = np.random.default_rng(7)
        costs = CostModel(dict(STALE))
        costs.observe(16, 0.75 * TRUE[16])
        if not mark_inferred:
            costs.inferred.clear()
        for w in used:
            costs.observe(w, true_cost(w) * rng.uniform(0.9, 1.1))
        return [costs.table()[w] / true_cost(w) for w in used]

    assert all(0.85 <= r <= 1.15 for r in after_one_use(True))
    assert all(r <= 0.82 for r in after_one_use(False))


def test_a_first_timing_above_the_table_is_smoothed_not_taken_whole() -> None:
    """A slow first pass may be the machine's load: an optimistic entry is corrected by the
    passes the policy keeps making at it, so one timing does not replace it."""
    costs = CostModel({1: 0.100, 8: 0.200, 16: 0.300})
    costs.observe(8, 0.600)  # and, 3x the entry, counted as SLOW_CLIP over it
    assert costs.verify(8) == pytest.approx(0.200 * (1 + COST_EMA * SLOW_CLIP))
    assert costs.verify(16) == 0.300 and costs.corrections == []
    assert costs.tested(8)


def test_a_first_timing_near_the_table_is_smoothed_not_taken_whole() -> None:
    costs = CostModel({1: 0.100, 8: 0.200})
    costs.observe(8, 0.200 * (1 + DRIFT_FRACTION * 0.9))
    assert costs.verify(8) == pytest.approx(0.200 * (1 + COST_EMA * DRIFT_FRACTION * 0.9))
    assert costs.corrections == []


def test_width_one_drift_rescales_the_curve_and_marks_other_widths_untested() -> None:
    costs = timed(CostModel(dict(TRUE)))
    assert costs.tested(16)
    for _ in range(30):  # the machine got busy: every pass now takes twice as long
        costs.observe(1, 2 * TRUE[1])
    assert costs.verify(1) == pytest.approx(2 * TRUE[1], rel=0.02)
    assert costs.verify(16) == pytest.approx(2 * TRUE[16], rel=0.25)
    assert not costs.tested(2)
    assert [c[0] for c in costs.corrections][:1] == [1]


def test_a_rescale_keeps_what_tested_widths_taught() -> None:
    costs = CostModel(dict(STALE))
    costs.observe(1, TRUE[1])
    costs.observe(16, TRUE[16])  # caps the stale widths below it
    for _ in range(30):
        costs.observe(1, 2 * TRUE[1])
    assert not costs.tested(2)
    assert all(costs.verify(w) <= 2.1 * TRUE[16] for w in range(1, 17))
    assert costs.verify(1) <= costs.verify(2)


def test_a_short_burst_of_slow_width_one_passes_does_not_rescale() -> None:
    """A busy moment (three passes at 5x) is not a lasting drift; ten of them are."""
    costs = timed(CostModel(dict(TRUE)))
    for seconds in [5 * TRUE[1]] * 3 + [TRUE[1]] * 30:
        costs.observe(1, seconds)
    assert costs.corrections == [] and costs.tested(16)
    for _ in range(10):
        costs.observe(1, 5 * TRUE[1])
    assert [w for w, _, _ in costs.corrections] == [1] and not costs.tested(2)


def test_width_one_noise_within_the_fraction_leaves_the_curve_alone() -> None:
    costs = timed(CostModel(dict(TRUE)))
    for i in range(60):  # +-20% around the table, never a sustained drift
        costs.observe(1, TRUE[1] * (1.2 if i % 2 else 0.8))
    assert costs.tested(16) and costs.corrections == []
    assert costs.verify(16) == TRUE[16]


def test_untimed_wider_widths_follow_a_width_one_drift_within_the_fraction() -> None:
    """Width 1 eases 12% (no rescale: within DRIFT_FRACTION): a 2-token pass not timed
    since is priced 12% lower too, so its ratio to width 1 stays the calibrated 1.2x; a
    width timed live keeps its timing."""
    costs = CostModel({1: 0.010, 2: 0.012, 16: 0.018})
    for _ in range(CONFIRM_TIMINGS):
        costs.observe(16, 0.018)
    assert costs.verify(2) == pytest.approx(0.012)  # negative control: no drift yet
    for _ in range(200):
        costs.observe(1, 0.0088)
    assert costs.corrections == []
    assert costs.verify(2) == pytest.approx(0.012 * 0.88, rel=0.01)
    assert costs.verify(2) / costs.verify(1) == pytest.approx(1.2, rel=0.01)
    assert costs.verify(16) == pytest.approx(0.018)


COPYING = [*range(100, 140), 7, *range(100, 120)]  # the reply copies the prompt: long matches


def run_policy(costs: CostModel, steps: int, probes: bool, monkeypatch: pytest.MonkeyPatch,
               true: dict[int, float] = TRUE,
               load: Callable[[int], float] = lambda step: 1.0,
               accepted: bool = True, untimed: Container[int] = ()) -> list[Choice]:
    """The policy on copied text, each step timed at `true` costs times the machine's
    `load` at that step (no timing at the steps in `untimed`: a pass that traced), every
    draft accepted (or, with `accepted` off, none)."""
    monkeypatch.setattr("engine.tuning.COST_PROBES", probes)
    policy = DraftPolicy("ngram", ("ngram",), costs, ngram_match=ngram_match)
    truth = CostModel(dict(true))
    choices = []
    for step in range(steps):
        choice = policy.choose(COPYING)
        n_drafted = choice.k if choice.drafter else 0
        width = n_drafted + 1
        seconds = None if step in untimed else truth.verify(width) * load(step)
        policy.update(choice, n_drafted, n_drafted if accepted else 0, seconds, width)
        choices.append(choice)
    return choices


def test_a_stale_table_is_probed_and_prompt_lookup_recovers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    choices = run_policy(CostModel(dict(STALE)), 40, True, monkeypatch)
    assert choices[0].drafter == "ngram" and choices[0].k == K_MAX  # probed at once
    assert all(c.drafter == "ngram" and c.k >= 8 for c in choices[1:])


def test_a_probe_whose_pass_went_untimed_is_retried_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first probe's pass built kernels for its shape, so it timed nothing (the CI
    failure: a stale session then ran 14 plain steps, x1.27 against x1.9): the next step
    probes again instead of waiting PROBE_EVERY steps, and drafting follows."""
    choices = run_policy(CostModel(dict(STALE)), 40, True, monkeypatch, untimed={0})
    assert choices[0].probe and choices[1].probe
    assert all(c.drafter == "ngram" and c.k >= 8 for c in choices[1:])
    # a timed probe is not repeated: the probes stay spaced
    choices = run_policy(CostModel(dict(STALE)), 40, True, monkeypatch)
    assert choices[0].probe and not any(c.probe for c in choices[1:PROBE_EVERY])


def test_without_probes_a_stale_table_locks_prompt_lookup_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the lock-out the probes exist for."""
    choices = run_policy(CostModel(dict(STALE)), 40, False, monkeypatch)
    assert all(c.drafter is None for c in choices)


def test_a_probe_timed_in_a_busy_moment_does_not_lock_prompt_lookup_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first probe's pass ran 9x slow (another app's burst), so it agreed with the 10x
    stale table; a second probe later on a quiet machine shows the table wrong."""
    def spike(step: int) -> float:
        return 9.0 if step == 0 else 1.0

    choices = run_policy(CostModel(dict(STALE)), 120, True, monkeypatch, load=spike)
    assert choices[0].probe and choices[0].k == K_MAX
    drafted = [i for i, c in enumerate(choices) if c.drafter]
    assert len(drafted) > 60 and all(c.drafter for c in choices[drafted[1]:])
    # negative control: were one timing enough to trust the table, it would stay locked
    monkeypatch.setattr("engine.tuning.CONFIRM_TIMINGS", 1)
    choices = run_policy(CostModel(dict(STALE)), 120, True, monkeypatch, load=spike)
    assert [i for i, c in enumerate(choices) if c.drafter] == [0]


def test_a_confirmed_expensive_table_gets_no_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Widths timed live that really cost 10x: prompt lookup stays off, unprobed."""
    choices = run_policy(timed(CostModel(dict(STALE))), 200, True, monkeypatch)
    assert all(c.drafter is None for c in choices)


def test_cost_probes_take_a_small_share_of_time_when_the_table_was_right(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide passes really cost 10x, and the machine's load swings 2x every 100 steps, so the
    width-1 drift keeps marking the table untested: the probes that follow (all rejected,
    the worst case) cost about PROBE_SHARE of the time, and prompt lookup never drafts
    otherwise."""
    def load(step: int) -> float:
        return 2.0 if step // 100 % 2 else 1.0

    choices = run_policy(CostModel(dict(STALE)), 600, True, monkeypatch, STALE, load,
                         accepted=False)
    probes = [i for i, c in enumerate(choices) if c.drafter]
    assert probes[0] == 0 and len(probes) >= 3  # the swings re-arm the probes
    assert all(choices[i].k == K_MAX for i in probes)
    truth = CostModel(dict(STALE))
    extra = sum((truth.verify(K_MAX + 1) - truth.verify(1)) * load(i) for i in probes[1:])
    plain = sum(truth.verify(1) * load(i) for i in range(600))
    assert extra <= 1.5 * PROBE_SHARE * plain


def test_a_model_drafter_is_probed_once_and_then_drafts_long() -> None:
    """A stale table rules out every K for a drafter that pays well; one probe at twice the
    widest tested width (1) shows the table 10x off, and the untested wider widths are
    rescaled with it: the drafter drafts long at once, timing the rest as it goes."""
    costs = CostModel(dict(STALE), {"model": 0.003})
    policy = DraftPolicy("model", ("model",), costs)
    steps = []
    for _ in range(4 * PROBE_EVERY):
        choice = policy.choose(FRESH)
        width = choice.k + 1 if choice.drafter else 1
        policy.update(choice, width - 1, width - 1, true_cost(width), width)
        steps.append((width, choice.probe))
    assert steps[0] == (3, True)
    assert [p for _, p in steps[1:]] == [False] * (len(steps) - 1)
    assert all(w > 3 for w, _ in steps[1:]) and steps[-1][0] == K_MAX + 1
    assert costs.tested(K_MAX + 1)


def test_a_drafter_failing_at_its_recent_acceptance_gets_no_cost_probes() -> None:
    """A head at T = 0.8 drafts ~10% right: even free wide passes would not make it pay, so
    timing them is a loss (auto with the demo's head ran x0.96 of plain on chat, its cost
    probes the largest part). A drafter whose record says it would pay is still probed."""
    def probed(acceptance: float) -> int:
        costs = CostModel(dict(STALE), {"model": 0.003})
        policy = DraftPolicy("model", ("model",), costs)
        policy.estimates["model"] = AcceptanceEstimate(acceptance, weight=40.0)
        return sum(policy.choose(FRESH).probe for _ in range(PROBE_EVERY))

    assert probed(0.1) == 0
    assert probed(0.5) == 1  # negative control: the same stale table, a drafter that pays


def test_a_lookup_guess_that_could_not_pay_gets_no_cost_probes() -> None:
    """At T = 0.8 without a head, prompt lookup's one-token matches guess the pending token
    ~10% right: from pending logits (whose overlap a draft gives up) even free wide passes
    would not pay, yet probing them cost ~4% of chat (auto x0.94, x0.98 without probes).
    A match length whose record says it would pay is still probed, and so is the same
    poor guess after a verify pass, where no overlap is lost."""
    def probed(acceptance: float, pending: bool) -> int:
        costs = CostModel(dict(STALE), overlap_s=0.2 * STALE[1])
        policy = DraftPolicy("ngram", ("ngram",), costs, ngram_match=ngram_match)
        policy.estimates["ngram1"] = AcceptanceEstimate(acceptance, weight=40.0)
        choice = policy.choose([*REPEATING, 99, 6], pending)  # a one-token match: "6"
        assert choice.estimate == "ngram1" or choice.drafter is None
        return int(choice.probe)

    assert probed(0.1, pending=True) == 0
    assert probed(0.25, pending=True) == 0
    assert probed(0.7, pending=True) == 1  # negative control: a guess that would pay
    assert probed(0.25, pending=False) == 1  # ... or no overlap to lose


def test_cost_probes_stop_at_the_depth_a_drafter_reaches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A head right a third of the time reaches its fourth draft 1% of the time: probing
    widths past that times passes it will never run (the demo's head was probed at 16)."""
    assert useful_depth(0.33) == 3 and useful_depth(0.8) == 14
    assert useful_depth(0.0) == 1 and useful_depth(0.99) == K_MAX

    def probed(alpha: float) -> list[int]:
        memory = PolicyMemory()
        memory.estimates["model"] = AcceptanceEstimate(alpha, weight=1e9)
        policy = DraftPolicy("model", ("model",), CostModel(dict(STALE), {"model": 0.0005}),
                             memory=memory)
        ks = []
        for _ in range(40 * PROBE_EVERY):
            choice = policy.choose(FRESH)
            width = choice.k + 1 if choice.drafter else 1
            policy.update(choice, 1 if choice.drafter else 0, 0, true_cost(width), width)
            if choice.probe:
                ks.append(choice.k)
        return ks

    assert probed(0.33) and max(probed(0.33)) <= 3
    # negative control: probing as deep as the drafter may draft
    monkeypatch.setattr("engine.tuning.USEFUL_REACH", 1e-9)
    assert max(probed(0.33)) > 3


def test_without_probes_the_model_drafter_stays_locked_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("engine.tuning.COST_PROBES", False)
    policy = DraftPolicy("model", ("model",), CostModel(dict(STALE), {"model": 0.003}))
    choices = []
    for _ in range(4 * PROBE_EVERY):
        choice = policy.choose(FRESH)
        policy.update(choice, choice.k, choice.k, true_cost(choice.k + 1), choice.k + 1)
        choices.append(choice)
    assert all(c.drafter is None for c in choices)


# ---------------------------------------------------------------- the margin a record earns

# a 2-row pass costs 1.18x a 1-row one, as on this project's CPU; a head step 5% of a pass
HEAD_COSTS = {1: 0.010, 2: 0.0118, 3: 0.0128, 4: 0.0135, 8: 0.015, 16: 0.018}


def simulate_head(alpha: float, hidden_s: float = 0.0, steps: int = 1500,
                  seed: int = 0) -> tuple[float, int]:
    """Tokens per second of a session drafting with a 'head' whose tokens are each accepted
    with probability `alpha`, and how many of its steps drafted. `hidden_s`: what every
    drafting step costs beyond the cost model's view (the margin's reason to exist)."""
    rng = np.random.default_rng(seed)
    costs = timed(CostModel(dict(HEAD_COSTS), {"head": 0.0005}))
    truth = CostModel(dict(HEAD_COSTS))
    memory = PolicyMemory()
    memory.estimates["head"] = AcceptanceEstimate(alpha)  # its held-out agreement
    policy = DraftPolicy("auto", ("head",), costs, memory=memory)
    seconds, tokens, drafting, pending = 0.0, 0, 0, True
    for _ in range(steps):
        choice = policy.choose(FRESH, pending)
        if choice.drafter is None:
            step = truth.verify(1)
            policy.update(choice, 0, 0, step, 1, step, 1)
            seconds, tokens, pending = seconds + step, tokens + 1, True
            continue
        drafting += 1
        n = 0
        while n < choice.k and rng.random() < alpha:
            n += 1
        step = choice.k * 0.0005 + truth.verify(choice.k + 1) + hidden_s
        n_branch = n if n == choice.k else n + 1
        policy.update(choice, n_branch, n, step - hidden_s, choice.k + 1, step, n + 1)
        seconds, tokens, pending = seconds + step, tokens + n + 1, False
    return tokens / seconds, drafting


def timed_steps(memory: PolicyMemory, name: str, factor: float, n: int) -> None:
    """`n` steps of drafter `name` timed at `factor` times the model's price."""
    for _ in range(n):
        memory.overheads.setdefault(name, StepOverhead()).add(factor * 0.010, 0.010)


def head_policy(alpha: float) -> DraftPolicy:
    memory = PolicyMemory()
    memory.estimates["head"] = AcceptanceEstimate(alpha, weight=1e9)  # held at alpha
    costs = timed(CostModel(dict(HEAD_COSTS), {"head": 0.0005}))
    return DraftPolicy("auto", ("head",), costs, memory=memory)


def test_a_drafter_gaining_less_than_the_margin_drafts_once_its_steps_are_timed() -> None:
    """At 40% acceptance the model gives the head ~1.14x: under DRAFT_MARGIN until its
    steps have been timed against the model's price; then the model prices what it could
    not see, and PROVEN_MARGIN is enough."""
    policy = head_policy(0.4)
    assert policy._overhead("head") == (1.0, DRAFT_MARGIN)
    assert policy.choose(FRESH).drafter is None  # negative control: untimed
    timed_steps(policy.memory, "head", 1.02, OVERHEAD_MIN_STEPS - 1)
    assert policy.choose(FRESH).drafter is None  # one timing short
    timed_steps(policy.memory, "head", 1.02, 1)
    assert policy._overhead("head") == (pytest.approx(1.02), PROVEN_MARGIN)
    choice = policy.choose(FRESH)
    assert choice.drafter == "head" and choice.k in (1, 2)


def test_a_drafter_whose_steps_take_more_than_priced_stays_out() -> None:
    """The same head, its steps timed at 1.3x their price (work the model cannot see):
    with that factor the model says it loses; at 60% acceptance it pays even so."""
    policy = head_policy(0.4)
    timed_steps(policy.memory, "head", 1.3, OVERHEAD_MIN_STEPS)
    assert policy._overhead("head")[0] == pytest.approx(1.3)
    assert policy.choose(FRESH).drafter is None
    policy.memory.estimates["head"] = AcceptanceEstimate(0.6, weight=1e9)
    assert policy.choose(FRESH).drafter == "head"


def test_where_lookup_copies_its_draft_stands_over_a_head(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A head whose estimate outranks lookup's still gives way where lookup matched
    COPY_MATCH tokens and would draft; it drafts where lookup matched one token, matched
    nothing, or would not draft."""
    memory = PolicyMemory()
    memory.estimates["head"] = AcceptanceEstimate(0.9, weight=1e9)
    timed_steps(memory, "head", 1.0, OVERHEAD_MIN_STEPS)
    costs = timed(CostModel(dict(HEAD_COSTS), {"head": 0.0005, "ngram": 0.0}))
    policy = DraftPolicy("auto", ("head", "ngram"), costs, ngram_match=ngram_match,
                         memory=memory)
    one_token = [1, 2, 3, 4, 1]  # only the suffix (1,) was seen before
    assert ngram_match(REPEATING, K_MAX)[1] >= COPY_MATCH > ngram_match(one_token, K_MAX)[1]
    assert policy.choose(REPEATING).drafter == "ngram"
    assert policy.choose(one_token).drafter == "head"
    assert policy.choose(FRESH).drafter == "head"
    policy.estimates["ngram4"] = AcceptanceEstimate(0.01, weight=1e9)  # copies failing here
    assert policy.choose(REPEATING).drafter == "head"
    # negative control: weighed like any drafter, the head's estimate wins the copy
    del policy.estimates["ngram4"]
    assert policy.choose(REPEATING).drafter == "ngram"
    monkeypatch.setattr(tuning, "COPY_MATCH", 10**6)
    assert policy.choose(REPEATING).drafter == "head"


def test_update_times_each_drafting_step_against_its_price() -> None:
    policy = head_policy(0.4)
    policy.update(Choice(None, 0), 0, 0, 0.012, 1, 0.012, 1)
    assert "none" not in policy.memory.overheads  # plain steps are the width-1 price
    policy.update(Choice("head", 2, "head"), 3, 1, 0.0128, 3, 0.0143, 2)
    assert policy.memory.overheads["head"].factor == pytest.approx(0.0143 / (0.0128 + 0.001))


def test_slow_passes_are_the_tables_to_learn_not_the_drafters_factor() -> None:
    """A head's first steps whose passes run 1.4x the table's price (its widths not yet
    corrected by live timings) while its drafting takes what it was priced at: the table
    learns the passes, and the overhead factor, which prices only what the table cannot
    see, stays at 1, so the head keeps drafting. Negative control: its passes under a
    pinned K, where the table learns nothing, count whole in the factor."""
    def steps(policy: DraftPolicy) -> None:
        for _ in range(6):
            price = policy.costs.verify(3, 3)
            draft = 2 * policy.costs.draft_s["head"]
            policy.update(Choice("head", 2, "head"), 3, 1, 1.4 * price, 3,
                          1.4 * price + draft, 2)

    policy = head_policy(0.4)
    table_before = policy.costs.verify(3, 3)
    steps(policy)
    assert policy.costs.verify(3, 3) > 1.15 * table_before  # the table learned the passes
    assert policy.memory.overheads["head"].factor == pytest.approx(1.0)
    assert policy.choose(FRESH).drafter == "head"
    pinned = head_policy(0.4)
    pinned.fixed_k = 2
    steps(pinned)
    assert pinned.memory.overheads["head"].factor > 1.3


def test_a_catch_up_prices_the_recheck_not_the_drafters_steps() -> None:
    """A recheck whose head first caught up on 100 plain steps' positions: its step, timed
    at its price, leaves the overhead factor at 1 and the realized record at the step's
    own time; the recheck's price (which spaces the next one) counts the catch-up too."""
    policy = head_policy(0.4)
    priced = policy.costs.verify(3, 3) + 2 * policy.costs.draft_s["head"]
    policy.update(Choice("head", 2, "head", recheck=True), 2, 1, None, 3, priced, 2, 0.02)
    assert policy.memory.overheads["head"].factor == pytest.approx(1.0)
    unit = policy.costs.verify(1)
    assert policy.realized["head"].passes_per_token == pytest.approx(priced / unit / 2)
    assert policy.memory.recheck_extra["head"] == pytest.approx((priced + 0.02 - 2 * unit,))


def test_realized_speed_is_seconds_over_tokens_not_a_mean_of_ratios() -> None:
    """Steps of equal seconds and 1 or 3 tokens: 2 tokens a step on average, so half the
    seconds per token, where a mean of the steps' ratios says 2/3."""
    speed = RealizedSpeed()
    for i in range(40):
        speed.add(1.0, 1 if i % 2 else 3)
    assert speed.passes_per_token == pytest.approx(0.5, rel=0.06)


def test_the_guard_benches_a_drafter_whose_steps_lose_to_plain_ones() -> None:
    def policy_after(head_tokens: int) -> DraftPolicy:
        policy = head_policy(0.9)
        for _ in range(GUARD_MIN_STEPS):
            policy.update(Choice(None, 0), 0, 0, None, None, 0.010, 1)
            policy.update(Choice("head", 2, "head"), 2, 2, None, None, 0.014, head_tokens)
        return policy

    assert policy_after(1).choose(FRESH).drafter is None  # 14 ms a token against 10
    assert policy_after(2).choose(FRESH).drafter == "head"  # negative control: 7 ms


@pytest.mark.parametrize("seed", range(3))
def test_a_session_with_a_paying_head_drafts_and_one_with_hidden_costs_keeps_plain_speed(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end over 1,500 simulated steps: a head at 60% acceptance runs >1.3x plain;
    at 50% with 4 ms a step the model cannot see it would lose, and the session stays
    within 3% of plain speed."""
    plain = 1.0 / HEAD_COSTS[1]
    assert simulate_head(0.6, seed=seed)[0] > 1.3 * plain
    assert simulate_head(0.5, hidden_s=0.004, seed=seed)[0] > 0.97 * plain
    # negative control: no margin, no timing of steps, no guard: the hidden cost loses
    monkeypatch.setattr("engine.tuning.DRAFT_MARGIN", 0.0)
    monkeypatch.setattr("engine.tuning.OVERHEAD_MIN_STEPS", 10**9)
    monkeypatch.setattr("engine.tuning.GUARD_MIN_STEPS", 10**9)
    assert simulate_head(0.5, hidden_s=0.004, seed=seed)[0] < 0.97 * plain


def test_a_benched_drafter_gets_a_fresh_record_after_the_retry_span() -> None:
    """Benched after losing, the head sits out GUARD_RETRY steps, then drafts again on a
    fresh record: the old one would bench it again before it took a step."""
    policy = head_policy(0.9)
    for _ in range(GUARD_MIN_STEPS):
        policy.update(Choice(None, 0), 0, 0, None, None, 0.010, 1)
        policy.update(Choice("head", 2, "head"), 2, 2, None, None, 0.014, 1)
    waited = 0
    while policy.choose(FRESH).drafter is None and waited <= GUARD_RETRY:
        waited += 1
    assert GUARD_RETRY - 2 <= waited < GUARD_RETRY + 1
    assert "head" not in policy.realized  # a fresh record


def test_benches_in_a_row_double_and_a_won_place_clears_them() -> None:
    """A head that keeps losing sits out 128, 256, 512, then 1,024 steps at most between
    its 32-step retries; one that wins for GUARD_CLEAR_STEPS on a fresh record starts from
    GUARD_RETRY again, so a later false bench (a slow moment) costs one reply, not eight.
    Negative control: without the clear, that bench costs the doubled span."""
    def waits(head_tokens: list[int], clear: int = GUARD_CLEAR_STEPS) -> list[int]:
        """Steps sat out after each bench; each retry's steps give `head_tokens[i]`
        tokens (2 wins, 1 loses: it drafts until benched)."""
        policy, out = head_policy(0.9), []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("engine.tuning.GUARD_CLEAR_STEPS", clear)
            for tokens in head_tokens:
                for _ in range(GUARD_CLEAR_STEPS if tokens == 2 else 10 * GUARD_MIN_STEPS):
                    policy.memory.steps += 1
                    policy.update(Choice(None, 0), 0, 0, None, None, 0.010, 1)
                    policy.update(Choice("head", 2, "head"), 2, 2, None, None, 0.014, tokens)
                    if policy._is_benched("head"):
                        break
                waited = 0
                while policy._is_benched("head"):
                    policy.memory.steps += 1
                    waited += 1
                out.append(waited)
        return out

    assert waits([1] * 6) == [128, 256, 512, 1024, 1024, 1024]  # 14 ms a token against 10
    # losing twice, then winning on a fresh record, then one losing moment
    assert waits([1, 1, 2, 1]) == [128, 256, 0, 128]
    assert waits([1, 1, 2, 1], clear=10**9) == [128, 256, 0, 512]


def test_one_slow_pass_does_not_price_a_paying_head_out() -> None:
    """On a shared machine ~1 pass in 10 runs 1.5-2x slow at any width. One such pass at
    each width the head drafts at must not raise their prices enough to stop the head (it
    then stays off: nothing re-times those widths); a lasting slowdown is still followed.
    Negative control: unclipped, the same passes stop the head."""
    def after_one_slow_pass(clip: float) -> DraftPolicy:
        policy = head_policy(0.4)  # ~1.14x plain by the model
        timed_steps(policy.memory, "head", 1.0, OVERHEAD_MIN_STEPS)
        assert policy.choose(FRESH).drafter == "head"
        costs = policy.costs
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("engine.tuning.SLOW_CLIP", clip)
            for width in (2, 3, 4):  # one slow pass at each width it drafts at
                costs.observe(width, 2.0 * costs.verify(width))
        return policy

    policy = after_one_slow_pass(SLOW_CLIP)
    assert policy.choose(FRESH).drafter == "head"
    assert after_one_slow_pass(float("inf")).choose(FRESH).drafter is None
    # a lasting slowdown of one width: followed to within 10% in 12 timings
    costs = CostModel(dict(HEAD_COSTS))
    for _ in range(12):
        costs.observe(4, 2 * HEAD_COSTS[4])
    assert costs.table()[4] == pytest.approx(2 * HEAD_COSTS[4], rel=0.10)


def test_the_guard_judges_a_drafter_only_on_a_fresh_record() -> None:
    """The head won its steps (7 ms a token against plain's 10), then sat out plain steps
    that ran in a fast moment (5 ms a token). Its frozen record says nothing of now: it is
    not benched. Negative control: judged on the stale record, it is."""
    def after_fast_plain_moment(fresh: int) -> bool:
        policy = head_policy(0.9)
        for _ in range(GUARD_MIN_STEPS):
            policy.memory.steps += 1
            policy.update(Choice(None, 0), 0, 0, None, None, 0.010, 1)
            policy.update(Choice("head", 2, "head"), 2, 2, None, None, 0.014, 2)
        for _ in range(40):
            policy.memory.steps += 1
            policy.update(Choice(None, 0), 0, 0, None, None, 0.005, 1)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("engine.tuning.GUARD_FRESH", fresh)
            return policy._is_benched("head")

    assert after_fast_plain_moment(GUARD_FRESH) is False
    assert after_fast_plain_moment(10**9) is True


def test_the_guard_compares_a_slow_stretch_with_a_quiet_one_in_passes_of_each() -> None:
    """The head drafts through a slow stretch (every pass 1.5x) at 0.85x plain's time a
    token there, then sits out quiet plain steps, then rechecks once: it won, and is not
    benched. Negative control: the same steps' records in seconds bench it."""
    policy = head_policy(0.9)
    raw = {"head": RealizedSpeed(), "none": RealizedSpeed()}  # the same steps in seconds

    def step(choice: Choice, seconds: float, tokens: int, width: int) -> None:
        policy.memory.steps += 1
        name = choice.drafter or "none"
        raw[name].add(seconds, tokens)
        raw[name].last_step = policy.memory.steps
        policy.update(choice, 2 if choice.drafter else 0, tokens - 1, seconds, width,
                      seconds, tokens)

    head = Choice("head", 2, "head")
    for _ in range(GUARD_MIN_STEPS + 8):  # slow: plain 15 ms a token, the head 12.75
        step(Choice(None, 0), 0.015, 1, 1)
        step(head, 0.0255, 2, 3)
    for _ in range(40):  # quiet plain steps, 10 ms
        step(Choice(None, 0), 0.010, 1, 1)
    step(head, 0.017, 2, 3)  # a recheck in the quiet: 8.5 ms a token
    assert raw["head"].passes_per_token > raw["none"].passes_per_token * (1 + GUARD_SLACK)
    assert policy.realized["head"].passes_per_token < policy.realized["none"].passes_per_token
    assert policy._is_benched("head") is False


def test_two_slow_steps_do_not_price_a_paying_head_out_but_a_lasting_cost_does() -> None:
    """A head's steps timed at their price, then two at 2x (a slow moment on a shared
    machine): it still drafts, since a step counts at most SLOW_CLIP over the factor so
    far. Steps lastingly 1.5x their price still raise the factor to it. Negative control:
    unclipped, the same two steps stop the head, and nothing but its own steps (now
    rechecks, every 16 steps or more) would move that factor back."""
    def step(policy: DraftPolicy, factor: float) -> None:
        priced = policy.costs.verify(3, 3) + 2 * policy.costs.draft_s["head"]
        policy.update(Choice("head", 2, "head"), 3, 1, None, 3, factor * priced, 2)

    def after_slow_moment(clip: float) -> DraftPolicy:
        policy = head_policy(0.4)  # ~1.14x plain by the model
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("engine.tuning.SLOW_CLIP", clip)
            for factor in [1.0] * 10 + [2.0] * 2:
                step(policy, factor)
        return policy

    assert after_slow_moment(SLOW_CLIP).choose(FRESH).drafter == "head"
    assert after_slow_moment(float("inf")).choose(FRESH).drafter is None
    policy = head_policy(0.4)
    for _ in range(20):
        step(policy, 1.5)
    assert policy.memory.overheads["head"].factor == pytest.approx(1.5, rel=0.05)
    assert policy.choose(FRESH).drafter is None
