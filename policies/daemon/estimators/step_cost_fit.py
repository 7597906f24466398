"""The step-cost estimator's fit: robust non-negative least squares towards the prior.

Relative residuals ``(observed - predicted) / prior`` fitted by SciPy's ``nnls`` inside
an iteratively re-weighted loop with Huber weights on a robust (MAD) scale, with
pseudo-observations that pull each coefficient towards the (recalibrated) prior; see
:mod:`specgov.policies.daemon.estimators.step_cost` for the model. The medians here are the
estimator's one set: a rule on sorted values, the sort done by the caller's means.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from specgov.policies.daemon.estimators.step_cost_prior import N_FEATURES, StepCostPrior
from specgov.policies.daemon.estimators.step_cost_samples import SampleColumns, StepCostConfig

__all__ = [
    "fit",
    "median",
    "median_sorted",
    "penalty_scales",
    "weighted_median",
    "weighted_median_sorted",
]


def penalty_scales(prior: StepCostPrior, config: StepCostConfig) -> np.ndarray:
    """Typical relative contribution of one unit of each coefficient (data-independent).

    Computed per fit: 25 roofline evaluations, ~70 us (measured,
    ``benchmarks/bench_step_cost.py``), less than handing them from state to state
    would be worth (the bar is 0.2 ms per decision).
    """
    steps = (0, 1, 3, 5, 7) if prior.speculative else (0,)
    acc = np.zeros(N_FEATURES)
    count = 0
    for b in (1.0, 4.0, 16.0, 64.0, 256.0):
        for k in steps:
            kv = b * config.default_kv_tokens_per_request
            f = np.asarray(prior.features(b, k, kv))
            acc += f / prior.predict_s(b, k, kv)
            count += 1
    scales = acc / count
    # The extra knee terms share the main roofline's scale; nothing is left unpinned.
    scales[1] = scales[3] = scales[2]
    out: np.ndarray = np.maximum(scales, 1e-3)
    return out


def median_sorted(ordered: Sequence[float] | np.ndarray) -> float:
    """``np.median`` of non-empty values in ascending order: the middle value, or the
    mean of the two middle ones."""
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[mid])
    return float((ordered[mid - 1] + ordered[mid]) / 2.0)


def median(values: np.ndarray) -> float:
    """``np.median`` of a non-empty array (:func:`median_sorted` of its sort)."""
    return median_sorted(np.sort(values))


def weighted_median_sorted(values: Sequence[float], weights: Sequence[float]) -> float:
    """The weighted median of ``values`` in ascending order (the lower on a tie): the
    first whose cumulative weight reaches half the total; 1.0 when the weights are all
    zero (or there are none)."""
    cum = list(itertools.accumulate(weights))
    if not cum or cum[-1] <= 0:
        return 1.0
    return float(values[bisect.bisect_left(cum, 0.5 * cum[-1])])


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """:func:`weighted_median_sorted` of ``values`` ordered by ``np.argsort``."""
    order = np.argsort(values)
    return weighted_median_sorted(values[order].tolist(), np.asarray(weights)[order].tolist())


def _huber_weights(resid: np.ndarray, config: StepCostConfig) -> np.ndarray:
    """Huber IRLS weights on a robust (MAD) scale of the relative residuals."""
    mad = median(np.abs(resid - median(resid)))
    limit = config.huber_delta * max(1.4826 * mad, config.min_rel_scale)
    out: np.ndarray = np.minimum(1.0, limit / np.maximum(np.abs(resid), 1e-12))
    return out


def _recalibration(
    ratios: np.ndarray, weights: np.ndarray, steps: Sequence[int], config: StepCostConfig
) -> float:
    """The factor that scales the prior the fit is pulled towards.

    While the samples cover one step count only, the fit cannot tell which coefficients
    are off; pulled towards the raw prior, the least-penalised terms (the per-draft-step
    ones) absorb the whole scale error and the predicted cost goes flat in the steps, so
    an unrun larger step count looks free. Pulled towards the prior recalibrated by one
    factor (the weighted median of observed / predicted), the fit keeps the prior's shape
    where the data is silent, and is exact when the prior's only error is its scale.
    The pull (``prior_strength`` windows on each of the coefficients) outweighs a few
    windows, so this matters until the data dominates: once a second step count holds
    as much weight as the whole pull, the data pins the cost per step and the pull
    returns to the prior itself (log-linearly in between).
    """
    by_steps: dict[int, float] = {}
    for k, wk in zip(steps, weights.tolist(), strict=True):
        by_steps[k] = by_steps.get(k, 0.0) + wk
    covered = sorted(by_steps.values(), reverse=True)
    second = covered[1] if len(covered) > 1 else 0.0
    trust = min(1.0, second / (N_FEATURES * config.prior_strength))
    return float(weighted_median(ratios, weights) ** (1.0 - trust))


def fit(
    cols: SampleColumns,
    now_s: float,
    config: StepCostConfig,
    start: tuple[float, ...] | None = None,
) -> tuple[float, ...]:
    """Robust non-negative fit of ``cols``' samples at ``now_s``; ``start`` (the previous
    fit) seeds the Huber weights."""
    theta0 = np.asarray(cols.prior.prior_coefficients())
    if not cols.samples:
        return tuple(float(t) for t in theta0)
    feats = cols.features
    base = feats @ theta0  # prior prediction per sample
    x = feats / base[:, None]
    y = cols.step_s / base
    age = np.maximum(0.0, now_s - np.asarray(cols.time_s))
    w = np.asarray(cols.weight) * 0.5 ** (age / config.half_life_s)
    target = theta0 * _recalibration(y, w, cols.steps.tolist(), config)
    scales = penalty_scales(cols.prior, config)
    root_l = math.sqrt(config.prior_strength)
    pen_x = np.diag(root_l * scales)
    pen_y = root_l * scales * target
    theta = theta0 if start is None else np.asarray(start)
    huber = _huber_weights(y - x @ theta, config) if start is not None else np.ones(len(y))
    for _ in range(config.irls_iterations):
        sw = np.sqrt(w * huber)
        a = np.vstack([x * sw[:, None], pen_x])
        b = np.concatenate([y * sw, pen_y])
        new = np.maximum(nnls(a, b)[0], 0.0)
        huber = _huber_weights(y - x @ new, config)
        # Ten coefficients: plain Python (the same max of the same differences).
        new_l, old_l = new.tolist(), theta.tolist()
        step = max(abs(a - b) for a, b in zip(new_l, old_l, strict=True))
        converged = step < 1e-6 * max(1.0, max(new_l))
        theta = new
        if converged:
            break
    if not np.all(np.isfinite(theta)):
        return tuple(float(t) for t in theta0)
    return tuple(float(t) for t in theta)
