"""Step-cost estimator: prior from the simulator's cost model, recovery of a true curve.

Ground truth is the simulator's cost model with perturbed coefficients (a "different
prior"): the estimator starts from the catalog's unperturbed prior and must learn the
truth from noisy windows (3 % lognormal noise, 5 % of windows inflated x3 like a
prefill-heavy window or a GC pause).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable
from dataclasses import replace

import numpy as np
import pytest
from step_cost_knee import verify_knee_tokens

from specgov.policies.common.roofline import RooflineCoefficients, scaled_coefficients
from specgov.policies.common.types import PolicyTypeError, TierStat, TierStatsSnapshot
from specgov.policies.daemon.estimators.step_cost import (
    FEATURE_NAMES,
    StepCostConfig,
    StepCostPrior,
    StepCostState,
    StepSample,
    cost_evidence,
    default_step_cost_prior,
    initial_step_cost_state,
    local_step_s,
    predict_step_s,
    step_cost_bounds,
    step_cost_model,
    update_step_cost,
)
from specgov.policies.daemon.estimators.step_cost_fit import (
    median,
    median_sorted,
    weighted_median,
    weighted_median_sorted,
)
from specgov.policies.daemon.estimators.step_cost_samples import SampleColumns, evict
from specgov.simulator.catalog import Catalog
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.priors import step_cost_prior

CATALOG = Catalog.load()
H100 = CATALOG.gpu("h100")
LLAMA8 = CATALOG.model("llama-3.1-8b")
LLAMA70 = CATALOG.model("llama-3.1-70b")
EAGLE3 = CATALOG.drafter("eagle3")
NGRAM = CATALOG.drafter("ngram")
SPEC = CostModel.from_catalog(H100, LLAMA8, EAGLE3)
CTX = 1000  # KV tokens per request
GRID_B = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRID_K = (0, 1, 2, 3, 5, 7)

# The "different prior": weights read 30 % slower, compute 30 % faster (the knee moves
# to ~1.9x the tokens), more fixed and per-draft-step overhead.
TRUTH = SPEC.with_overrides(
    {
        "weight_read_s": SPEC.coefficients.weight_read_s * 1.3,
        "compute_per_token_s": SPEC.coefficients.compute_per_token_s * 0.7,
        "fixed_overhead_s": 1.8e-3,
        "draft_step_overhead_s": 1.1e-3,
    }
)


def _points() -> Iterable[tuple[int, int, int]]:
    for b in GRID_B:
        for k in GRID_K:
            for ctx in (200, CTX, 4000):
                yield b, k, b * ctx


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("eagle3 chain", SPEC),
        ("ngram chain", CostModel.from_catalog(H100, LLAMA8, NGRAM)),
        ("no drafter", CostModel.from_catalog(H100, LLAMA8, None)),
        ("70b tp4", CostModel.from_catalog(H100, LLAMA70, EAGLE3, tp_size=4)),
        ("eagle3 tree", CostModel.from_catalog(H100, LLAMA8, EAGLE3, topk=4, num_draft_tokens=8)),
    ],
)
def test_prior_matches_the_simulator_cost_model_within_1_percent(
    name: str, model: CostModel
) -> None:
    prior = step_cost_prior(model)
    for b, k, kv in _points():
        want = model.decode_step_s(b, k, kv)
        assert prior.predict_s(b, k, kv) == pytest.approx(want, rel=0.01), (name, b, k, kv)


def test_default_prior_is_the_catalog_llama8_eagle3_h100_prior() -> None:
    built = step_cost_prior(SPEC)
    default = default_step_cost_prior()
    for b, k, kv in _points():
        assert default.predict_s(b, k, kv) == pytest.approx(built.predict_s(b, k, kv), rel=1e-6)


def test_initial_state_predicts_the_prior() -> None:
    prior = step_cost_prior(TRUTH)
    state = initial_step_cost_state(prior)
    for b, k, kv in _points():
        assert predict_step_s(state, b, k, kv) == pytest.approx(prior.predict_s(b, k, kv))


def _window(
    rng: np.random.Generator, t: float, truth: CostModel, outliers: bool = True
) -> TierStatsSnapshot:
    """One second of four busy slots, each at a random batch size and step count."""
    tiers = []
    for slot, lo, hi in ((1, 1, 2), (8, 8, 32), (32, 32, 128), (128, 128, 300)):
        batch = int(rng.integers(lo, hi))
        k = int(rng.choice(GRID_K))
        step_s = truth.decode_step_s(batch, k, batch * CTX) * float(np.exp(rng.normal(0, 0.03)))
        if outliers and rng.random() < 0.05:
            step_s *= 3.0
        calls = 40
        tiers.append(
            TierStat(
                slot=slot,
                steps=k,
                verify_calls=calls,
                requests=calls * batch,
                accepted_hist=(calls * batch,) + (0,) * k,
                step_time_sum_s=step_s * calls,
                step_time_count=calls,
                batch_size_sum=calls * batch,
            )
        )
    return TierStatsSnapshot(window_start_s=t - 1.0, window_end_s=t, tiers=tuple(tiers))


def _learn(windows: int, seed: int = 0, outliers: bool = True) -> StepCostState:
    rng = np.random.default_rng(seed)
    state = initial_step_cost_state(step_cost_prior(SPEC))
    for w in range(windows):
        state = update_step_cost(
            state, _window(rng, float(w + 1), TRUTH, outliers), kv_tokens_per_request=CTX
        )
    return state


LEARNED = _learn(300)


def _rel_errors(state: StepCostState) -> list[float]:
    return [
        abs(predict_step_s(state, b, k, b * CTX) / TRUTH.decode_step_s(b, k, b * CTX) - 1.0)
        for b in GRID_B
        for k in GRID_K
    ]


def test_recovers_a_true_cost_curve_from_a_different_prior() -> None:
    # Tolerance: every (B, k) on the grid within 5 % of the truth (3 % noise per window,
    # 5 % of windows x3). The prior alone is off by more than 15 % somewhere.
    prior_errors = _rel_errors(initial_step_cost_state(step_cost_prior(SPEC)))
    assert max(prior_errors) > 0.15
    errors = _rel_errors(LEARNED)
    assert max(errors) < 0.05, max(errors)
    assert float(np.mean(errors)) < 0.025


def test_outliers_barely_move_the_fit() -> None:
    clean = _learn(300, outliers=False)
    for b in GRID_B:
        for k in GRID_K:
            kv = b * CTX
            assert predict_step_s(LEARNED, b, k, kv) == pytest.approx(
                predict_step_s(clean, b, k, kv), rel=0.03
            )


def test_predictions_are_monotone_in_batched_tokens() -> None:
    for state in (LEARNED, initial_step_cost_state(step_cost_prior(SPEC))):
        for k in GRID_K:
            seq = [predict_step_s(state, b, k, b * CTX) for b in range(1, 513)]
            assert all(a <= b for a, b in itertools.pairwise(seq)), k
        for b in GRID_B:
            seq = [predict_step_s(state, b, k, b * CTX) for k in range(0, 16)]
            assert all(a <= c for a, c in itertools.pairwise(seq)), b
    assert all(c >= 0 for c in LEARNED.coefficients)


def test_predicts_where_verification_stops_being_free() -> None:
    # The knee: batched tokens at which one step costs 25 % more than one token's. The
    # truth's knee is ~1.5x the prior's; the fit must land within 20 % of the truth.
    truth_knee = verify_knee_tokens(initial_step_cost_state(step_cost_prior(TRUTH)), kv_tokens=0)
    prior_knee = verify_knee_tokens(initial_step_cost_state(step_cost_prior(SPEC)), kv_tokens=0)
    fitted_knee = verify_knee_tokens(LEARNED, kv_tokens=0)
    assert abs(prior_knee / truth_knee - 1.0) > 0.25
    assert fitted_knee == pytest.approx(truth_knee, rel=0.2)
    # Below the knee verifying more tokens is nearly free, far above it is not.
    small = predict_step_s(LEARNED, 16, 0, 0) / predict_step_s(LEARNED, 1, 0, 0)
    large = predict_step_s(LEARNED, 1024, 0, 0) / predict_step_s(LEARNED, 1, 0, 0)
    assert small < 1.1 < 2.0 < large


def test_scarce_data_stays_near_the_prior() -> None:
    # One window at batch 1: the fit explains it but elsewhere stays near the prior.
    prior = step_cost_prior(SPEC)
    rng = np.random.default_rng(3)
    state = initial_step_cost_state(prior)
    snap = _window(rng, 1.0, TRUTH, outliers=False)
    state = update_step_cost(state, snap, kv_tokens_per_request=CTX)
    assert state.fits == 1
    for b in GRID_B:
        for k in GRID_K:
            kv = b * CTX
            assert predict_step_s(state, b, k, kv) == pytest.approx(
                prior.predict_s(b, k, kv), rel=0.3
            )


def test_sample_buffer_is_bounded_and_keeps_rare_operating_points() -> None:
    # 64 samples for the ~43 (steps, batch octave) cells the traffic visits: crowded
    # cells give way first, so the one old sample at batch 500, k=7 survives.
    cfg = StepCostConfig(max_samples=64)
    rng = np.random.default_rng(4)
    state = initial_step_cost_state(step_cost_prior(SPEC), cfg)
    rare = TierStat(5, 7, 10, 10 * 500, (5000,) + (0,) * 7, 10 * 0.2, 10, 10 * 500)
    state = update_step_cost(
        state,
        TierStatsSnapshot(0.0, 1.0, (rare,)),
        kv_tokens_per_request=CTX,
        config=cfg,
    )
    for w in range(100):
        state = update_step_cost(
            state, _window(rng, float(w + 2), TRUTH), kv_tokens_per_request=CTX, config=cfg
        )
    assert len(state.samples) == 64
    assert any(s.steps == 7 and s.batch_size == 500 for s in state.samples)


def test_duplicate_snapshots_and_untimed_tiers_add_nothing() -> None:
    rng = np.random.default_rng(5)
    state = initial_step_cost_state(step_cost_prior(SPEC))
    snap = _window(rng, 1.0, TRUTH)
    once = update_step_cost(state, snap, kv_tokens_per_request=CTX)
    assert update_step_cost(once, snap, kv_tokens_per_request=CTX) == once
    untimed = TierStat(1, 3, 10, 10, (10, 0, 0, 0), 0.0, 0, 10)
    later = update_step_cost(
        once, TierStatsSnapshot(1.0, 2.0, (untimed,)), kv_tokens_per_request=None
    )
    assert later.samples == once.samples
    assert later.coefficients == once.coefficients
    assert later.last_time_s == 2.0


def test_kv_per_request_scales_with_the_mean_batch() -> None:
    state = initial_step_cost_state(step_cost_prior(SPEC))
    t = TierStat(8, 1, 10, 120, (60, 60), 0.1, 10, 120)
    state = update_step_cost(state, TierStatsSnapshot(0.0, 1.0, (t,)), kv_tokens_per_request=None)
    (sample,) = state.samples
    assert sample.batch_size == 12.0
    assert sample.step_s == pytest.approx(0.01)
    assert sample.kv_tokens == 12.0 * StepCostConfig().default_kv_tokens_per_request


def test_state_round_trips_through_json() -> None:
    data = json.loads(json.dumps(LEARNED.to_dict()))
    restored = StepCostState.from_dict(data)
    assert restored == LEARNED
    assert predict_step_s(restored, 64, 3, 64 * CTX) == predict_step_s(LEARNED, 64, 3, 64 * CTX)
    assert len(restored.coefficients) == len(FEATURE_NAMES)


def test_from_dict_rejects_unknown_version_and_bad_keys() -> None:
    good = initial_step_cost_state(default_step_cost_prior()).to_dict()
    with pytest.raises(PolicyTypeError, match="unsupported state version 2"):
        StepCostState.from_dict({**good, "version": 2})
    with pytest.raises(PolicyTypeError, match=r"unknown key\(s\) \['bogus'\]"):
        StepCostState.from_dict({**good, "bogus": 0})
    with pytest.raises(PolicyTypeError, match="coefficients"):
        StepCostState.from_dict({**good, "coefficients": [1.0, 2.0]})
    with pytest.raises(PolicyTypeError, match=r"'samples'\[0\]"):
        StepCostState.from_dict({**good, "samples": [[0.0, 1.0]]})
    bad_prior = dict(good["prior"])
    bad_prior["weight_read_s"] = -1.0
    with pytest.raises(PolicyTypeError, match="weight_read_s"):
        StepCostState.from_dict({**good, "prior": bad_prior})
    with pytest.raises(PolicyTypeError, match=r"StepCostPrior.from_dict: missing key"):
        StepCostPrior.from_dict({"weight_read_s": 1.0})


def test_bad_inputs_name_the_argument() -> None:
    state = initial_step_cost_state(default_step_cost_prior())
    with pytest.raises(PolicyTypeError, match="steps"):
        predict_step_s(state, 1, -1, 0)
    with pytest.raises(PolicyTypeError, match="batch_size"):
        predict_step_s(state, float("nan"), 1, 0)
    with pytest.raises(PolicyTypeError, match="kv_tokens_per_request"):
        update_step_cost(state, TierStatsSnapshot(0.0, 1.0, ()), kv_tokens_per_request=-5.0)
    with pytest.raises(PolicyTypeError, match="max_samples"):
        StepCostConfig(max_samples=0)
    with pytest.raises(PolicyTypeError, match="num_draft_tokens"):
        StepCostPrior(RooflineCoefficients(1e-3, 5e-3, 2e-5, 5e-8), topk=4)


def _one_point_windows(prior: StepCostPrior, k: int, windows: int) -> StepCostState:
    """``windows`` windows of one request at ``k`` steps on the H100 (SPEC): one point."""
    state = initial_step_cost_state(prior)
    step_s = SPEC.decode_step_s(1, k, CTX)
    for w in range(windows):
        calls = 200
        snap = TierStatsSnapshot(
            window_start_s=float(w),
            window_end_s=float(w + 1),
            tiers=(
                TierStat(
                    slot=1,
                    steps=k,
                    verify_calls=calls,
                    requests=calls,
                    accepted_hist=(calls,) + (0,) * k,
                    step_time_sum_s=step_s * calls,
                    step_time_count=calls,
                    batch_size_sum=calls,
                ),
            ),
        )
        state = update_step_cost(state, snap, kv_tokens_per_request=CTX)
    return state


def test_a_wrong_gpu_prior_seen_at_one_step_count_keeps_the_cost_per_step() -> None:
    # The prior of an L40S (about 3x slower, another knee) and 30 windows at k=3 only on
    # the H100. The fit must match the step it ran and must not make unrun steps look
    # free: pulled towards the raw prior, the per-draft-step terms absorbed the scale
    # error and k=7 came out 0.6 % dearer than k=3 (truth: 38 %). Recalibrated by one
    # factor, the prior's shape survives (L40S: +24 %).
    other = step_cost_prior(CostModel.from_catalog(CATALOG.gpu("l40s"), LLAMA8, EAGLE3))
    state = _one_point_windows(other, 3, 30)
    assert predict_step_s(state, 1, 3, CTX) == pytest.approx(
        SPEC.decode_step_s(1, 3, CTX), rel=0.02
    )
    fitted = predict_step_s(state, 1, 7, CTX) / predict_step_s(state, 1, 3, CTX)
    truth = SPEC.decode_step_s(1, 7, CTX) / SPEC.decode_step_s(1, 3, CTX)
    assert fitted - 1.0 > 0.5 * (truth - 1.0)


def test_a_prior_wrong_only_in_scale_is_recovered_at_every_step_count() -> None:
    # Every coefficient 1.4x the truth, windows at k=3 only: one factor explains it all.
    scaled = StepCostPrior(scaled_coefficients(step_cost_prior(SPEC).coefficients, 1.4))
    state = _one_point_windows(scaled, 3, 30)
    for k in range(8):
        want = SPEC.decode_step_s(1, k, CTX)
        assert predict_step_s(state, 1, k, CTX) == pytest.approx(want, rel=0.01), k


# ----------------------------------------------- thinly timed step counts (issue 8 §3)

L40S_PRIOR = step_cost_prior(CostModel.from_catalog(CATALOG.gpu("l40s"), LLAMA8, EAGLE3))


def _windows_at(prior: StepCostPrior, batch: int, plan: Iterable[tuple[int, int]]) -> StepCostState:
    """Noise-free windows on the H100 (SPEC) at ``batch``: ``(steps, verify calls)`` each."""
    state = initial_step_cost_state(prior)
    for w, (k, calls) in enumerate(plan):
        step_s = SPEC.decode_step_s(batch, k, batch * CTX)
        snap = TierStatsSnapshot(
            window_start_s=float(5 * w),
            window_end_s=float(5 * w + 5),
            tiers=(
                TierStat(
                    slot=128,
                    steps=k,
                    verify_calls=calls,
                    requests=calls * batch,
                    accepted_hist=(calls * batch,) + (0,) * k,
                    step_time_sum_s=step_s * calls,
                    step_time_count=calls,
                    batch_size_sum=calls * batch,
                ),
            ),
        )
        state = update_step_cost(state, snap, kv_tokens_per_request=CTX)
    return state


# An L40S prior on the H100 at 225 requests: 20 windows at k=2, then two at k=1 (a probe).
PROBED = _windows_at(L40S_PRIOR, 225, [(2, 120)] * 20 + [(1, 120)] * 2)


def test_a_wrong_gpu_fit_mispredicts_the_neighbour_of_the_step_it_ran() -> None:
    # What the policy faced in users-256/h100/eagle3 with the L40S prior: the fit is
    # exact at k=2 and takes the slope from the L40S shape, so k=1 comes out dearer
    # than it is (truth: k=1 is 3.7 % better in goodput here, the fit said it was worse).
    state = _windows_at(L40S_PRIOR, 225, [(2, 120)] * 20)
    kv = 225 * CTX
    assert predict_step_s(state, 225, 2, kv) == pytest.approx(
        SPEC.decode_step_s(225, 2, kv), rel=0.02
    )
    assert predict_step_s(state, 225, 1, kv) > 1.03 * SPEC.decode_step_s(225, 1, kv)


def test_local_step_s_follows_a_few_windows_timed_at_a_step_count() -> None:
    kv = 225 * CTX
    truth = SPEC.decode_step_s(225, 1, kv)
    fitted = predict_step_s(PROBED, 225, 1, kv)
    local = local_step_s(step_cost_model(PROBED), 225, 1, kv)
    # Two windows barely move the global fit; the local correction follows them.
    assert abs(fitted / truth - 1.0) > 0.02
    assert abs(local / truth - 1.0) < 0.5 * abs(fitted / truth - 1.0)
    # The step count the data dominates stays where the fit has it.
    assert local_step_s(step_cost_model(PROBED), 225, 2, kv) == pytest.approx(
        SPEC.decode_step_s(225, 2, kv), rel=0.02
    )
    # Elsewhere (no samples within 2x of the batch) the correction is off.
    assert local_step_s(step_cost_model(PROBED), 16, 1, 16 * CTX) == predict_step_s(
        PROBED, 16, 1, 16 * CTX
    )


def _bumped(factor: float) -> StepCostState:
    """Three noise-free windows at k=2, 64 requests, exact prior; then timed ``factor``x."""
    state = _windows_at(step_cost_prior(SPEC), 64, [(2, 200)] * 3)
    return replace(
        state, samples=tuple(replace(s, step_s=s.step_s * factor) for s in state.samples)
    )


def test_local_step_s_gives_an_untimed_step_the_level_error_of_its_neighbour() -> None:
    # The timings 3 % above the fit at k=2: k=3, never timed, shares that correction, so
    # the comparison between a step that ran and one that did not is not biased.
    state = _bumped(1.03)
    kv = 64 * CTX
    n = cost_evidence(step_cost_model(state), 64, 2)
    c = math.log(1.03)
    # Positive-part James-Stein with the scatter at its floor (min_rel_scale = 2 %).
    want = math.exp(c * (1.0 - 0.02**2 / (n * c * c)))
    ratio_2 = local_step_s(step_cost_model(state), 64, 2, kv) / predict_step_s(state, 64, 2, kv)
    ratio_3 = local_step_s(step_cost_model(state), 64, 3, kv) / predict_step_s(state, 64, 3, kv)
    assert ratio_2 == pytest.approx(want, rel=1e-4)  # the fit itself is exact to ~1e-5
    assert 1.01 < ratio_2 < 1.03
    assert ratio_3 == pytest.approx(ratio_2, rel=1e-12)


def test_local_step_s_ignores_a_deviation_within_the_noise() -> None:
    # 1 % over three windows is within the 2 % scatter floor: no correction at all, so
    # an exact prior's near ties are decided by the fit, as before.
    state = _bumped(1.01)
    for k in (1, 2, 3):
        kv = 64 * CTX
        assert local_step_s(step_cost_model(state), 64, k, kv) == predict_step_s(state, 64, k, kv)


def test_cost_evidence_counts_window_weights_at_the_step_near_the_batch() -> None:
    assert cost_evidence(step_cost_model(PROBED), 225, 1) == pytest.approx(2 * 120 / (120 + 16.0))
    assert cost_evidence(step_cost_model(PROBED), 225, 2) == pytest.approx(20 * 120 / (120 + 16.0))
    assert cost_evidence(step_cost_model(PROBED), 225, 3) == 0.0
    assert cost_evidence(step_cost_model(PROBED), 100, 2) == 0.0  # 225 is more than 2x away


def test_step_cost_bounds_cover_the_truth_of_a_wrong_gpu_prior() -> None:
    state = _windows_at(L40S_PRIOR, 225, [(2, 120)] * 20)
    kv = 225 * CTX
    for k in (0, 1, 3, 4):
        low, high = step_cost_bounds(step_cost_model(state), 225, k, kv)
        assert low < SPEC.decode_step_s(225, k, kv) < high, k
    # At the step count that ran, and where nothing near ran, the bounds are a point.
    assert (
        step_cost_bounds(step_cost_model(state), 225, 2, kv)
        == (local_step_s(step_cost_model(state), 225, 2, kv),) * 2
    )
    point = step_cost_bounds(step_cost_model(state), 16, 1, 16 * CTX)
    assert point[0] == point[1]


def test_step_cost_bounds_collapse_for_the_exact_prior() -> None:
    state = _windows_at(step_cost_prior(SPEC), 225, [(2, 120)] * 20)
    kv = 225 * CTX
    for k in (0, 1, 3, 7):
        low, high = step_cost_bounds(step_cost_model(state), 225, k, kv)
        assert high / low - 1.0 < 0.01, k


def test_thin_step_helpers_reject_bad_arguments() -> None:
    with pytest.raises(PolicyTypeError, match="min_evidence"):
        step_cost_bounds(step_cost_model(PROBED), 225, 1, 225 * CTX, min_evidence=0.0)
    with pytest.raises(PolicyTypeError, match="batch_size"):
        local_step_s(step_cost_model(PROBED), -1.0, 1, 225 * CTX)
    with pytest.raises(PolicyTypeError, match="steps"):
        cost_evidence(step_cost_model(PROBED), 225, -1)


def test_a_model_answers_every_query_as_a_fresh_model_of_a_restored_state_does() -> None:
    # A model remembers each batch size's region; its state's columns were extended
    # from the previous state's. Many queries against one model, then models of other
    # states with the same batch sizes, must give what a fresh model of the state rebuilt
    # from its JSON (columns built from scratch) gives for each query alone.
    queries = [(b, k) for b in (60.0, 64.0, 100.0, 200.0, 225.0, 300.0, 16.0) for k in range(5)]
    states = [PROBED, _bumped(1.03), _bumped(1.1), LEARNED, PROBED]
    warm = []
    for s in states:
        model = step_cost_model(s)
        warm.append([local_step_s(model, b, k, b * CTX) for b, k in queries])
    cold = []
    for s in states:
        restored = StepCostState.from_dict(json.loads(json.dumps(s.to_dict())))
        cold.append([local_step_s(step_cost_model(restored), b, k, b * CTX) for b, k in queries])
    assert warm == cold
    # A state that differs is answered from its own samples.
    assert warm[1] != warm[2]


def test_medians_are_numpys_bit_for_bit() -> None:
    # One rule each on sorted values, sorted by numpy (the fit's hundreds of samples) or
    # by Python (a cell's few): the values numpy's formulation gives, or decisions would
    # change.
    rng = np.random.default_rng(7)
    for n in [*range(1, 40), 160, 256]:
        for _ in range(20):
            values = rng.normal(0.0, 0.1, n)
            if n > 3:
                values[: n // 3] = values[0]  # ties
            weights = rng.random(n) * (rng.random(n) > 0.2)
            assert median_sorted(sorted(values.tolist())) == float(np.median(values))
            assert median(values) == float(np.median(values))
            order = np.argsort(values, kind="stable")
            cum = np.cumsum(weights[order])
            expected = (
                1.0 if cum[-1] <= 0 else float(values[order][np.searchsorted(cum, 0.5 * cum[-1])])
            )
            assert weighted_median_sorted(values[order].tolist(), weights[order].tolist()) == (
                expected
            )
            distinct = values + np.arange(n) * 1e-9  # numpy's sort order is its own on ties
            order = np.argsort(distinct)
            cum = np.cumsum(weights[order])
            pick = distinct[order][np.searchsorted(cum, 0.5 * cum[-1])]
            expected = 1.0 if cum[-1] <= 0 else float(pick)
            assert weighted_median(distinct, weights) == expected
    assert weighted_median_sorted([0.1, 0.3], [0.0, 0.0]) == 1.0
    assert weighted_median_sorted([], []) == 1.0


def test_updates_from_a_restored_state_fit_the_same() -> None:
    # An update hands its columns on to the next state (the kept rows copied); a state
    # read back from JSON builds them. Through a full buffer
    # (evictions) both paths must fit the same coefficients and keep the same samples.
    rng = np.random.default_rng(5)
    cfg = StepCostConfig(max_samples=40)
    state = initial_step_cost_state(step_cost_prior(SPEC), cfg)
    for w in range(30):
        window = _window(rng, float(w + 1), TRUTH, False)
        restored = StepCostState.from_dict(json.loads(json.dumps(state.to_dict())))
        state = update_step_cost(state, window, kv_tokens_per_request=CTX, config=cfg)
        again = update_step_cost(restored, window, kv_tokens_per_request=CTX, config=cfg)
        assert again == state  # samples, coefficients, times, fits
        fresh = SampleColumns.build(state.prior, state.samples)
        for name in ("features", "prior_s", "step_s", "batch", "steps"):
            a, b = getattr(state.sample_columns, name), getattr(fresh, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert state.sample_columns.time_s == fresh.time_s
        assert state.sample_columns.weight == fresh.weight
    assert len(state.samples) == 40  # the buffer filled and evicted


@pytest.mark.parametrize(
    ("batch_size", "steps", "kv_tokens", "name"),
    [
        (float("nan"), 1, 0.0, "batch_size"),
        (float("inf"), 1, 0.0, "batch_size"),
        (-1.0, 1, 0.0, "batch_size"),
        (True, 1, 0.0, "batch_size"),
        (4.0, True, 0.0, "steps"),
        (4.0, 1.0, 0.0, "steps"),
        (4.0, 1, float("inf"), "kv_tokens"),
        (4.0, 1, -0.5, "kv_tokens"),
    ],
)
def test_step_time_queries_reject_bad_points(
    batch_size: float, steps: int, kv_tokens: float, name: str
) -> None:
    # Also right after the good point it equals (True == 1, 4 == 4.0) was answered.
    model = step_cost_model(PROBED)
    local_step_s(model, 4.0, 1, 0.0)
    with pytest.raises(PolicyTypeError, match=name):
        local_step_s(model, batch_size, steps, kv_tokens)
    with pytest.raises(PolicyTypeError, match=name):
        predict_step_s(PROBED, batch_size, steps, kv_tokens)


def test_eviction_drops_what_recounting_every_time_would() -> None:
    # evict counts each sample's cell once and keeps the counts as samples go; the
    # choice must be the one a full recount before every drop makes.
    def cell(s: StepSample) -> tuple[int, int]:
        return (s.steps, round(math.log2(s.batch_size)))

    def recounting(samples: list[StepSample], max_samples: int) -> list[StepSample]:
        while len(samples) > max_samples:
            counts: dict[tuple[int, int], int] = {}
            for s in samples:
                counts[cell(s)] = counts.get(cell(s), 0) + 1
            most = max(counts.values())
            oldest = min(
                (i for i, s in enumerate(samples) if counts[cell(s)] == most),
                key=lambda i: (samples[i].time_s, i),
            )
            del samples[oldest]
        return samples

    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 60))
        samples = [
            StepSample(
                time_s=float(rng.integers(0, 10)),  # ties in time: the index decides
                batch_size=float(2 ** rng.uniform(0, 6)),
                steps=int(rng.integers(0, 4)),
                kv_tokens=100.0,
                step_s=0.01,
                weight=0.5,
            )
            for _ in range(n)
        ]
        keep = int(rng.integers(1, n + 1))
        kept = evict(samples, keep)
        assert kept == sorted(kept)
        assert [samples[i] for i in kept] == recounting(list(samples), keep)
