"""Step-cost estimator under another GPU's prior (issue 20 §5): it learns the true GPU.

The daemon starts from the catalog prior of an L40S and is fed an H100's step times
(the simulator's cost model, 1 % seeded lognormal noise) at small batches and 0-3 draft
steps, as a light-load start runs. The L40S prior is ~3x too slow, and by a different
factor for its hardware terms (weight and KV reads, compute) than for its per-event
overheads (the catalog charges those alike on every GPU), so one scale factor cannot
fix it: the fit must learn the split from what it measures.

Known gap, strict xfail: the estimator on main does not meet these bounds (measured 9.3 %
worst error where it ran after 40 windows, 7.2 % at k = 4-5). A two-factor
recalibration (hardware terms / overheads) met them (1.1 %, 2.0 %) but broke the knee
and steady-workload tests and did not raise the suite's counts, so it is not in; see
benchmarks/policies/README.md ("Another GPU's prior, recalibrated by two measured
factors"). Drop the xfail marks when a fix lands.
"""

from __future__ import annotations

import numpy as np
import pytest

from specgov.policies.common.types import TierStat, TierStatsSnapshot
from specgov.policies.daemon.estimators.step_cost import (
    StepCostState,
    initial_step_cost_state,
    predict_step_s,
    update_step_cost,
)
from specgov.simulator.catalog import Catalog
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.priors import step_cost_prior

CATALOG = Catalog.load()
LLAMA8 = CATALOG.model("llama-3.1-8b")
EAGLE3 = CATALOG.drafter("eagle3")
H100 = CostModel.from_catalog(CATALOG.gpu("h100"), LLAMA8, EAGLE3)
L40S_PRIOR = step_cost_prior(CostModel.from_catalog(CATALOG.gpu("l40s"), LLAMA8, EAGLE3))
CTX = 1000  # KV tokens per request

SEEN = [(b, k) for b in (2, 4, 8, 16) for k in (0, 1, 2, 3)]
UNRUN = [(b, k) for b in (2, 4, 8, 16) for k in (4, 5)]  # step counts never timed


def _learn(windows: int, seed: int = 0) -> list[StepCostState]:
    """The state after each of ``windows`` one-second windows of three busy slots."""
    rng = np.random.default_rng(seed)
    state = initial_step_cost_state(L40S_PRIOR)
    states = []
    for w in range(windows):
        tiers = []
        for slot, lo, hi in ((1, 1, 3), (4, 3, 8), (8, 8, 20)):
            batch = int(rng.integers(lo, hi))
            k = int(rng.integers(0, 4))
            step_s = H100.decode_step_s(batch, k, batch * CTX) * float(np.exp(rng.normal(0, 0.01)))
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
        snap = TierStatsSnapshot(
            window_start_s=float(w), window_end_s=float(w + 1), tiers=tuple(tiers)
        )
        state = update_step_cost(state, snap, kv_tokens_per_request=CTX)
        states.append(state)
    return states


STATES = _learn(40)


def _max_error(state: StepCostState, points: list[tuple[int, int]]) -> float:
    return max(
        abs(predict_step_s(state, b, k, b * CTX) / H100.decode_step_s(b, k, b * CTX) - 1.0)
        for b, k in points
    )


def test_the_other_gpus_prior_is_far_off() -> None:
    initial = initial_step_cost_state(L40S_PRIOR)
    assert _max_error(initial, SEEN) > 1.5  # ~3x slower


_GAP = pytest.mark.xfail(strict=True, reason="issue 20 §5: the fit keeps the other GPU's split")


@_GAP
def test_predictions_approach_the_true_gpu_where_it_ran() -> None:
    # Measured (this test's seed), two-factor recalibration: 7 % worst after 10 windows,
    # 1.1 % after 40. main (pulled back to the raw L40S prior once two step counts have
    # data): 9.3 % after 40 windows (one scale factor cannot fix both groups of terms).
    assert _max_error(STATES[9], SEEN) < 0.08
    assert _max_error(STATES[19], SEEN) < 0.03
    assert _max_error(STATES[39], SEEN) < 0.02


@_GAP
def test_step_counts_never_run_follow_the_measured_split() -> None:
    # k=4 and k=5 never ran: their cost comes from the recalibrated prior's shape, whose
    # per-step overheads the data would rescale apart from its hardware terms. Measured:
    # 2.0 % worst after 40 windows with two factors, 7.2 % on main.
    assert _max_error(STATES[39], UNRUN) < 0.035
