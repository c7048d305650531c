"""Choosing K: the expected-tokens formula, the cost model, the acceptance estimate, the
per-step policy, and calibration cached in the app-data dir."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from engine.drafters.ngram import NgramDrafter
from engine.loading import load_model
from engine.paths import cache_dir
from engine.tuning import (
    CALIBRATION_WIDTHS,
    COST_EMA,
    K_MAX,
    PROBE_EVERY,
    AcceptanceEstimate,
    Choice,
    CostModel,
    DraftPolicy,
    PolicyMemory,
    best_k,
    expected_tokens,
    load_or_measure_costs,
    measure_costs,
)
from tests.fixtures.tiny_models import write_tiny_pair

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
    costs.observe(4, 9.0)  # the running cost moves a COST_EMA step towards 9.0
    assert costs.verify(4) == pytest.approx(4.0 + COST_EMA * 5.0)
    assert costs.verify(2) == pytest.approx(1.0 + (3.0 + COST_EMA * 5.0) / 3)
    assert costs.verify(40) > costs.verify(16) > costs.verify(4)  # past the cached widths


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
COSTS = CostModel({1: 0.010, 16: 0.011}, {"ngram": 0.0, "model": 0.001, "layerskip": 0.001})


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


def test_a_succeeding_drafter_gets_longer_drafts() -> None:
    policy = DraftPolicy("model", ("model",), COSTS)
    first = policy.choose(FRESH)
    for _ in range(30):
        choice = policy.choose(FRESH)
        policy.update(choice, choice.k, choice.k)
    assert policy.choose(FRESH).k > first.k


# ----------------------------------------------------------------------------- calibration


def test_calibration_is_measured_once_per_key_and_cached_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path))
    calls: list[str] = []

    def measure(tag: str) -> CostModel:
        calls.append(tag)
        return CostModel({1: 0.01, 2: 0.02}, {"ngram": 0.0, "model": 0.003})

    first = load_or_measure_costs("target|draft|cpu", lambda: measure("a"))
    again = load_or_measure_costs("target|draft|cpu", lambda: measure("b"))
    other = load_or_measure_costs("target|-|cpu", lambda: measure("c"))
    assert calls == ["a", "c"]
    assert again == first == CostModel({1: 0.01, 2: 0.02}, {"ngram": 0.0, "model": 0.003})
    assert other == first
    path = cache_dir() / "calibration.json"
    assert path.parent.parent == tmp_path
    assert set(json.loads(path.read_text())) == {"target|draft|cpu", "target|-|cpu"}


def test_a_corrupt_calibration_file_is_measured_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path))
    (cache_dir() / "calibration.json").write_text("{not json")
    costs = load_or_measure_costs("k", lambda: CostModel({1: 0.5}))
    assert costs == CostModel({1: 0.5})
    assert json.loads((cache_dir() / "calibration.json").read_text())["k"]["verify_s"] == {
        "1": 0.5}


def test_measure_costs_on_a_tiny_pair(tmp_path: Path) -> None:
    target, draft = write_tiny_pair(tmp_path)
    tgt, dft = load_model(str(target)).model, load_model(str(draft)).model
    costs = measure_costs(tgt, dft, layerskip_layers=1, context=16, reps=2)
    assert sorted(costs.verify_s) == sorted(CALIBRATION_WIDTHS)
    assert all(s > 0 for s in costs.verify_s.values())
    assert costs.draft_s["ngram"] == 0.0
    assert costs.draft_s["model"] > 0 and costs.draft_s["layerskip"] > 0


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
