"""Acceptance estimator: recover known per-position rates from synthetic histograms.

Ground truth: per-position conditional acceptance rates; each request accepts draft i
with probability alpha_i given it accepted drafts < i, and stops at its first
rejection or at ``steps``. Histograms are drawn from that exact distribution with a
seeded generator. Tolerances are stated per test (binomial noise of the sample sizes
used is below a third of each tolerance).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
import pytest

from specgov.policies.common.codec import to_data
from specgov.policies.common.types import PolicyTypeError, TierStat, TierStatsSnapshot
from specgov.policies.daemon.estimators.acceptance import (
    AcceptanceConfig,
    AcceptanceEstimate,
    AcceptanceState,
    SlotAcceptance,
    acceptance_estimate,
    initial_acceptance_state,
    update_acceptance,
)
from specgov.simulator.engine.acceptance import PROFILES

# REFERENCE.md §3, EAGLE-3 on Llama-3.1-8B: instructcoder (code) and sharegpt (chat);
# n-gram drafter on the same: instructcoder and sharegpt.
CODE = (0.72, 0.73, 0.75, 0.78, 0.80, 0.82, 0.82)
CHAT = (0.69, 0.66, 0.69, 0.73, 0.76, 0.79, 0.80)
NGRAM_CODE = (0.65, 0.93, 0.94, 0.95, 0.95, 0.96, 0.96)
NGRAM_CHAT = (0.35, 0.84, 0.87, 0.90, 0.91, 0.92, 0.92)


def accepted_distribution(rates: Sequence[float], steps: int) -> list[float]:
    """P(exactly j drafts accepted), j = 0..steps."""
    probs = []
    reach = 1.0
    for j in range(steps):
        probs.append(reach * (1.0 - rates[j]))
        reach *= rates[j]
    probs.append(reach)
    return probs


def tier(
    rng: np.random.Generator, slot: int, steps: int, requests: int, rates: Sequence[float]
) -> TierStat:
    hist = tuple(int(h) for h in rng.multinomial(requests, accepted_distribution(rates, steps)))
    verifies = max(1, requests // max(slot, 1))
    return TierStat(
        slot=slot,
        steps=steps,
        verify_calls=verifies,
        requests=requests,
        accepted_hist=hist,
        step_time_sum_s=0.01 * verifies,
        step_time_count=verifies,
        batch_size_sum=requests,
    )


def snap(start_s: float, end_s: float, *tiers: TierStat) -> TierStatsSnapshot:
    return TierStatsSnapshot(window_start_s=start_s, window_end_s=end_s, tiers=tuple(tiers))


def run(
    state: AcceptanceState,
    cfg: AcceptanceConfig,
    rng: np.random.Generator,
    windows: int,
    start_s: float,
    tiers: Sequence[tuple[int, int, int, Sequence[float]]],
) -> AcceptanceState:
    """Feed ``windows`` one-second windows of (slot, steps, requests, rates) tiers."""
    for w in range(windows):
        t0 = start_s + w
        made = [tier(rng, slot, steps, n, rates) for slot, steps, n, rates in tiers]
        state = update_acceptance(state, snap(t0, t0 + 1.0, *made), cfg)
    return state


CFG = AcceptanceConfig()


def test_recovers_true_rates_at_full_depth() -> None:
    # 30 windows x 2000 requests at steps=7: position 7 is reached by ~ 15 % of them,
    # so its decayed trials exceed 4000; tolerance 0.02 (binomial sd < 0.007).
    rng = np.random.default_rng(1)
    state = run(initial_acceptance_state([1], CFG), CFG, rng, 30, 0.0, [(1, 7, 2000, CODE)])
    est = acceptance_estimate(state, 1, CFG)
    assert est.observed == 7
    for i, (m, truth) in enumerate(zip(est.mean, CODE, strict=True)):
        assert m == pytest.approx(truth, abs=0.02), f"position {i + 1}"
        assert est.lower[i] <= m
    # The bound is tight with this much data, loose with little.
    assert max(m - lo for m, lo in zip(est.mean, est.lower, strict=True)) < 0.03


def test_censoring_positions_beyond_steps_get_no_evidence() -> None:
    # steps=3 only: a request that accepted all 3 says nothing about position 4.
    rng = np.random.default_rng(2)
    state = run(initial_acceptance_state([1], CFG), CFG, rng, 20, 0.0, [(1, 3, 3000, CHAT)])
    est = acceptance_estimate(state, 1, CFG)
    assert est.observed == 3
    assert est.trials[3:] == (0.0,) * 4
    for i in range(3):
        assert est.mean[i] == pytest.approx(CHAT[i], abs=0.02)
    # Trials are those that reached each position: position 2 is reached only by the
    # ~69 % that passed position 1 (a naive count of all requests would be wrong).
    assert est.trials[1] / est.trials[0] == pytest.approx(CHAT[0], abs=0.02)
    # Extrapolated positions are never above the last observed lower bound.
    for i in range(3, 7):
        assert est.mean[i] <= est.lower[2] + 1e-12
        assert est.lower[i] <= est.mean[i]


def test_mixed_steps_in_one_slot_combine_without_bias() -> None:
    # Tiers at steps 1, 3 and 5 in one window: position i is estimated only from the
    # tiers that drafted it; rates are recovered for positions 1..5 within 0.025.
    rng = np.random.default_rng(3)
    tiers = [(8, 1, 1500, NGRAM_CHAT), (8, 3, 1500, NGRAM_CHAT), (8, 5, 1500, NGRAM_CHAT)]
    state = run(initial_acceptance_state([8], CFG), CFG, rng, 20, 0.0, tiers)
    est = acceptance_estimate(state, 8, CFG)
    assert est.observed == 5
    for i in range(5):
        assert est.mean[i] == pytest.approx(NGRAM_CHAT[i], abs=0.025), f"position {i + 1}"


def test_unobserved_positions_use_the_prior_and_stay_conservative() -> None:
    est = acceptance_estimate(initial_acceptance_state([1], CFG), 1, CFG)
    assert est.observed == 0
    assert all(m == pytest.approx(CFG.prior_mean) for m in est.mean)
    # Two pseudo-trials: the conservative bound is far below the mean.
    assert all(lo < 0.4 * m for lo, m in zip(est.lower, est.mean, strict=True))
    assert est.expected_accept_length(3, conservative=True) < est.expected_accept_length(3)


def test_sparse_slot_shrinks_to_pooled_but_rich_slot_keeps_its_own() -> None:
    # Slot 1 sees lots of code traffic, slot 8 lots of n-gram-like content (different
    # rates); slot 64 only 5 requests of content with far lower rates.
    rng = np.random.default_rng(4)
    low = (0.3,) * 7
    state = initial_acceptance_state([1, 8, 64], CFG)
    rich_tiers = [(1, 5, 3000, CODE), (8, 5, 3000, NGRAM_CODE)]
    state = run(state, CFG, rng, 20, 0.0, rich_tiers)
    state = run(state, CFG, rng, 1, 20.0, [*rich_tiers, (64, 5, 5, low)])
    pooled_first = (CODE[0] + NGRAM_CODE[0]) / 2
    rich = acceptance_estimate(state, 8, CFG)
    sparse = acceptance_estimate(state, 64, CFG)
    unseen = acceptance_estimate(state, 32, CFG)
    assert rich.mean[1] == pytest.approx(NGRAM_CODE[1], abs=0.02)
    # Sparse slot: closer to the pooled estimate than to its own 0.3.
    assert abs(sparse.mean[0] - pooled_first) < abs(sparse.mean[0] - 0.3)
    # A slot never seen gets the pooled estimate (close to the traffic-weighted mean).
    assert unseen.mean[0] == pytest.approx(pooled_first, abs=0.03)
    assert unseen.trials == (0.0,) * 7


def test_forgetting_is_time_based_and_duplicate_windows_are_ignored() -> None:
    cfg = AcceptanceConfig(half_life_s=10.0, change_z=50.0)  # detector effectively off
    rng = np.random.default_rng(5)
    state = run(initial_acceptance_state([1], cfg), cfg, rng, 1, 0.0, [(1, 1, 1000, CODE)])
    before = state.slots[0].reached[0]
    assert before == 1000.0
    # The same snapshot again (telemetry not refreshed) changes nothing.
    again = update_acceptance(state, snap(0.0, 1.0, tier(rng, 1, 1, 1000, CODE)), cfg)
    assert again == state
    # An empty window 10 s later halves the evidence: exactly one half-life.
    later = update_acceptance(state, snap(1.0, 11.0), cfg)
    assert later.slots[0].reached[0] == pytest.approx(before / 2)


@pytest.mark.parametrize(
    ("before", "after", "requests"),
    [(NGRAM_CODE, NGRAM_CHAT, 300), (CODE, CHAT, 4000)],
    ids=["ngram-code-to-chat", "eagle3-code-to-chat"],
)
def test_content_shift_is_detected_within_a_few_windows(
    before: tuple[float, ...], after: tuple[float, ...], requests: int
) -> None:
    # 120 s of one content, then a switch. Requirement: the shift is detected within
    # 5 one-second windows, and 8 windows after it every observed position is within
    # 0.04 of the new truth, whereas without the detector (a 60 s half-life alone) the
    # estimate still sits far off.
    rng = np.random.default_rng(6)
    tiers_before = [(1, 5, requests, before)]
    tiers_after = [(1, 5, requests, after)]
    state = run(initial_acceptance_state([1], CFG), CFG, rng, 120, 0.0, tiers_before)
    assert state.total_changes == 0  # no false alarm on stationary data
    detected_at = None
    for w in range(8):
        state = run(state, CFG, rng, 1, 120.0 + w, tiers_after)
        if detected_at is None and state.total_changes > 0:
            detected_at = w + 1
    assert detected_at is not None and detected_at <= 5
    est = acceptance_estimate(state, 1, CFG)
    errors = [abs(est.mean[i] - after[i]) for i in range(5)]
    assert max(errors) < 0.04, errors

    no_detect = AcceptanceConfig(change_z=1e6)
    rng = np.random.default_rng(6)
    lagging = run(initial_acceptance_state([1], no_detect), no_detect, rng, 120, 0.0, tiers_before)
    lagging = run(lagging, no_detect, rng, 8, 120.0, tiers_after)
    lag_est = acceptance_estimate(lagging, 1, no_detect)
    lag_error = max(abs(lag_est.mean[i] - after[i]) for i in range(5))
    assert lag_error > 2 * max(errors)


def test_no_false_alarms_on_a_long_stationary_stream() -> None:
    rng = np.random.default_rng(7)
    tiers = [(1, 3, 80, CODE), (8, 3, 600, CODE), (32, 1, 2000, CODE)]
    state = run(initial_acceptance_state([1, 8, 32], CFG), CFG, rng, 300, 0.0, tiers)
    assert state.total_changes == 0


def test_expected_accept_length_matches_closed_form() -> None:
    alpha = 0.7
    est = AcceptanceEstimate(slot=1, mean=(alpha,) * 7, lower=(0.5,) * 7, trials=(0.0,) * 7)
    for k in range(10):
        closed = (1 - alpha ** (k + 1)) / (1 - alpha)
        assert est.expected_accept_length(k) == pytest.approx(closed)
    assert est.expected_accept_length(0) == 1.0
    assert est.expected_accept_length(2, conservative=True) == pytest.approx(1 + 0.5 + 0.25)
    with pytest.raises(PolicyTypeError, match="steps"):
        est.expected_accept_length(-1)


def test_new_slots_are_added_and_max_steps_is_respected() -> None:
    cfg = AcceptanceConfig(max_steps=3)
    rng = np.random.default_rng(8)
    state = run(initial_acceptance_state([], cfg), cfg, rng, 3, 0.0, [(4, 5, 500, CODE)])
    assert [s.slot for s in state.slots] == [4]
    est = acceptance_estimate(state, 4, cfg)
    assert len(est.mean) == 3
    assert est.observed == 3
    # Beyond max_steps the last (conservative) rate repeats.
    assert est.expected_accept_length(5) > est.expected_accept_length(3)


def test_state_round_trips_through_json() -> None:
    rng = np.random.default_rng(9)
    state = run(initial_acceptance_state([1, 8], CFG), CFG, rng, 5, 0.0, [(1, 3, 100, CODE)])
    data = json.loads(json.dumps(to_data(state)))
    restored = AcceptanceState.from_dict(data)
    assert restored == state
    assert acceptance_estimate(restored, 1, CFG) == acceptance_estimate(state, 1, CFG)


def test_from_dict_rejects_unknown_version_and_bad_keys() -> None:
    good = to_data(initial_acceptance_state([1], CFG))
    with pytest.raises(PolicyTypeError, match="version"):
        AcceptanceState.from_dict({**good, "version": 99})
    with pytest.raises(PolicyTypeError, match=r"unknown key\(s\) \['extra'\]"):
        AcceptanceState.from_dict({**good, "extra": 1})
    missing = dict(good)
    del missing["slots"]
    with pytest.raises(PolicyTypeError, match=r"missing required field `slots`"):
        AcceptanceState.from_dict(missing)
    bad_slot = json.loads(json.dumps(good))
    bad_slot["slots"][0]["reached"] = [1.0, 2.0]
    with pytest.raises(PolicyTypeError, match=r"tuple of 2 finite .* at `\$\.slots\[0\]`"):
        AcceptanceState.from_dict(bad_slot)
    bad_slot["slots"][0]["reached"] = [-1.0] * 7
    with pytest.raises(PolicyTypeError, match="reached"):
        AcceptanceState.from_dict(bad_slot)


def test_config_validation_names_the_field() -> None:
    with pytest.raises(PolicyTypeError, match="half_life_s"):
        AcceptanceConfig(half_life_s=0.0)
    with pytest.raises(PolicyTypeError, match="prior_mean"):
        AcceptanceConfig(prior_mean=1.0)
    with pytest.raises(PolicyTypeError, match="fast_half_life_s"):
        AcceptanceConfig(half_life_s=5.0, fast_half_life_s=5.0)
    with pytest.raises(PolicyTypeError, match="max_steps"):
        AcceptanceConfig(max_steps=0)
    assert math.isclose(AcceptanceConfig().lower_z, 1.2816)


# Extrapolation past the observed positions, against the truth. Profiles: the
# simulator's catalog (REFERENCE.md §3: falling gsm8k .72 -> .65, the MT-bench rates
# derived from vLLM's accept lengths, rising code/chat, n-gram's low first position)
# plus synthetic flat and steadily falling ones.
FALLING_5PCT = (0.80, 0.76, 0.722, 0.686, 0.652, 0.619, 0.588)  # -5 % a position
EXTRAPOLATION_PROFILES = {
    **{f"{name}/{domain}": rates for name, d in PROFILES.items() for domain, rates in d.items()},
    "flat .7": (0.7,) * 7,
    "falling 5 %": FALLING_5PCT,
}
# Stated margins: E[L(k)] never more than 2 % above the truth; below it by at most
# 20 % after k = 1 (12 % after k = 3), except n-gram profiles after k = 1, whose
# first position (.16-.65) says little about the rest (.6-.96): at most 50 %.
OVER_MARGIN = 0.02


def _true_accept_length(rates: Sequence[float], k: int) -> float:
    return 1.0 + sum(math.prod(rates[: i + 1]) for i in range(k))


@pytest.mark.parametrize("ran_steps", [1, 3])
@pytest.mark.parametrize("name", sorted(EXTRAPOLATION_PROFILES))
def test_extrapolated_accept_length_is_conservative_against_the_truth(
    name: str, ran_steps: int
) -> None:
    rates = EXTRAPOLATION_PROFILES[name]
    rng = np.random.default_rng(10)
    state = run(
        initial_acceptance_state([1], CFG), CFG, rng, 30, 0.0, [(1, ran_steps, 2000, rates)]
    )
    est = acceptance_estimate(state, 1, CFG)
    assert est.observed == ran_steps
    ngram_first = ran_steps == 1 and name.startswith("ngram/")
    floor = -0.5 if ngram_first else (-0.2 if ran_steps == 1 else -0.12)
    for k in range(ran_steps + 1, 8):
        truth = _true_accept_length(rates, k)
        rel = est.expected_accept_length(k) / truth - 1.0
        assert floor <= rel <= OVER_MARGIN, (name, k, rel)
        assert est.expected_accept_length(k, conservative=True) <= est.expected_accept_length(k)
    # Past the evidence the rates fall: never above the last observed lower bound,
    # each at most extrapolation_decay times the one before.
    last = est.lower[ran_steps - 1]
    for i in range(ran_steps, 7):
        assert est.mean[i] <= last + 1e-12
        assert (
            est.mean[i]
            <= CFG.extrapolation_decay * (est.mean[i - 1] if i > ran_steps else last) + 1e-12
        )
        last = est.mean[i]


def test_gsm8k_after_k1_is_no_longer_overstated() -> None:
    # The review measured E[L(3)] +3.7 % and E[L(7)] +10 % with flat extrapolation.
    gsm8k = PROFILES["eagle3-llama3.1-8b"]["gsm8k"]
    rng = np.random.default_rng(11)
    state = run(initial_acceptance_state([1], CFG), CFG, rng, 30, 0.0, [(1, 1, 2000, gsm8k)])
    est = acceptance_estimate(state, 1, CFG)
    for k in (3, 7):
        assert est.expected_accept_length(k) <= _true_accept_length(gsm8k, k) * 1.01
    flat = AcceptanceConfig(extrapolation_decay=1.0)  # the old behaviour, for contrast
    old = acceptance_estimate(state, 1, flat)
    assert old.expected_accept_length(7) > _true_accept_length(gsm8k, 7) * 1.08


def test_an_observed_trend_falling_faster_than_the_default_is_followed() -> None:
    steep = tuple(0.85 * 0.88**i for i in range(7))  # -12 % a position
    rng = np.random.default_rng(12)
    state = run(initial_acceptance_state([1], CFG), CFG, rng, 30, 0.0, [(1, 3, 4000, steep)])
    est = acceptance_estimate(state, 1, CFG)
    assert est.observed == 3
    for i in range(3, 7):
        assert est.mean[i] <= 0.9 * est.mean[i - 1]
    for k in range(4, 8):
        assert est.expected_accept_length(k) <= _true_accept_length(steep, k) * (1 + OVER_MARGIN)
    with pytest.raises(PolicyTypeError, match="extrapolation_decay"):
        AcceptanceConfig(extrapolation_decay=1.5)
    with pytest.raises(PolicyTypeError, match="extrapolation_decay"):
        AcceptanceConfig(extrapolation_decay=0.0)


def test_pooled_counts_are_the_slots_sums_computed_once_and_never_saved() -> None:
    # Every slot's estimate reads the counts pooled over slots; the state sums them once.
    rng = np.random.default_rng(4)
    state = run(
        initial_acceptance_state([1, 8], CFG),
        CFG,
        rng,
        5,
        0.0,
        [(1, 3, 100, CODE), (8, 5, 50, CODE)],
    )
    saved = to_data(state)
    reached, passed = state.pooled()
    assert reached == tuple(sum(s.reached[i] for s in state.slots) for i in range(CFG.max_steps))
    assert passed == tuple(sum(s.passed[i] for s in state.slots) for i in range(CFG.max_steps))
    assert state.pooled() is state.pooled()
    assert acceptance_estimate(state, 8, CFG).pooled_trials == reached
    assert to_data(state) == saved  # a derived cache: not part of the saved state
    assert AcceptanceState.from_dict(saved) == state


@pytest.mark.parametrize(
    ("counts", "ok"),
    [
        ((0.0, 1.5, 2.0), True),
        ((0, 3, 2.5), True),  # ints count too
        ((-0.0, 0.0, 0.0), True),
        ((1e308, 1e308, 1e308), True),  # finite, though their sum is not
        ((float("nan"), 1.0, 1.0), False),
        ((1.0, 1.0, float("nan")), False),
        ((1.0, float("inf"), 1.0), False),
        ((1.0, -1e-300, 1.0), False),
        ((True, 1.0, 1.0), False),
        ((1.0, "2", 1.0), False),
    ],
)
def test_slot_counts_are_finite_numbers_at_least_zero(counts: tuple[float, ...], ok: bool) -> None:
    good = (1.0, 1.0, 1.0)
    for field in range(4):
        args = [good, good, good, good]
        args[field] = counts
        if ok:
            SlotAcceptance(1, *args)
        else:
            with pytest.raises(PolicyTypeError, match="finite numbers >= 0"):
                SlotAcceptance(1, *args)


def test_the_slots_shared_prior_is_kept_per_config() -> None:
    # Every slot's posterior starts from one pooled prior per state; it is kept on the
    # state for the config it was computed with, never reused for another.
    rng = np.random.default_rng(6)
    state = run(initial_acceptance_state([1, 8], CFG), CFG, rng, 4, 0.0, [(1, 3, 100, CODE)])
    other = AcceptanceConfig(prior_mean=0.3, pool_strength=5.0)
    first = acceptance_estimate(state, 8, CFG)
    with_other = acceptance_estimate(state, 8, other)
    fresh = AcceptanceState.from_dict(to_data(state))
    assert with_other == acceptance_estimate(fresh, 8, other)
    assert with_other != first
    assert acceptance_estimate(state, 8, CFG) == first == acceptance_estimate(fresh, 8, CFG)
