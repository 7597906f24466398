"""What each of the step-cost estimator's kept derived values saves per decision.

A derived value is kept only where it buys >= 1 % of the daemon's CPU budget (issue 19;
the budget is 2 % of a core at a 1 s interval, so >= 0.2 ms per decision). Timed here:

* a state's ``SampleColumns`` extended from the previous state's rows (vs built afresh):
  kept;
* a ``StepCostModel``'s cells per region asked (vs recomputed per query): kept;
* the fit's penalty scales (computed per fit; handing them from state to state would
  save their cost), an answer per point asked, a correction per (region, steps): not
  kept (what they would save is printed).

On a full sample buffer (256 samples learned from the catalog's Llama-3.1-8B + EAGLE-3
on H100, perturbed) it times each path (min of ``--repeat`` runs, in microseconds: the
minimum is what the code costs without the machine's other load) and multiplies the
difference by how often a decision takes it: one update, and the query mix the goodput
policy asks in the Azure conversation replay (``QUERIES_PER_DECISION`` over
``REGIONS_PER_DECISION``, counted at 0fd9f6b: 19,205 local_step_s calls over 3,044
state x region pairs in 360 decisions). A measurement, not a test: it prints a table.

    .venv/bin/python benchmarks/bench_step_cost.py [--repeat 30]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from specgov.policies.common.types import TierStat, TierStatsSnapshot
from specgov.policies.daemon.estimators.step_cost import (
    StepCostState,
    initial_step_cost_state,
    local_step_s,
    predict_step_s,
    step_cost_model,
    update_step_cost,
)
from specgov.policies.daemon.estimators.step_cost_fit import penalty_scales
from specgov.policies.daemon.estimators.step_cost_samples import (
    SampleColumns,
    StepCostConfig,
    evict,
)
from specgov.simulator.catalog import Catalog
from specgov.simulator.engine.cost import CostModel
from specgov.simulator.priors import step_cost_prior

BUDGET_MS_PER_DECISION = 0.2  # 1 % of 2 % of a core at a 1 s decision interval
QUERIES_PER_DECISION = 19205 / 360  # measured in the Azure conversation replay
REGIONS_PER_DECISION = 3044 / 360  # distinct regions (near-sample sets) asked, same
REPEATS_PER_DECISION = (19205 - 16609) / 360  # queries of a point asked before, same
# queries of a (region, steps) pair asked before (14,234 distinct pairs), same replay
PAIR_REPEATS_PER_DECISION = (19205 - 14234) / 360
CTX = 1000  # KV tokens per request


def _window(rng: np.random.Generator, t: float, truth: CostModel) -> TierStatsSnapshot:
    """One second of four busy slots at random batch sizes and steps (40 verifies each,
    3 % noise on the true step time)."""
    calls = 40
    tiers = []
    for slot, hi in ((1, 2), (8, 32), (32, 128), (128, 300)):
        b = int(rng.integers(slot, hi))
        k = int(rng.choice((0, 1, 2, 3, 5, 7)))
        noisy_s = truth.decode_step_s(b, k, b * CTX) * float(np.exp(rng.normal(0, 0.03)))
        # (slot, steps, verifies, requests, histogram, step time sum, timed, batch sum)
        n = calls * b
        tiers.append(TierStat(slot, k, calls, n, (n,) + (0,) * k, noisy_s * calls, calls, n))
    return TierStatsSnapshot(window_start_s=t - 1.0, window_end_s=t, tiers=tuple(tiers))


def _best_us(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args(argv)
    catalog = Catalog.load()
    spec = CostModel.from_catalog(
        catalog.gpu("h100"), catalog.model("llama-3.1-8b"), catalog.drafter("eagle3")
    )
    truth = spec.with_overrides({"weight_read_s": spec.coefficients.weight_read_s * 1.3})
    rng = np.random.default_rng(0)
    cfg = StepCostConfig()
    state: StepCostState = initial_step_cost_state(step_cost_prior(spec), cfg)
    for w in range(120):  # 4 samples a window: the buffer (256) fills and evicts
        state = update_step_cost(
            state, _window(rng, float(w + 1), truth), kv_tokens_per_request=CTX, config=cfg
        )
    nxt = _window(rng, 121.0, truth)
    added = tuple(
        update_step_cost(
            initial_step_cost_state(state.prior, cfg), nxt, kv_tokens_per_request=CTX
        ).samples
    )
    keep = evict(state.samples + added, cfg.max_samples)
    cols = state.sample_columns
    kept = tuple((state.samples + added)[i] for i in keep)
    batches = [float(b) for b in np.geomspace(1.5, 250.0, 11)]

    def cold_queries() -> None:  # every query computes its region's cells
        for b in batches:
            for k in range(5):
                local_step_s(step_cost_model(state, cfg), b, k, b * CTX)

    def warm_queries() -> None:  # one model: each batch size's cells once
        model = step_cost_model(state, cfg)
        for b in batches:
            for k in range(5):
                local_step_s(model, b, k, b * CTX)

    def model_only() -> None:
        for _ in batches:
            for _ in range(5):
                step_cost_model(state, cfg)

    r = args.repeat
    rows = {
        "columns built afresh": _best_us(lambda: SampleColumns.build(state.prior, kept), r),
        "columns extended": _best_us(lambda: cols.extended(added, keep), r),
        "penalty scales computed": _best_us(lambda: penalty_scales(state.prior, cfg), r),
        "update (fit)": _best_us(
            lambda: update_step_cost(state, nxt, kv_tokens_per_request=CTX, config=cfg), r
        ),
        "model built": _best_us(lambda: step_cost_model(state, cfg), r),
    }
    queries = len(batches) * 5
    model_us = _best_us(model_only, r) / queries
    cold_us = (_best_us(cold_queries, r) / queries) - model_us
    warm_us = _best_us(warm_queries, r) / queries
    predict_us = _best_us(
        lambda: [predict_step_s(state, b, k, b * CTX) for b in batches for k in range(5)], r
    )
    rows["query, region's cells computed"] = cold_us
    rows["query, region's cells kept (mean over 5 per batch)"] = warm_us
    rows["prediction alone (predict_step_s)"] = predict_us / queries
    for name, us in rows.items():
        print(f"{name:52s} {us:9.1f} us")
    saved = {
        "columns extended": rows["columns built afresh"] - rows["columns extended"],
        "penalty scales kept": rows["penalty scales computed"],
        "cells per region": (cold_us - warm_us)
        * (QUERIES_PER_DECISION - REGIONS_PER_DECISION)
        * (5 / 4),  # warm_us includes each batch's first (cold) query
        # Memos of 0fd9f6b not kept: an answer per point and a correction per (region,
        # steps), each saving its part of the queries that repeat one.
        "answers per point": warm_us * REPEATS_PER_DECISION,
        "corrections per region and steps": max(0.0, warm_us - predict_us / queries)
        * PAIR_REPEATS_PER_DECISION,
    }
    _print_saved(saved)
    return 0


def _print_saved(saved: dict[str, float]) -> None:
    print(f"\nsaved per decision (budget for keeping one: >= {BUDGET_MS_PER_DECISION} ms)")
    for name, us in saved.items():
        verdict = "keep" if us / 1e3 >= BUDGET_MS_PER_DECISION else "drop"
        print(f"{name:52s} {us / 1e3:9.3f} ms  {verdict}")


if __name__ == "__main__":
    raise SystemExit(main())
